"""Cache keys: every input that changes an encoded tensor is part of its key.

A latent's key covers the source's content digest, the preprocessing (bucket size, frame count, fps,
crop, resize filter), the VAE's weights fingerprint and dtype, the latent scaling convention and the
latent format version; a text embedding's key covers the caption, the text encoder's identity (its
weights fingerprint and dtype, the clip-skip layer, the tokenizer and its options, the digest of the
LoRA patches on it; see encoders.py) and the text format version. A stale entry would need a hash
collision, not a forgotten setting. The components are kept beside each key so that a re-encode can
name what changed.

Each kind has its own format version, so a change to the text key (version 4 added clip-skip,
tokenizer options and patches) re-encodes captions only, never the far costlier latents.
"""

from __future__ import annotations

import hashlib
import json

LATENT_FORMAT_VERSION = 3
TEXT_FORMAT_VERSION = 4
LATENT_SCALING = "raw"  # stored as the VAE returns it; the model's process_latent_in runs at train time

_CHANGE_NAMES = {
    "source": "source bytes changed",
    "prep": "preprocessing changed",
    "vae": "VAE changed (weights or dtype)",
    "scaling": "latent scaling changed",
    "caption": "caption changed",
    "encoder": "text encoder changed",
}
_LONG_VALUE = 24  # digests are named, not printed


def _hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


def _canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True)


def latent_components(source_digest: str, preprocessing: dict, vae_identity: str) -> dict:
    """Everything a latent depends on, by name (kept beside the key to explain re-encodes)."""
    return {"kind": "latent", "v": LATENT_FORMAT_VERSION, "source": source_digest, "prep": preprocessing,
            "vae": vae_identity, "scaling": LATENT_SCALING}


def text_components(caption: str, encoder_identity: str | dict) -> dict:
    return {"kind": "text", "v": TEXT_FORMAT_VERSION, "caption": caption, "encoder": encoder_identity}


def prep_signature(preprocessing: dict) -> str:
    """Canonical text of a preprocessing dict; shared by every item of a bucket, so computed once per bucket."""
    return _canonical_json(preprocessing)


def latent_key(source_digest: str, prep_sig: str, vae_identity: str) -> str:
    """The key of :func:`latent_components` (fields joined in a fixed order: revalidating 10,000 items
    must not spend its budget on JSON)."""
    fields = ("latent", str(LATENT_FORMAT_VERSION), LATENT_SCALING, json.dumps(vae_identity), prep_sig, source_digest)
    return _hash("\x1f".join(fields))


def encoder_signature(encoder_identity: str | dict) -> str:
    """Canonical text of a text encoder's identity; computed once per cache run."""
    return _canonical_json(encoder_identity)


def text_key(caption: str, encoder_sig: str) -> str:
    """The key of :func:`text_components` (``encoder_sig`` from :func:`encoder_signature`); the caption
    comes last, so no caption can mimic another field."""
    return _hash("\x1f".join(("text", str(TEXT_FORMAT_VERSION), encoder_sig, caption)))


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
        elif name == "encoder":
            text = f"{text} (weights or dtype)"
        parts.append(text)
    return "; ".join(parts) or "entry missing from the cache"
