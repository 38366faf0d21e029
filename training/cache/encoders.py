"""What the cache encodes with: a small contract, and its implementation over ComfyUI's VAE and CLIP.

The identity of an encoder is a fingerprint of its weights plus its dtype, not a file name: a VAE
swapped under the same name, or the same file loaded in another dtype, gets a new identity and
therefore new cache keys.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch

_SAMPLES_PER_TENSOR = 4096


class Encoders(Protocol):
    """The two encoders a cache needs. ``latent`` takes ``[F, H, W, 3]`` pixels in [0, 1]."""

    def latent_identity(self) -> str: ...

    def text_identity(self) -> str: ...

    def encode_latent(self, pixels: torch.Tensor) -> torch.Tensor: ...

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]: ...


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


def latent_layout(encoded: torch.Tensor, frames: int) -> torch.Tensor:
    """One item's latent: ``[C, H, W]`` for an image, ``[C, T, H, W]`` for a clip.

    A video VAE returns ``[1, C, T, H, W]``; an image VAE encodes a clip frame by frame as
    ``[F, C, H, W]``, which is moved to the same channels-first layout.
    """
    if encoded.ndim == 5:
        return encoded[0]
    return encoded[0] if frames == 1 else encoded.movedim(0, 1)


class ComfyEncoders:
    """ComfyUI's ``VAE`` and ``CLIP`` objects behind :class:`Encoders`; identities computed once."""

    def __init__(self, vae, clip):
        self.vae = vae
        self.clip = clip
        self._ids: dict[str, str] = {}

    def latent_identity(self) -> str:
        if "vae" not in self._ids:
            self._ids["vae"] = vae_identity(self.vae)
        return self._ids["vae"]

    def text_identity(self) -> str:
        if "text" not in self._ids:
            self._ids["text"] = text_encoder_identity(self.clip)
        return self._ids["text"]

    def encode_latent(self, pixels: torch.Tensor) -> torch.Tensor:
        encoded = self.vae.encode(pixels[..., :3]).to(torch.float32).cpu()
        return latent_layout(encoded, pixels.shape[0]).contiguous()

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]:
        tokens = self.clip.tokenize(caption)
        cond, pooled = self.clip.encode_from_tokens(tokens, return_pooled=True)
        out = {"cond": cond[0].to(torch.float32).cpu().contiguous()}
        if pooled is not None:
            out["pooled"] = pooled[0].to(torch.float32).cpu().contiguous()
        return out
