"""What the cache encodes with: a small contract, and its implementation over ComfyUI's VAE and CLIP.

The identity of an encoder is a fingerprint of its weights plus its dtype, not a file name: a VAE
swapped under the same name, or the same file loaded in another dtype, gets a new identity and
therefore new cache keys. A text encoder's identity also holds everything else on ComfyUI's ``CLIP``
object that changes an embedding: the clip-skip layer (``CLIPSetLastLayer`` sets ``layer_idx``), the
tokenizer options (``set_tokenizer_option``, e.g. T5's min length and padding) and the weight patches
of LoRAs loaded onto the text encoder (digested with their strengths). Patches the cache cannot key
(hooks, object patches, weight wrappers) are refused with what to do instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Protocol

import torch

from .prep_extras import cache_extras

_SAMPLES_PER_TENSOR = 4096
_STORE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # keys.TEXT_STORE_DTYPES as torch dtypes


def stored_text(tensors: dict[str, torch.Tensor], stored: str) -> dict[str, torch.Tensor]:
    """An encoder's text tensors as the cache stores them: every float tensor (cond, pooled, float
    extras) at the storage dtype ``stored`` (one of ``keys.TEXT_STORE_DTYPES``), integer ones as they are.

    The encoders return fp32; storing at the training dtype halves the bytes on disk and in the
    reading rank, and costs nothing the training would have kept (the rank casts to that dtype anyway).
    """
    dtype = _STORE_DTYPES[stored]
    return {k: v.to(dtype).contiguous() if v.is_floating_point() else v for k, v in tensors.items()}


class Encoders(Protocol):
    """The two encoders a cache needs. ``latent`` takes ``[F, H, W, 3]`` pixels in [0, 1].

    An identity is an opaque string, or named parts (a dict of JSON values): with named parts a
    re-encode names the part that changed (e.g. the clip-skip layer). Caching captions with their
    reference images in the prompt (reference_prompt.py) also needs ``encode_text_with_references``,
    which :class:`ComfyEncoders` has.
    """

    def latent_identity(self) -> str: ...

    def text_identity(self) -> str | dict[str, object]: ...

    def encode_latent(self, pixels: torch.Tensor) -> torch.Tensor: ...

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]: ...


class UnkeyableTextEncoder(ValueError):
    """The text encoder carries changes the cache key cannot describe."""


def weights_fingerprint(module: torch.nn.Module, overrides: Mapping[str, torch.Tensor] | None = None) -> str:
    """Names, shapes, dtypes and a strided sample of every tensor's values.

    ``overrides`` replaces state-dict entries by name: the original weights ComfyUI backed up while
    a patched clone of the model is loaded with its patches applied in place.
    """
    state = module.state_dict()
    if overrides:
        state.update({k: v for k, v in overrides.items() if k in state})
    h = hashlib.blake2b(digest_size=20)
    for name, t in sorted(state.items()):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::step][:_SAMPLES_PER_TENSOR].to("cpu", torch.float32)
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def vae_identity(vae) -> str:
    return f"{weights_fingerprint(vae.first_stage_model)}:{vae.vae_dtype}"


def _unpatched_weights(patcher) -> dict[str, torch.Tensor]:
    """The original weights of entries a ComfyUI ``ModelPatcher`` (or a clone sharing its backup)
    has patched in place; the model's state dict holds patched values until it is unloaded."""
    backup = getattr(patcher, "backup", None) or {}
    return {k: b.weight for k, b in backup.items() if isinstance(getattr(b, "weight", None), torch.Tensor)}


# Object patches the key names instead of refusing: current ComfyUI sets the text encoder's compute
# dtype this way on every CLIP it loads (``set_model_compute_dtype``).
_KEYED_OBJECT_PATCHES = ("manual_cast_dtype",)


def text_encoder_problems(clip) -> list[str]:
    """What on ``clip`` changes embeddings in a way the cache key cannot describe, phrased as the fix."""
    patcher = clip.patcher
    fix = ("load text-encoder LoRAs with a LoRA loader (e.g. 'Load LoRA') instead, or connect the plain "
           "text encoder to 'Cache Latents & Text'")
    out = []
    hooks = [name for name, present in (
        ("forced hooks", getattr(patcher, "forced_hooks", None) is not None),
        ("hook patches", bool(getattr(patcher, "hook_patches", None))),
        ("hooks applied to conds", getattr(clip, "apply_hooks_to_conds", None) is not None),
        ("scheduled CLIP hooks", bool(getattr(clip, "use_clip_schedule", False))),
    ) if present]
    if hooks:
        out.append(f"The text encoder has ComfyUI hooks ({', '.join(hooks)}, e.g. from 'Set CLIP Hooks'); the cache "
                   f"cannot key them: {fix}.")
    for attr, what in (("object_patches", "object patches"), ("weight_wrapper_patches", "weight wrappers"),
                       ("injections", "module injections")):
        found = getattr(patcher, attr, None)
        if attr == "object_patches" and found:
            found = {k: v for k, v in found.items() if k not in _KEYED_OBJECT_PATCHES}
        if found:
            out.append(f"The text encoder has {what} ({', '.join(sorted(map(str, found))[:5])}); the cache "
                       f"cannot key them: {fix}.")
    try:
        patches_digest(patcher.patches)
    except UnkeyableTextEncoder as exc:
        out.append(str(exc))
    return out


