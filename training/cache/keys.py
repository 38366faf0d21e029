"""Cache keys: every input that changes an encoded tensor is part of its key.

A latent's key covers the source's content digest, the content digests of its reference images in
reference order (edit datasets; the references are encoded into the same entry), the preprocessing
(bucket size, frame count, fps, crop, resize filter), the VAE's weights fingerprint and dtype, the latent scaling convention and the
latent format version; a text embedding's key covers the caption, the text encoder's identity (its
weights fingerprint and dtype, the clip-skip layer, the tokenizer and its options, the digest of the
LoRA patches on it; see encoders.py) and the text format version. A stale entry would need a hash
collision, not a forgotten setting. The components are kept beside each key so that a re-encode can
name what changed.

A text embedding is stored at the dtype the Cache node was asked for (the training dtype, bf16 by
default: half the bytes on disk and in every reading rank). That storage dtype is part of the text key
when it is not fp32, so the keys of fp32 entries, written before the choice existed, are unchanged:
old caches keep being found and read (the reader brings any stored dtype to the training dtype).

An image-to-video item's start-image conditioning (the Cache node's ``start_image`` option, see
start_image.py: the mode, gray value, CLIP crop and the CLIP-vision model's identity) joins the latent
key only when it is cached, so caches made without it keep their keys.

A caption encoded together with its item's reference images (the Cache node's ``reference_in_prompt``,
reference_prompt.py: Qwen-Image-Edit's text encoder reads them) has the style's identity and the
references' content digests in its text key; a caption encoded alone keeps the key it always had.

An item's cached variants (masks.py: the horizontally flipped latent, the loss mask with its mask
file's content digest) join the latent key the same way: only when the Dataset node turns them on.

A caption's tag-shuffle variants and the empty caption (caption dropout; training/data/captions.py) are
text entries keyed like any caption, by their own text: no option joins the text key, so turning the
options off finds the entries the caption had before.

Each kind has its own format version, so a change to the text key (version 4 added clip-skip,
tokenizer options and patches) re-encodes captions only, never the far costlier latents.

A clip's encoded sound (families that train on audio) is an entry of its own kind, ``audio``: its key
covers the audio track's content identity (training/data/audio.py ``track_digest``, or the source's
digest), the audio preprocessing (training/data/audio.py ``audio_preprocessing``: target rate, channels,
the cut span, the resampling filter) and the audio encoder's identity, so a changed track, sample rate,
span or encoder re-encodes the sound and nothing else. The latent and text keys do not change.
"""

from __future__ import annotations

import hashlib
import json

LATENT_FORMAT_VERSION = 3
TEXT_FORMAT_VERSION = 4
AUDIO_FORMAT_VERSION = 1
TEXT_STORE_DTYPES = ("bf16", "fp32")  # what a text embedding may be stored as; fp32 = how older caches hold it
_LEGACY_TEXT_STORE = "fp32"
LATENT_SCALING = "raw"  # stored as the VAE returns it; the model's process_latent_in runs at train time

_CHANGE_NAMES = {
    "source": "source bytes changed",
    "prep": "preprocessing changed",
    "vae": "VAE changed (weights or dtype)",
    "scaling": "latent scaling changed",
    "references": "reference images changed",
    "start_image": "start-image conditioning changed",
    "flip": "flip variant changed",
    "mask": "loss mask changed",
    "vace": "VACE control changed",  # vace_control.py: control and mask digests, encode identity
    "s2v": "S2V sound changed",  # s2v_sound.py: the track, its preprocessing and the audio encoder
    "caption": "caption changed",
    "encoder": "text encoder changed",
    "stored": "stored text dtype changed",
    "prompt": "reference-in-prompt changed",
    "track": "audio track changed",
    "audio_prep": "audio preprocessing changed",
    "audio_encoder": "audio encoder changed",
}
_LONG_VALUE = 24  # digests are named, not printed


def _hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


def _canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True)


def latent_components(source_digest: str, preprocessing: dict, vae_identity: str,
                      references: tuple[str, ...] = (), start_image: dict | None = None,
                      variants: dict | None = None) -> dict:
    """Everything a latent depends on, by name (kept beside the key to explain re-encodes).
    ``references``: content digests of the item's reference images, in order (absent without any);
    ``start_image``: the start-image conditioning's identity (absent without one);
    ``variants``: ``plan.latent_variants`` (``flip``, ``mask``; absent when off)."""
    out = {"kind": "latent", "v": LATENT_FORMAT_VERSION, "source": source_digest, "prep": preprocessing,
           "vae": vae_identity, "scaling": LATENT_SCALING}
    if references:
        out["references"] = list(references)
    if start_image:
        out["start_image"] = start_image
    out.update(variants or {})
    return out


def text_components(caption: str, encoder_identity: str | dict, stored: str = _LEGACY_TEXT_STORE,
                    prompt: dict | None = None, references: tuple[str, ...] = ()) -> dict:
    """Everything a text embedding depends on; ``stored`` (its storage dtype) is named only when it is
    not fp32, mirroring :func:`text_key`. ``prompt`` (a reference_prompt.PromptStyle identity) and the
    content digests of the ``references`` encoded with the caption are named only when the caption was
    encoded with its item's reference images."""
    out = {"kind": "text", "v": TEXT_FORMAT_VERSION, "caption": caption, "encoder": encoder_identity}
    if stored != _LEGACY_TEXT_STORE:
        out["stored"] = stored
    if prompt:
        out["prompt"] = prompt
        out["references"] = list(references)
    return out


