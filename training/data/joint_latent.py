"""Several latent streams trained as the one latent ComfyUI's sampler noises (LTX-2: video and audio).

ComfyUI samples a model that takes several latents (``LTXAV``: the video latent and the audio latent)
by packing them into one tensor, ``comfy.utils.pack_latents``: each stream flattened to ``[B, 1, n]``
and concatenated. The sampler draws the noise over that tensor, noises it with one sigma, and
``BaseModel.apply_model`` unpacks it (``latent_shapes``) for the network and packs the prediction again
before ``calculate_denoised``. Training on that very tensor makes the shared objective ComfyUI's: one
sigma for both streams, the flow target over every element, the mean squared error over both. So a
family declares its further streams (``ExtraSpec.joins_latent``, cached in the item's latent entry)
and the micro-batch builder packs them here; nothing else in the objective knows about streams.

A family's loss mask and the items' loss masks describe the first stream (the video grid); the other
streams weigh 1 (:func:`joint_weight`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def joined_names(specs: Mapping[str, object]) -> list[str]:
    """The names of the extras (``ExtraSpec``) that join the training latent, in declaration order."""
    return [name for name, spec in specs.items() if getattr(spec, "joins_latent", False)]


def pack_streams(streams: Sequence[torch.Tensor]) -> tuple[torch.Tensor, tuple[tuple[int, ...], ...]]:
    """``(packed [B, 1, n], latent_shapes)``: ComfyUI's own packing of the streams (``pack_latents``)."""
    import comfy.utils

    packed, shapes = comfy.utils.pack_latents(list(streams))
    return packed, tuple(tuple(int(v) for v in s) for s in shapes)


def unpack_streams(packed: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The streams of a packed latent (``comfy.utils.unpack_latents``)."""
    import comfy.utils

    return comfy.utils.unpack_latents(packed, [torch.Size(s) for s in shapes])


def join_latent(model: object, raw: torch.Tensor, streams: Sequence[torch.Tensor],
                missing: Sequence[str] = ()) -> tuple[torch.Tensor, tuple[tuple[int, ...], ...]]:
    """The raw training latent ``raw`` ``[B, ...]`` packed with the further raw ``streams`` and processed as
    ComfyUI's sampler processes the pack (``CFGGuider.inner_sample``: ``latent_shapes`` set on the model, then its
    ``process_latent_in`` of the packed latent; MiniMax-H3 carries its audio scaled there), and the shapes.

    ``missing`` names declared streams an item of the batch lacks: refused, since a cache without them
    would train the model on a latent it never samples."""
    if missing:
        raise ValueError(f"The cache has no {', '.join(missing)} for some items; this model trains on them with the "
                         "video latent. Re-run the Cache node with the model's audio VAE connected.")
    packed, shapes = pack_streams([raw, *(s.to(raw.dtype) for s in streams)])
    return processed_pack(model, packed, shapes), shapes


def processed_pack(model: object, packed: torch.Tensor, shapes: Sequence[Sequence[int]]) -> torch.Tensor:
    """``model.process_latent_in`` of a packed latent, with the model's ``latent_shapes`` set as the sampler sets
    them while it runs (and restored after)."""
    before = getattr(model, "latent_shapes", None)
    model.latent_shapes = [torch.Size(s) for s in shapes]
    try:
        return model.process_latent_in(packed)
    finally:
        model.latent_shapes = before


def joint_weight(weight: torch.Tensor | None, shapes: Sequence[Sequence[int]]) -> torch.Tensor | None:
    """A first-stream loss weight (broadcastable to ``shapes[0]``) as a packed weight; 1 on the other streams."""
    if weight is None:
        return None
    first = weight.float().expand(*shapes[0])
    return pack_streams([first, *(torch.ones(*s) for s in shapes[1:])])[0]
