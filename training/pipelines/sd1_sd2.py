"""SD 1.x and SD 2.x (``model_base.BaseModel`` built from ComfyUI's ``SD15`` / ``SD20`` configs) as pipeline stage layers.

Why a family of its own, and why so small: SD 1.x and 2.x run the same LDM UNet as SDXL
(``openaimodel.UNetModel``), so the stage layers, LoRA presets and geometry are the shared ones of
training/pipelines/unet.py. What differs is the conditioning: no ``y`` vector (``adm_in_channels`` None,
no label embedding), only the cross-attention context, CLIP-L's 768-wide states for SD 1.x and
OpenCLIP-H's 1024-wide ones for SD 2.x (``conditioning_dims`` reads the width from the model), and no
pooled vector. So the embed stage takes ``(x, timestep, context)``, and ``context`` stays in the tuple to
the last output block (SD 1.x / 2.x have transformers on their first level's up-path blocks).

Eps or v. SD 1.x and SD 2.0/2.1 512 are eps-prediction, SD 2.x 768-v v-prediction. Nothing here
decides which: ComfyUI does, when it builds the model (``SD20.model_type`` reads the file; ComfyUI's SD15
config is always eps), and training/objective/loss.py takes the target from the model's own
``model_sampling`` (its noise schedule too: the 1000 discrete steps ComfyUI samples). A
ModelSamplingDiscrete node (v_prediction / zsnr, for v-prediction SD 1.x fine-tunes) before Train LoRA is
refused like any sampling patch the training process cannot replay (training/model/sampling_override.py). SD 2.x
UNets compute attention in fp32 (``attn_precision`` in ComfyUI's SD20 config); the stage layers run
ComfyUI's own attention modules, so training does the same.

Registry. ComfyUI builds these models as the plain ``BaseModel`` class, the base class of every other
model class, so it is registered exactly (training/pipelines/base.py ``register``): a subclass such as
``SDXLRefiner`` or ``AuraFlow`` is not taken for SD 1.x. The relatives that cannot train this way are
registered by name so that they are refused with the reason rather than as unknown models:

- inpainting models (SD 1.5 / 2.0 inpainting: 9 input channels, the mask and the masked image's latent
  concatenated to the noise) and InstructPix2Pix (``SD15_instructpix2pix``: 8 channels, the input
  image's latent): the cache holds no such per-item image latents;
- the SD x4 upscaler (``SD_X4Upscaler``: 7 channels, the low-resolution RGB image concatenated to the
  noise, and a noise-level class label);
- SD 2.1 unCLIP (``SD21UNCLIP``): conditioned on a noise-augmented CLIP image embedding through
  ``label_emb``, which the cache does not encode.

Stable Zero123 (``Stable_Zero123``, a ``BaseModel`` subclass with a camera projection) is not
registered and stays an unknown model.

Partitioning: on SD 1.5 (0.86 B parameters) the weights sit in the 1280-channel blocks (input 7-11, the
middle block, output 0-5: 15-97 M parameters each; the 320-channel blocks hold 1-5 M), so DeepSpeed's
``parameters`` split (the default) is the balanced one: 2 stages split after output 1 (0.45 / 0.41 B), 3
after input 11 and after output 3 (0.25 / 0.34 / 0.27 B); SD 2.x splits alike. tests/test_sd1_sd2.py pins
this on the real SD 1.5 and SD 2.1 layouts (meta device), detected by ComfyUI, and checks that every split of
2-4 stages keeps LoRA targets on every stage.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .base import Batch, ExtraSpec, register
from .options import NoOptions
from .unet import UNetAdapter, context_dim, unet_problem

FAMILY = "SD1/SD2"
SUPPORTED = "Text-to-image SD 1.x / 2.x models (eps or v-prediction) are supported."

# Input channels beyond the 4 latent channels -> what they are (ComfyUI's configs: SD15 / SD20 inpainting
# 9, SD15_instructpix2pix 8, SD_X4Upscaler 7).
_CONCATENATED = {
    5: "an inpainting model (the mask and the masked image's latent concatenated to the noise)",
    4: "an InstructPix2Pix model (the input image's latent concatenated to the noise)",
    3: ("the SD x4 upscaler (the low-resolution RGB image concatenated to the noise, plus a noise-level "
        "class label)"),
}


def support_problem(dm: nn.Module) -> str | None:
    """Why this ``BaseModel``-class UNet cannot train as SD 1.x / 2.x text-to-image (or None)."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    if not isinstance(dm, UNetModel):
        return f"{type(dm).__name__} is not an SD 1.x / 2.x UNet; the {FAMILY} adapter cannot train it."
    if dm.in_channels != dm.out_channels:
        kind = _CONCATENATED.get(dm.in_channels - dm.out_channels,
                                 "a model that takes image channels concatenated to the noise")
        return (f"This SD 1.x / 2.x model takes {dm.in_channels} input channels for {dm.out_channels} output "
                f"channels: {kind}, which PipeTrainer's cache does not provide. {SUPPORTED}")
    if getattr(dm, "num_classes", None) is not None or hasattr(dm, "label_emb"):
        if dm.num_classes == "sequential":
            return ("This SD 2.x model takes a CLIP image-embedding vector (label_emb): an unCLIP model, conditioned on "
                    "a noise-augmented CLIP-vision embedding that PipeTrainer's cache does not encode. " + SUPPORTED)
        return (f"This SD 1.x / 2.x UNet takes class labels (num_classes {dm.num_classes}), which PipeTrainer's "
                f"cache does not provide. {SUPPORTED}")
    return unet_problem(dm, FAMILY)


class SD1SD2Adapter(UNetAdapter):
    name = FAMILY
    options_type = NoOptions
    with_label = False

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = support_problem(diffusion_model)
        return [problem] if problem else []

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(context width, 0)``: CLIP-L's hidden states (768 wide, SD 1.x) or OpenCLIP-H's (1024, SD 2.x);
        no pooled vector."""
        return context_dim(diffusion_model), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {}

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if batch.cond is None:
            raise ValueError("SD 1.x / 2.x needs the text encoder's states, and the cache has none: cache the "
                             "dataset with the checkpoint's CLIP.")
        return batch.noisy, batch.timestep, batch.cond


ADAPTER = register(SD1SD2Adapter(), model_classes=("SD15_instructpix2pix", "SD_X4Upscaler", "SD21UNCLIP"),
                   exact_classes=("BaseModel",))