def prompt_signature(prompt: dict | None) -> str:
    """Canonical text of a reference-in-prompt style's identity ("" when captions are encoded alone)."""
    return _canonical_json(prompt) if prompt else ""


def prep_signature(preprocessing: dict) -> str:
    """Canonical text of a preprocessing dict; shared by every item of a bucket, so computed once per bucket."""
    return _canonical_json(preprocessing)


def start_image_signature(start_image: dict | None) -> str:
    """Canonical text of a start-image identity ("" without one); computed once per cache run."""
    return _canonical_json(start_image) if start_image else ""


def variants_signature(variants: dict | None) -> str:
    """Canonical text of an item's ``plan.latent_variants`` ("" with none: the key stays as before)."""
    return _canonical_json(variants) if variants else ""


def latent_key(source_digest: str, prep_sig: str, vae_identity: str, references: tuple[str, ...] = (),
               start_image_sig: str = "", variants_sig: str = "") -> str:
    """The key of :func:`latent_components` (fields joined in a fixed order: revalidating 10,000 items
    must not spend its budget on JSON). Without references or a start image (``start_image_sig`` from
    :func:`start_image_signature`) the key is what it was before they existed, so caches of plain
    datasets stay valid."""
    fields = ("latent", str(LATENT_FORMAT_VERSION), LATENT_SCALING, json.dumps(vae_identity), prep_sig, source_digest)
    if references:
        fields += ("references", *references)
    if start_image_sig:
        fields += ("start_image", start_image_sig)
    if variants_sig:
        fields += ("variants", variants_sig)
    return _hash("\x1f".join(fields))


def encoder_signature(encoder_identity: str | dict) -> str:
    """Canonical text of a text encoder's identity; computed once per cache run."""
    return _canonical_json(encoder_identity)


def text_key(caption: str, encoder_sig: str, stored: str = _LEGACY_TEXT_STORE, prompt_sig: str = "",
             references: tuple[str, ...] = ()) -> str:
    """The key of :func:`text_components` (``encoder_sig`` from :func:`encoder_signature`, ``prompt_sig``
    from :func:`prompt_signature`); the caption comes last, so no caption can mimic another field. An fp32
    store keeps the key it had before the storage dtype was a choice, and a caption encoded alone the key
    it had before reference images could join the prompt."""
    if stored not in TEXT_STORE_DTYPES:
        raise ValueError(f"Text embeddings can be stored as {', '.join(TEXT_STORE_DTYPES)}, not {stored!r}.")
    store = () if stored == _LEGACY_TEXT_STORE else (f"stored={stored}",)
    prompt = ("prompt", prompt_sig, *references) if prompt_sig else ()
    return _hash("\x1f".join(("text", str(TEXT_FORMAT_VERSION), encoder_sig, *store, *prompt, caption)))


def audio_components(track: str, preprocessing: dict, encoder_identity: str | dict) -> dict:
    """Everything an encoded audio entry depends on, by name: the track's content identity, the audio
    preprocessing (``audio.audio_preprocessing``) and the audio encoder's identity (weights and dtype)."""
    return {"kind": "audio", "v": AUDIO_FORMAT_VERSION, "track": track, "audio_prep": preprocessing,
            "audio_encoder": encoder_identity}


def audio_key(track: str, preprocessing: dict, encoder_identity: str | dict) -> str:
    """The key of :func:`audio_components`: a pure function of the same three, the track last so that no
    track identity can mimic another field. Its own kind and version, so no latent or text key moves."""
    return _hash("\x1f".join(("audio", str(AUDIO_FORMAT_VERSION), _canonical_json(encoder_identity),
                              _canonical_json(preprocessing), track)))


def _show(value: object) -> str:
    text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= _LONG_VALUE else "changed"


def _part_changes(old: dict, new: dict) -> str:
    """``"layer None -> -2, weights changed"``: the named parts of a component that differ."""
    diffs = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        shown_a, shown_b = _show(a), _show(b)
        diffs.append(f"{k} changed" if "changed" in (shown_a, shown_b) else f"{k} {shown_a} -> {shown_b}")
    return ", ".join(diffs)


def _reference_changes(old: list, new: list) -> str:
    """``"reference 1"`` (0-based, as the extras are named) or ``"1 -> 2 references"``."""
    if len(old) != len(new):
        return f"{len(old)} -> {len(new)} references"
    return ", ".join(f"reference {i}" for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b)


def _variant_name(value: object) -> str:
    """``none``, ``horizontal``, ``folder``: how a flip or mask component is named in a reason."""
    if isinstance(value, dict):
        return str(value.get("mode", "changed"))
    return "none" if value is None else str(value)


def change_reason(old: dict, new: dict) -> str:
    """Why ``new`` needs an encode where ``old`` was cached, e.g. ``caption changed``."""
    if old.get("v") != new.get("v"):  # the other differences follow from the new format
        return "cache format version changed"
    parts = []
    for name, text in _CHANGE_NAMES.items():
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            text = f"{text} ({_part_changes(a, b)})"
        elif name == "references":
            text = f"{text} ({_reference_changes(a or [], b or [])})"
        elif name == "start_image":
            text = f"{text} ({(a or {}).get('mode', 'none')} -> {(b or {}).get('mode', 'none')})"
        elif name in ("flip", "mask"):
            text = f"{text} ({_variant_name(a)} -> {_variant_name(b)})"
        elif name == "encoder":
            text = f"{text} (weights or dtype)"
        elif name == "prompt":
            text = f"{text} ({(a or {}).get('style', 'off')} -> {(b or {}).get('style', 'off')})"
        parts.append(text)
    return "; ".join(parts) or "entry missing from the cache"
