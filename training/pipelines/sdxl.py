"""SDXL (``comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel`` in ``model_base.SDXL``) as pipeline stage layers.

Eps- and v-prediction SDXL models (and the smaller SDXL-class distillations ComfyUI loads as
``model_base.SDXL``: SSD-1B, Vega, KOALA) share one data flow; which target the loss uses is decided
by the model's own ``model_sampling`` (ComfyUI reads the ``v_pred`` / ``ztsnr`` flags of the file),
in training/objective/loss.py. Playground 2.5 (EDM prediction) has another formula and is refused there by
name; inpainting and InstructPix2Pix SDXL (image latents concatenated to the noise) are refused here;
the refiner (``SDXLRefiner``) is another model class and is not registered. CosXL-style files
(``edm_vpred``: v-prediction on ComfyUI's continuous EDM schedule, ``ModelSamplingContinuousEDM``
with the file's own sigma range) train with the v target, and their default sigmas span the file's
range as ComfyUI's ``normal`` scheduler does (training/objective/timesteps.py ``timestep_range``: their
timesteps are ``log(sigma) / 4``, so the range starts at ``timestep(sigma_min)``, not at 0).
Flow-only timestep settings (shift none / fixed / resolution, sigma_min / sigma_max) are refused for
every SDXL model in preflight (training/pipelines/checks.py ``timestep_problems``).

The stage layers are the LDM UNet's (training/pipelines/unet.py, shared with SD 1.x / 2.x): SDXL's
embed stage takes ``(x, timestep, context, y)`` and adds the label embedding of ``y`` to the time
embedding; ``context`` leaves the tuple after the last output block with a transformer (output 5 on
full-size SDXL, whose level-1 blocks have none).

The skip tensors cross every boundary inside the UNet: at 1024x1024 SDXL they are ~27 M values
per image at most (the boundary after the middle block), 54 MB in bf16. Partitioning: on full-size
SDXL the weights sit in the 1280-channel blocks with 10 transformer layers (input 7-8, middle, output
0-2: ~0.4 B parameters each, the other layers 3-40 M), so DeepSpeed's ``parameters`` method (the
default) is the balanced one: 3 stages split after input 8 and after output 0 (~0.86 / 0.81 / 0.89 B
parameters), while ``uniform`` (equal layer counts) would give ~0.06 / 2.38 / 0.12 B. Compute is less
lopsided than weights (the 320-channel ResBlocks run at full latent resolution), so the last stage of a
parameter-balanced split does the most work per weight. Every split of 2-4 stages by either method
keeps LoRA targets on every stage; tests/test_sdxl.py pins this on the real layout (meta device).

Size / crop conditioning. ComfyUI's ``SDXL.encode_adm`` builds ``y`` from the pooled CLIP-G vector and
256-wide Fourier embeddings of ``(height, width, crop_h, crop_w, target_height, target_width)`` in
pixels. The honest values are the source image's size and the crop the bucketing made: the Cache
node writes them as the extra ``size_crop`` (int64 ``[6]`` in that order, in the latent entry) when it
encodes with SDXL's text encoders (:meth:`SDXLAdapter.cache_extras`; training/cache/prep_extras.py):
the source's size as decoded, the top/left offset of the bucket's window in the source scaled to
cover the bucket, and the bucket's size (what kohya's trainers call ``original_size``,
``crop_coords`` and ``target_size``). A cache without it (written before, or by hand) falls back to
what ComfyUI's samplers feed a plain ``CLIPTextEncode``: the latent's size times 8 for both sizes and
no crop (``encode_model_conds``), i.e. "made at exactly this size, uncropped", which is what sampling
asks for but does not teach the model which training images were upscaled or cropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from .base import Batch, ExtraSpec, register
from .options import NoOptions
from .unet import UNetAdapter, context_dim, unet_problem

if TYPE_CHECKING:
    from ..cache.prep_extras import CacheExtra, ItemCrop

SIZE_EXTRA = "size_crop"
SIZE_CROP_VERSION = 1  # of size_crop_of; part of the latent key of caches that hold it
SIZE_VALUES = 6  # height, width, crop_h, crop_w, target_height, target_width (model_base.SDXL.encode_adm)
SIZE_EMBED_DIM = 256  # model_base.SDXL.embedder = Timestep(256)
PIXELS_PER_LATENT = 8  # what comfy.samplers.encode_model_conds multiplies the latent size by


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    if not isinstance(dm, UNetModel):
        return f"{type(dm).__name__} is not an SDXL UNet; the SDXL adapter cannot train it."
    if dm.in_channels != dm.out_channels:
        return (f"This SDXL model takes {dm.in_channels} input channels for {dm.out_channels} output channels: an "
                "inpainting or InstructPix2Pix model (image latents concatenated to the noise), which the SDXL "
                "adapter does not feed. Text-to-image SDXL models (eps or v-prediction) are supported.")
    if getattr(dm, "num_classes", None) != "sequential" or not hasattr(dm, "label_emb"):
        return "This UNet takes no SDXL size/pooled-text vector (label_emb); only SDXL models are supported."
    if _size_dims(dm) <= 0:
        return (f"This SDXL model's label embedding takes {_adm_channels(dm)} values, fewer than the "
                f"{SIZE_VALUES * SIZE_EMBED_DIM} of ComfyUI's size/crop embedding; it is not an SDXL layout.")
    return unet_problem(dm, "SDXL")


def _adm_channels(dm: nn.Module) -> int:
    return int(dm.label_emb[0][0].in_features)


def _size_dims(dm: nn.Module) -> int:
    """Width of the pooled text vector: the label embedding's input minus the size/crop embeddings."""
    return _adm_channels(dm) - SIZE_VALUES * SIZE_EMBED_DIM


