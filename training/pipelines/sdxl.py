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

Stage tuples (``B`` batch, ``T`` text tokens; ``hs`` the UNet's skip stack, newest last):

- embed: ``(x, timestep, context, y)`` -> ``(emb, context, h0)``: time embedding plus the ``y``
  vector's label embedding (ComfyUI's ``_forward``), then ``input_blocks.0`` (the input conv), whose
  output is the first skip;
- input block ``k``: ``(emb, context, *hs)`` -> ``(emb, context, *hs, h_k)``: the running activation
  is always the newest skip, so no tensor appears twice in a tuple (a stage boundary would otherwise
  send it twice and split its gradient);
- middle block: ``(emb, context, *hs)`` -> ``(h, emb, context, *hs)``;
- output block ``j``: ``(h, emb, context, *hs)`` -> ``(h, emb, context, *hs[:-1])``: it pops the newest
  skip, concatenates it to ``h`` and upsamples to the next skip's size (``output_shape``, as ComfyUI
  does, so odd latent sizes come back exactly). Once no later layer has a transformer, ``context`` is
  dropped from the tuple, and the last output block drops ``emb`` too: a tensor that crosses a stage
  boundary must be used by the receiving side (training/loop/engine.py);
- out: ``(h,)`` -> the prediction, shaped like ``x``.

So the skip tensors cross every boundary inside the UNet: at 1024x1024 SDXL they are ~27 M values
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

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_unsupported, register
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds

if TYPE_CHECKING:
    from ..cache.prep_extras import CacheExtra, ItemCrop

SIZE_EXTRA = "size_crop"
SIZE_CROP_VERSION = 1  # of size_crop_of; part of the latent key of caches that hold it
SIZE_VALUES = 6  # height, width, crop_h, crop_w, target_height, target_width (model_base.SDXL.encode_adm)
SIZE_EMBED_DIM = 256  # model_base.SDXL.embedder = Timestep(256)
PIXELS_PER_LATENT = 8  # what comfy.samplers.encode_model_conds multiplies the latent size by

_BLOCKS = r"(input_blocks\.\d+|middle_block|output_blocks\.\d+)"
_ATTENTION = r"\d+\.transformer_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)"
_MLP = r"\d+\.transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)"
# all_linear adds the SpatialTransformer's linear projections and every ResBlock's time-embedding
# projection (the UNet's analogue of a transformer's modulation): every Linear inside the blocks.
_REST = r"\d+\.(proj_in|proj_out|emb_layers\.1)"
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    "all_linear": rf"{_ATTENTION}|{_MLP}|{_REST}",
}


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
    if dm.middle_block is None:
        return "This SDXL-class UNet has no middle block; PipeTrainer's SDXL adapter needs one."
    if getattr(dm, "predict_codebook_ids", False) or getattr(dm, "heatmap_head", None) is not None:
        return "This UNet has a different output head (codebook ids or a heatmap head); it cannot be trained as SDXL."
    if _size_dims(dm) <= 0:
        return (f"This SDXL model's label embedding takes {_adm_channels(dm)} values, fewer than the "
                f"{SIZE_VALUES * SIZE_EMBED_DIM} of ComfyUI's size/crop embedding; it is not an SDXL layout.")
    if _context_dim(dm) == 0 or _last_output_with_transformer(dm) < 0:
        return ("This UNet has no transformer in its output blocks, which the SDXL adapter's stage tuples (and "
                "its LoRA presets) need; standard SDXL layouts have them.")
    return None


def _last_output_with_transformer(dm: nn.Module) -> int:
    """Index of the last output block with a transformer (-1: none): ``context`` is dropped after it."""
    from comfy.ldm.modules.attention import SpatialTransformer

    with_transformer = [j for j, block in enumerate(dm.output_blocks)
                        if any(isinstance(m, SpatialTransformer) for m in block.modules())]
    return max(with_transformer, default=-1)


def _adm_channels(dm: nn.Module) -> int:
    return int(dm.label_emb[0][0].in_features)


def _size_dims(dm: nn.Module) -> int:
    """Width of the pooled text vector: the label embedding's input minus the size/crop embeddings."""
    return _adm_channels(dm) - SIZE_VALUES * SIZE_EMBED_DIM


def _context_dim(dm: nn.Module) -> int:
    """Text width of the cross-attention (read from the first transformer; 0 without one)."""
    for name, module in dm.named_modules():
        if name.endswith("transformer_blocks.0.attn2.to_k") and isinstance(module, nn.Linear):
            return int(module.in_features)
    return 0


