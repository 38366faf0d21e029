"""A tiny LTX-Video file that ComfyUI's own detection accepts (seeded random weights, float32).

Tier: detected file (the stock ``comfy.sd.load_diffusion_model`` on ComfyUI 0.3.75 and current
ComfyUI), no config in the file's metadata. ComfyUI's LTX-Video detection reads only the number of
transformer blocks and ``attn2.to_k``'s shape from the weights: 32 attention heads are pinned, so the
head width is ``to_k`` rows / 32, and the cross-attention width is ``to_k``'s columns (it must equal
the hidden width: the caption projection maps the text to the hidden width). The latent channels
(128, the LTX-Video VAE's) and the text width (T5-XXL's 4096) are ComfyUI's defaults and not read
from the weights, so the 4096-wide caption projection holds most of the parameters.

Layout: hidden 64 (32 heads of width 2), 2 blocks, 128 latent channels, text width 4096:
462,656 parameters (the same on both hosts). Model class ``LTXV`` (flow matching, ComfyUI's
``ModelSamplingFlux`` with shift 2.37).
"""

from __future__ import annotations

from pathlib import Path

LTXV_FILE = "pipetrainer-tiny-ltxv.safetensors"
HEADS = 32  # pinned by ComfyUI's detection
HEAD_DIM = 2
LAYERS = 2


def build_tiny_ltxv(path: Path, seed: int = 4242) -> Path:
    """Write the tiny LTX-Video transformer (see the module docstring) to ``path``."""
    import torch
    from comfy.ldm.lightricks.model import LTXVModel
    from safetensors.torch import save_file

    from .fixtures import _randomize_scaled

    hidden = HEADS * HEAD_DIM
    model = LTXVModel(in_channels=128, cross_attention_dim=hidden, attention_head_dim=HEAD_DIM,
                      num_attention_heads=HEADS, caption_channels=4096, num_layers=LAYERS,
                      device="meta", operations=torch.nn)
    state = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(_randomize_scaled(state, seed), str(path))
    return path
