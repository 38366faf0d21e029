"""Encoder identity and encoding with ComfyUI's VAE and CLIP objects (runs in the ComfyUI process).

The identity of an encoder is a fingerprint of its weights plus its dtype, not a file name: a VAE
swapped under the same name, or the same file loaded in another dtype, gets a new identity.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from PIL import Image, ImageOps

_SAMPLES_PER_TENSOR = 4096


def weights_fingerprint(module: torch.nn.Module) -> str:
    """Names, shapes, dtypes and a strided sample of every tensor's values."""
    h = hashlib.blake2b(digest_size=20)
    for name, t in sorted(module.state_dict().items()):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::step][:_SAMPLES_PER_TENSOR].to("cpu", torch.float32)
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def vae_identity(vae) -> str:
    return f"{weights_fingerprint(vae.first_stage_model)}:{vae.vae_dtype}"


def text_encoder_identity(clip) -> str:
    model = clip.cond_stage_model
    dtype = next((p.dtype for p in model.parameters()), None)
    return f"{weights_fingerprint(model)}:{dtype}"


def load_pixels(path: str, resolution: int) -> torch.Tensor:
    """RGB image resized to cover ``resolution`` and center-cropped: [1, H, W, 3] floats in [0, 1]."""
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img).convert("RGB")
        img = ImageOps.fit(img, (resolution, resolution), method=Image.Resampling.LANCZOS)
        arr = np.asarray(img, dtype=np.float32) / 255.0
    return torch.from_numpy(arr)[None]


def encode_latent(vae, pixels: torch.Tensor) -> torch.Tensor:
    return vae.encode(pixels[:, :, :, :3]).to(torch.float32).cpu()


def encode_text(clip, caption: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    tokens = clip.tokenize(caption)
    cond, pooled = clip.encode_from_tokens(tokens, return_pooled=True)
    return cond.to(torch.float32).cpu(), None if pooled is None else pooled.to(torch.float32).cpu()