class SDXLAdapter(UNetAdapter):
    name = "SDXL"
    options_type = NoOptions
    with_label = True

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(context width, pooled width)``: CLIP-L + CLIP-G penultimate states (2048) and CLIP-G's pooled 1280."""
        return context_dim(diffusion_model), _size_dims(diffusion_model)

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {SIZE_EXTRA: ExtraSpec(
            shape=(SIZE_VALUES,), source="latent", required=False,
            description=("the image's original size, crop offset and target size in pixels "
                         "(height, width, crop_h, crop_w, target_height, target_width)"))}

    def cache_extras(self, clip: object) -> Mapping[str, CacheExtra]:
        """``size_crop`` for every item, when the Cache node encodes with SDXL's text encoders.

        The Cache node sees no model; ComfyUI's ``SDXLClipModel`` (CLIP-L + CLIP-G, what SDXL checkpoints
        and DualCLIPLoader's ``sdxl`` type load) is the sign that the cache is for an SDXL-class model."""
        from comfy.sdxl_clip import SDXLClipModel

        from ..cache.prep_extras import CacheExtra

        if not isinstance(getattr(clip, "cond_stage_model", None), SDXLClipModel):
            return {}
        return {SIZE_EXTRA: CacheExtra(SIZE_CROP_VERSION, size_crop_of)}

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        noisy = batch.noisy
        if batch.pooled is None:
            raise ValueError("SDXL needs the pooled CLIP-G text vector, and the cache has none: cache the dataset "
                             "with SDXL's CLIP (CLIP-L + CLIP-G, e.g. from the SDXL checkpoint).")
        sizes = batch.extras.get(SIZE_EXTRA)
        if sizes is None:
            sizes = default_size_crop(tuple(noisy.shape[-2:])).expand(noisy.shape[0], SIZE_VALUES)
        y = torch.cat((batch.pooled.to(noisy.dtype), size_embedding(sizes).to(noisy.dtype)), dim=1)
        return noisy, batch.timestep, batch.cond, y


def size_crop_of(crop: ItemCrop) -> torch.Tensor:
    """``[6]`` int64 in ``SDXL.encode_adm``'s order (``CLIPTextEncodeSDXL``'s height, width, crop_h, crop_w,
    target_height, target_width): the source's size, the crop's top/left offset, the bucket's size."""
    return torch.tensor([crop.source_height, crop.source_width, crop.crop_top, crop.crop_left, crop.height,
                         crop.width], dtype=torch.int64)


def default_size_crop(latent_hw: tuple[int, int]) -> torch.Tensor:
    """``[1, 6]`` int64: what ComfyUI's samplers feed SDXL for a plain text conditioning (latent size x 8 for
    the original and target size, no crop), used when the cache holds no ``size_crop`` extra."""
    h, w = (int(v) * PIXELS_PER_LATENT for v in latent_hw)
    return torch.tensor([[h, w, 0, 0, h, w]], dtype=torch.int64)


def size_embedding(sizes: torch.Tensor) -> torch.Tensor:
    """``[B, 6 * 256]``: ComfyUI's Fourier embedding of each size value, flattened as ``SDXL.encode_adm`` does."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import Timestep

    batch = sizes.shape[0]
    return Timestep(SIZE_EMBED_DIM)(sizes.reshape(-1).float()).reshape(batch, SIZE_VALUES * SIZE_EMBED_DIM)


ADAPTER = register(SDXLAdapter(), model_classes=("SDXL",))