def _run(block: nn.Module, h: torch.Tensor, emb: torch.Tensor, context: torch.Tensor | None,
         output_shape=None) -> torch.Tensor:
    """One of ComfyUI's ``TimestepEmbedSequential`` blocks, called as ``UNetModel._forward`` calls it."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import forward_timestep_embed

    with OutOfPlaceResidualAdds(h):
        return forward_timestep_embed(block, h, emb, context, {}, output_shape)


class SDXLEmbed(StageLayer):
    """Time and label (``y``) embeddings, then the input convolution (``input_blocks.0``): the first skip."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "time_embed", "label_emb")
        self.adopt("conv_in", dm.input_blocks[0], "input_blocks.0")
        self.model_channels = dm.model_channels

    def forward(self, inputs):
        from comfy.ldm.modules.diffusionmodules.util import timestep_embedding

        x, timestep, context, y = inputs
        t_emb = timestep_embedding(timestep, self.model_channels, repeat_only=False).to(x.dtype)
        emb = self.time_embed(t_emb) + self.label_emb(y)
        return emb, context, _run(self.conv_in, x, emb, context)


class SDXLInputBlock(StageLayer):
    """One down-path block: runs on the newest skip and pushes its output as the next one."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int):
        super().__init__()
        self.adopt("block", dm.input_blocks[index], f"input_blocks.{index}")

    def forward(self, inputs):
        emb, context, *hs = inputs
        return (emb, context, *hs, _run(self.block, hs[-1], emb, context))


class SDXLMiddle(StageLayer):
    swappable = True

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("block", dm.middle_block, "middle_block")

    def forward(self, inputs):
        emb, context, *hs = inputs
        return (_run(self.block, hs[-1], emb, context), emb, context, *hs)


class SDXLOutputBlock(StageLayer):
    """One up-path block: concatenates the newest skip, upsamples to the next skip's size.

    ``gets_context``: the tuple it receives still holds ``context`` (some block from here on has a
    transformer); ``keeps_context``: a later block needs it, so it is passed on.
    """

    swappable = True

    def __init__(self, dm: nn.Module, index: int, gets_context: bool, keeps_context: bool, last: bool):
        super().__init__()
        self.adopt("block", dm.output_blocks[index], f"output_blocks.{index}")
        self.gets_context, self.keeps_context, self.last = gets_context, keeps_context, last

    def forward(self, inputs):
        if self.gets_context:
            h, emb, context, *hs = inputs
        else:
            (h, emb, *hs), context = inputs, None
        skip = hs.pop()
        output_shape = hs[-1].shape if hs else None
        h = _run(self.block, torch.cat([h, skip], dim=1), emb, context, output_shape)
        if self.last:
            return (h,)
        if self.keeps_context:
            return (h, emb, context, *hs)
        return (h, emb, *hs)


class SDXLOut(StageLayer):
    """Final GroupNorm, SiLU and convolution (``out``)."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt("out", dm.out, "out")

    def forward(self, inputs):
        (h,) = inputs
        return self.out(h)


class SDXLAdapter:
    name = "SDXL"
    options_type = NoOptions

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n_out = len(dm.output_blocks)
        last_context = _last_output_with_transformer(dm)
        outputs = [SDXLOutputBlock(dm, j, gets_context=j <= last_context, keeps_context=j < last_context,
                                   last=j == n_out - 1) for j in range(n_out)]
        inputs = [SDXLInputBlock(dm, k) for k in range(1, len(dm.input_blocks))]
        return [SDXLEmbed(dm), *inputs, SDXLMiddle(dm), *outputs, SDXLOut(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        blocks = len(diffusion_model.input_blocks) - 1 + 1 + len(diffusion_model.output_blocks)
        return [False, *([True] * blocks), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"{_BLOCKS}\.({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        """No patches: the UNet takes any latent size (its down-sampling rounds up and ComfyUI's up-sampling
        matches each skip's size). Below 2 latent pixels per side at the deepest level nothing is left."""
        levels = len(diffusion_model.channel_mult) if hasattr(diffusion_model, "channel_mult") else 3
        return Geometry(patch=(1, 1, 1), min_patches=2 * 2 ** (levels - 1))

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(context width, pooled width)``: CLIP-L + CLIP-G penultimate states (2048) and CLIP-G's pooled 1280."""
        return _context_dim(diffusion_model), _size_dims(diffusion_model)

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

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """Latent pixels (the UNet has no tokens; only the resolution-dependent shift reads this)."""
        h, w = latent_shape[-2:]
        return int(h) * int(w)

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

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch; the others get zero tokens, nothing is cut.

        ComfyUI's SDXL CLIP encodes captions in 77-token chunks (padded with the end token, in the cache),
        so only a caption past 75 tokens makes the others of its batch longer. ComfyUI's UNet takes no text
        attention mask, so those zero tokens take part in the cross-attention. (ComfyUI itself repeats the
        shorter cond to a common multiple when it batches conds, which leaves attention unchanged; the
        shared batching appends zeros.)"""
        return max(lengths)


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
