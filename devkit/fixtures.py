"""Tiny real models and a demo dataset, built from fixed seeds in ComfyUI's own architectures.

Nothing is downloaded: weights are seeded random tensors saved in the layout ComfyUI's stock loaders
detect from shapes (UNETLoader, CLIPLoader, VAELoader). The files are rebuilt only when missing, and
the same seed always gives the same bytes, so file fingerprints are stable across machines (for one
ComfyUI version: key names follow its classes, e.g. current ComfyUI's Flux RMSNorm weights are
``.weight`` where 0.3.75 has ``.scale``; both load through ComfyUI's own loaders).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

MMDIT_FILE = "pipetrainer-tiny-mmdit.safetensors"
FLUX_FILE = "pipetrainer-min-flux.safetensors"
FLUX_BALANCED_FILE = "pipetrainer-min-flux-2d0s.safetensors"  # two equal pipeline halves (memory tests)
CLIP_FILE = "pipetrainer-tiny-clip-l.safetensors"
VAE_FILE = "pipetrainer-tiny-taesd16.safetensors"
DEMO_DATASET = "pipetrainer_demo"


@dataclass(frozen=True)
class FixturePaths:
    mmdit: Path
    clip: Path
    vae: Path
    dataset: Path


def _seeded(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return g


def _randomize(state: dict, seed: int, std: float = 0.02) -> dict:
    """Replace every float tensor with seeded noise (norm weights near 1) so no layer is uninitialised."""
    import torch

    g = _seeded(seed)
    out = {}
    for name in sorted(state):
        t = state[name]
        if not t.is_floating_point():
            out[name] = t.clone()
            continue
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32) * std
        if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", "ln_k.weight", ".scale")):
            noise = noise + 1.0
        out[name] = noise.to(t.dtype).contiguous()
    return out


def build_tiny_mmdit(path: Path, seed: int = 1234) -> Path:
    """SD3-family MMDiT, depth 4 (hidden 256), 16-channel latents, CLIP-L sized context and pooled."""
    import torch
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper
    from safetensors.torch import save_file

    model = OpenAISignatureMMDITWrapper(
        input_size=None, patch_size=2, in_channels=16, out_channels=16, depth=4,
        adm_in_channels=768, num_patches=32 * 32, pos_embed_max_size=32, pos_embed_scaling_factor=None,
        context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 768, "out_features": 256}},
        operations=torch.nn, dtype=torch.float32,
    )
    state = _randomize(model.state_dict(), seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def build_tiny_clip_l(path: Path, seed: int = 4321) -> Path:
    """A CLIP-L text encoder with ComfyUI's fixed config and seeded weights (fp16 on disk)."""
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu",
    )
    model = CLIPTextModelWithProjection(config)
    state = {k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items() if "position_ids" not in k}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def build_tiny_taesd16(path: Path, seed: int = 999) -> Path:
    """ComfyUI's TAESD with 16 latent channels (VAELoader detects it from ``taesd_decoder.1.weight``)."""
    import torch
    from comfy.taesd.taesd import TAESD
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = TAESD(latent_channels=16)
    with torch.no_grad():  # ComfyUI's layers skip init: initialise every weight here
        for name, p in model.named_parameters():
            if p.ndim > 1:
                torch.nn.init.kaiming_uniform_(p, a=5**0.5)
            elif name.endswith("bias"):
                p.zero_()
        # Random convolutions shrink activations to ~1e-2; a real VAE gives latents of order one. Set
        # TAESD's own latent scale so these latents are unit-sized too, or there is nothing to learn.
        probe = torch.rand(4, 3, 64, 64, generator=_seeded(seed))
        model.vae_scale.fill_(model.taesd_encoder(probe).std())
        # Likewise the decoder: centre its output on mid-grey with visible contrast, so sampled images
        # are not uniformly black and a LoRA's effect shows in the pixels.
        last = [m for m in model.taesd_decoder.modules() if isinstance(m, torch.nn.Conv2d)][-1]
        pixels = model.decode(model.encode(probe * 2 - 1))
        last.weight.mul_(0.5 / pixels.std())
        last.bias.fill_(0.5)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def flux_params(**params) -> dict:
    """Keyword arguments for ComfyUI's ``Flux`` class on whichever ComfyUI is imported.

    ``FluxParams`` grows with ComfyUI: current versions (seen on 0.28) require ``txt_ids_dims`` (the
    rotary axes along which text tokens count up; ``[]`` for Flux.1, whose text positions are all
    zero), which 0.3.75 does not know. Flux.1 values are filled in for such fields when this host's
    dataclass has them; everything in ``params`` is passed as given.
    """
    import dataclasses

    from comfy.ldm.flux.model import FluxParams

    fields = {f.name for f in dataclasses.fields(FluxParams)}
    flux1 = {"txt_ids_dims": []}
    return {**{k: v for k, v in flux1.items() if k in fields}, **params}