def patches_digest(patches: Mapping[str, list]) -> str:
    """Digest of a ``ModelPatcher.patches`` dict: every patched key with its strengths, offset,
    function and the full bytes of the patch tensors (LoRA up/down/alpha, diffs, set weights)."""
    h = hashlib.blake2b(digest_size=20)
    for key in sorted(patches):
        for entry in patches[key]:
            strength_patch, value, strength_model, offset, function = entry
            h.update(f"{key}|{float(strength_patch)!r}|{float(strength_model)!r}|{offset!r}|".encode())
            h.update(_function_name(key, function).encode())
            _feed(h, value, key)
    return h.hexdigest()


def _function_name(key: str, function) -> str:
    if function is None:
        return "-"
    name = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', '?')}"
    if "<" in name:  # a lambda or a closure: its name says nothing about what it computes
        raise UnkeyableTextEncoder(f"The text-encoder patch of {key} uses an anonymous function ({name}); the cache "
                                   "cannot key it: load the LoRA with a stock LoRA loader instead.")
    return name


def _feed(h, value, key: str) -> None:
    """Hash ``value`` (a patch: tensors, numbers and adapters nested in tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{tuple(value.shape)}{value.dtype}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif value is None or isinstance(value, (bool, int, float, str)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, (tuple, list)):
        h.update(b"[")
        for v in value:
            _feed(h, v, key)
        h.update(b"]")
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value, key=repr):
            h.update(f"{k!r}=".encode())
            _feed(h, value[k], key)
        h.update(b"}")
    elif hasattr(value, "weights"):  # comfy.weight_adapter adapters (LoRA, LoHa, LoKr, ...)
        h.update(f"{type(value).__module__}.{type(value).__qualname__}:".encode())
        _feed(h, value.weights, key)
    else:
        raise UnkeyableTextEncoder(f"The text-encoder patch of {key} is a {type(value).__qualname__}, which the cache "
                                   "cannot key: load the LoRA with a stock LoRA loader, or cache with the plain "
                                   "text encoder.")


def _canonical(value, what: str):
    """``value`` as plain JSON data, or a refusal naming ``what``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_canonical(v, what) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v, what) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    raise UnkeyableTextEncoder(f"The text encoder's {what} holds a {type(value).__qualname__}, which the cache cannot "
                               "key: remove that option before 'Cache Latents & Text'.")


TEXT_ATTENTION_MASK = "attention_mask"  # the name CLIPTextEncode gives it in the cond dict, and the extra's


def returns_attention_mask(clip) -> bool:
    """Whether ComfyUI's text encoder puts the text attention mask into the conditioning (HunyuanVideo's
    LLaMA, LTX-2's Gemma, ...): the model then masks padding tokens at sampling, so training must too."""
    return any(getattr(m, "return_attention_masks", False) for m in clip.cond_stage_model.modules())


def text_encoder_identity(clip) -> dict[str, object]:
    """Everything of ComfyUI's ``CLIP`` object that changes an embedding, by name.

    ``weights``: fingerprint of the unpatched weights and their dtype; ``layer``: the clip-skip
    layer (``None`` = the encoder's default); ``tokenizer``: tokenizer class and options;
    ``patches``: digest of the weight patches (text-encoder LoRAs), ``None`` without any;
    ``compute``: a compute dtype set by object patch (current ComfyUI does for every CLIP), else ``None``.
    """
    problems = text_encoder_problems(clip)
    if problems:
        raise UnkeyableTextEncoder("\n".join(problems))
    model = clip.cond_stage_model
    dtype = next((p.dtype for p in model.parameters()), None)
    patches = clip.patcher.patches
    tokenizer = type(clip.tokenizer)
    masks = {"attention_mask": True} if returns_attention_mask(clip) else {}  # only then: other keys unchanged
    return {
        **masks,
        "weights": f"{weights_fingerprint(model, _unpatched_weights(clip.patcher))}:{dtype}",
        "layer": _canonical(getattr(clip, "layer_idx", None), "clip-skip layer"),
        "tokenizer": {"class": f"{tokenizer.__module__}.{tokenizer.__qualname__}",
                      "options": _canonical(dict(getattr(clip, "tokenizer_options", {})), "tokenizer options")},
        "patches": patches_digest(patches) if patches else None,
        "compute": str(clip.patcher.object_patches.get("manual_cast_dtype"))
        if "manual_cast_dtype" in getattr(clip.patcher, "object_patches", {}) else None,
    }


def latent_layout(encoded: torch.Tensor, frames: int) -> torch.Tensor:
    """One item's latent: ``[C, H, W]`` for an image, ``[C, T, H, W]`` for a clip.

    A video VAE returns ``[1, C, T, H, W]``; an image VAE encodes a clip frame by frame as
    ``[F, C, H, W]``, which is moved to the same channels-first layout.
    """
    if encoded.ndim == 5:
        return encoded[0]
    return encoded[0] if frames == 1 else encoded.movedim(0, 1)