def build_min_flux(path: Path, seed: int = 77, double_blocks: int = 1, single_blocks: int = 1) -> Path:
    """The smallest Flux ComfyUI detects: hidden 3072, 1 double + 1 single block, 768-d context/vec.

    Detection pins 24 heads and rotary axes [16, 56, 56] (so hidden 3072): 525 M parameters, bf16 on
    disk (other block counts: see :func:`build_balanced_flux`). ``comfy.sd.load_diffusion_model``
    detects it as ``Flux`` with no missing or unexpected keys (tests/test_flux.py). The module is built on the meta device: only its key names, shapes and
    dtypes are used, so it needs no memory (the file's bytes are the same as with a real module).
    """
    import torch
    from comfy.ldm.flux.model import Flux
    from safetensors.torch import save_file

    model = Flux(
        image_model="flux", operations=torch.nn, dtype=torch.bfloat16, device="meta",
        **flux_params(in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=768, hidden_size=3072,
                      mlp_ratio=4.0, num_heads=24, depth=double_blocks, depth_single_blocks=single_blocks,
                      axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False),
    )
    state = _randomize(model.state_dict(), seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def build_balanced_flux(path: Path, seed: int = 77) -> Path:
    """Flux-min with 2 double blocks and no single block (723 M parameters): two equal pipeline halves.

    A double block (340 M) is 2.4 single blocks (142 M), and the embedders (25 M) and the final layer
    (19 M) are alike, so (embed, double) | (double, final) splits the weights 50/50, where the 1 + 1
    layout gives the first stage 69 % and 1 + 2 gives 55 %. Per-rank memory is asserted on this one
    (tests/test_stage_memory.py); a rank's fixed cost (imports, ~0.55 GB) leaves no room for an
    unbalanced split under the 0.6x criterion.
    """
    return build_min_flux(path, seed, double_blocks=2, single_blocks=0)


WAN_T2V_FILE = "pipetrainer-tiny-wan-t2v.safetensors"


def _randomize_scaled(state: dict, seed: int) -> dict:
    """Seeded weights of the scale a trained network has: matrices ~ 1/sqrt(fan in), norm weights near 1,
    biases and modulations small, so every path (attention, RoPE, modulation) matters numerically."""
    import torch

    g = _seeded(seed)
    out = {}
    for name in sorted(state):
        t = state[name]
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
        if name.endswith(".weight") and "norm" in leaf:
            value = 1.0 + 0.1 * noise
        elif name.endswith(".weight") and t.ndim >= 2:
            value = noise / math.sqrt(math.prod(t.shape[1:]))
        elif name.endswith("modulation"):
            value = 0.1 * noise
        else:
            value = 0.02 * noise
        out[name] = value.to(t.dtype).contiguous()
    return out


def build_tiny_wan_t2v(path: Path, seed: int = 2121) -> Path:
    """Wan 2.1 text-to-video with the smallest dims ComfyUI's detection accepts: 1.1 M parameters.

    Detection reads dim (128, so 128 // 128 = 1 head), ffn (256), blocks (2), in/out channels (16) from
    the keys and shapes, and pins ``text_dim`` to 4096 (UMT5-XXL); the file carries no metadata config.
    """
    import torch
    from comfy.ldm.wan.model import WanModel
    from safetensors.torch import save_file

    model = WanModel(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=128, ffn_dim=256, freq_dim=256,
                     text_dim=4096, out_dim=16, num_heads=1, num_layers=2, device="meta", operations=torch.nn)
    state = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(_randomize_scaled(state, seed), str(path))
    return path


_DEMO_CAPTIONS = (
    "a red circle on a blue background",
    "a yellow square on a green background",
    "a white triangle on a black background",
    "a purple circle on an orange background",
)


def build_demo_dataset(folder: Path, size: int = 64, seed: int = 5) -> Path:
    """Four simple shape images with same-name .txt captions."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    colors = {"red": (220, 30, 30), "blue": (30, 60, 200), "yellow": (230, 220, 40), "green": (40, 160, 60),
              "white": (245, 245, 245), "black": (10, 10, 10), "purple": (130, 40, 160), "orange": (240, 140, 30)}
    folder.mkdir(parents=True, exist_ok=True)
    for i, caption in enumerate(_DEMO_CAPTIONS):
        words = caption.split()
        fg, bg = colors[words[1]], colors[words[-2]]
        img = Image.new("RGB", (size, size), bg)
        d = ImageDraw.Draw(img)
        m = rng.randint(8, 14)
        box = (m, m, size - m, size - m)
        shape = words[2]
        if shape == "circle":
            d.ellipse(box, fill=fg)
        elif shape == "square":
            d.rectangle(box, fill=fg)
        else:
            d.polygon([(size // 2, m), (size - m, size - m), (m, size - m)], fill=fg)
        img.save(folder / f"demo_{i:02d}.png")
        (folder / f"demo_{i:02d}.txt").write_text(caption + "\n", encoding="utf-8")
    return folder


def ensure_fixtures(comfyui: Path, *, flux: bool = False, balanced_flux: bool = False) -> FixturePaths:
    """Build whatever fixture is missing under a ComfyUI tree's ``models`` and ``input`` folders."""
    models = comfyui / "models"
    paths = FixturePaths(
        mmdit=models / "diffusion_models" / MMDIT_FILE,
        clip=models / "text_encoders" / CLIP_FILE,
        vae=models / "vae" / VAE_FILE,
        dataset=comfyui / "input" / DEMO_DATASET,
    )
    builders = ((paths.mmdit, build_tiny_mmdit), (paths.clip, build_tiny_clip_l), (paths.vae, build_tiny_taesd16))
    for target, build in builders:
        if not target.exists():
            _build_atomically(target, build)
    if not (paths.dataset / "demo_00.txt").exists():
        build_demo_dataset(paths.dataset)
    flux_path = models / "diffusion_models" / FLUX_FILE
    if flux and not flux_path.exists():
        _build_atomically(flux_path, build_min_flux)
    balanced = models / "diffusion_models" / FLUX_BALANCED_FILE
    if balanced_flux and not balanced.exists():
        _build_atomically(balanced, build_balanced_flux)
    return paths


def _build_atomically(target: Path, build) -> None:
    """Build into a file of this process's own, then rename: test processes running side by side
    (pytest-xdist workers) may build the same seeded fixture at once, and each rename installs a
    whole, identical file."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.building")
    try:
        build(tmp)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