IMAGE_VAE_FRAME_STEP = 4
"""Image VAEs encode a clip frame by frame and have no temporal rule; their clips keep the 4k+1 buckets
of the common video families (image models refuse video latents in preflight anyway)."""


def vae_frame_step(vae) -> int:
    """Pixel frames per latent frame after the first, by ComfyUI's own record of a video VAE
    (``downscale_index_formula``: 4 for Wan and HunyuanVideo, 8 for LTX-Video); the family adapter's
    ``Geometry.frame_step`` is the same rule. Image VAEs: :data:`IMAGE_VAE_FRAME_STEP`."""
    formula = getattr(vae, "downscale_index_formula", None)
    return int(formula[0]) if isinstance(formula, (tuple, list)) else IMAGE_VAE_FRAME_STEP


def vae_usable_frames(vae, probe_up_to: int = 256):
    """The most frames ``<= n`` a video VAE encodes whole, as a function of ``n``, where its own rule is not
    :func:`vae_frame_step`'s ``1 or step*k+1`` (None: that rule holds).

    ComfyUI records a video VAE's temporal rule as the functions ``downscale_ratio[0]`` (pixel frames to latent
    frames) and ``upscale_ratio[0]`` (back); ``upscale(downscale(n))`` is then the most frames up to ``n`` that the
    latent covers. For Wan, HunyuanVideo and LTX-Video that is the step rule; MiniMax-H3's VAE takes 17k + 5
    frames (5k + 2 latent frames) while its index formula says 4, so a step-rule clip would train on frames
    its latent does not hold."""
    down = getattr(vae, "downscale_ratio", None)
    up = getattr(vae, "upscale_ratio", None)
    if not (isinstance(down, (tuple, list)) and isinstance(up, (tuple, list)) and callable(down[0]) and callable(up[0])):
        return None
    step = vae_frame_step(vae)

    def usable(n: int) -> int:
        return max(1, int(up[0](down[0](n))))

    if all(usable(n) == (n - 1) // step * step + 1 for n in range(1, probe_up_to + 1)):
        return None
    return usable


class ComfyEncoders:
    """ComfyUI's ``VAE`` and ``CLIP`` objects behind :class:`Encoders`; identities computed once."""

    def __init__(self, vae, clip):
        self.vae = vae
        self.clip = clip
        self._ids: dict[str, object] = {}
        self.frame_step = vae_frame_step(vae)  # clips are cut to 1 or frame_step*k+1 frames
        self.usable_frames = vae_usable_frames(vae)  # ... or by the VAE's own rule where it differs (MiniMax-H3)
        self.prep_extras = cache_extras(clip)  # what the text encoder's family computes per item (SDXL's size/crop)

    def latent_identity(self) -> str:
        if "vae" not in self._ids:
            self._ids["vae"] = vae_identity(self.vae)
        return self._ids["vae"]

    def text_identity(self) -> dict[str, object]:
        if "text" not in self._ids:
            self._ids["text"] = text_encoder_identity(self.clip)
        return self._ids["text"]

    def encode_latent(self, pixels: torch.Tensor) -> torch.Tensor:
        encoded = self.vae.encode(pixels[..., :3]).to(torch.float32).cpu()
        return latent_layout(encoded, pixels.shape[0]).contiguous()

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]:
        tokens = self.clip.tokenize(caption)
        # As CLIPTextEncode encodes: the dict form also carries the attention mask where the encoder gives one.
        encoded = self.clip.encode_from_tokens(tokens, return_pooled=True, return_dict=True)
        return _text_tensors(encoded["cond"], encoded)

    def encode_text_with_references(self, caption: str, images: list[torch.Tensor], style) -> dict[str, torch.Tensor]:
        """``caption`` with its reference ``images`` in the prompt, as ComfyUI's node of ``style``
        (a reference_prompt.PromptStyle) conditions on them."""
        ((cond, extras), *_) = style.conditioning(self.clip, caption, images)
        return _text_tensors(cond, extras)


def _text_tensors(cond: torch.Tensor, extras: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """The cached tensors of one encoded caption: ``cond``, and ``pooled`` and the attention mask where given,
    and the encoder's extra outputs a registered family reads through its ``extra_conds`` (Anima's T5 ids and
    weights, the ByT5 glyph states of quoted text, HiDream's Llama layers: training/pipelines/text_extras.py)."""
    out = {"cond": cond[0].to(torch.float32).cpu().contiguous()}
    pooled = extras.get("pooled_output")
    if pooled is not None:
        out["pooled"] = pooled[0].to(torch.float32).cpu().contiguous()
    mask = extras.get(TEXT_ATTENTION_MASK)
    if mask is not None:
        out[TEXT_ATTENTION_MASK] = mask[0].cpu().contiguous()
    from ..pipelines.text_extras import cached_text_extras  # what the registered families read from the encoder

    for name, batched in cached_text_extras().items():
        value = extras.get(name)
        if isinstance(value, torch.Tensor):
            value = value[0] if batched else value
            out[name] = (value.to(torch.float32) if value.is_floating_point() else value).cpu().contiguous()
    return out

