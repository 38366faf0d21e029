"""Cache keys: every input that changes an encoded tensor is part of its key.

A latent's key covers the source's content digest, the preprocessing (bucket size, frame count, fps,
crop, resize filter), the VAE's weights fingerprint and dtype, the latent scaling convention and the
format version; a text embedding's key covers the caption, the text encoder's fingerprint and dtype
and the format version. A stale entry would need a hash collision, not a forgotten setting. The
components are kept beside each key so that a re-encode can name what changed.
"""

from __future__ import annotations

import hashlib
import json

CACHE_FORMAT_VERSION = 3
LATENT_SCALING = "raw"  # stored as the VAE returns it; the model's process_latent_in runs at train time

_CHANGE_NAMES = {
    "source": "source bytes changed",
    "prep": "preprocessing changed",
    "vae": "VAE changed (weights or dtype)",
    "scaling": "latent scaling changed",
    "caption": "caption changed",
    "encoder": "text encoder changed (weights or dtype)",
    "v": "cache format version changed",
}


def _hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


def latent_components(source_digest: str, preprocessing: dict, vae_identity: str) -> dict:
    """Everything a latent depends on, by name (kept beside the key to explain re-encodes)."""
    return {"kind": "latent", "v": CACHE_FORMAT_VERSION, "source": source_digest, "prep": preprocessing,
            "vae": vae_identity, "scaling": LATENT_SCALING}


def text_components(caption: str, encoder_identity: str) -> dict:
    return {"kind": "text", "v": CACHE_FORMAT_VERSION, "caption": caption, "encoder": encoder_identity}


def prep_signature(preprocessing: dict) -> str:
    """Canonical text of a preprocessing dict; shared by every item of a bucket, so computed once per bucket."""
    return json.dumps(preprocessing, sort_keys=True)


def latent_key(source_digest: str, prep_sig: str, vae_identity: str) -> str:
    """The key of :func:`latent_components` (fields joined in a fixed order: revalidating 10,000 items
    must not spend its budget on JSON)."""
    fields = ("latent", str(CACHE_FORMAT_VERSION), LATENT_SCALING, json.dumps(vae_identity), prep_sig, source_digest)
    return _hash("\x1f".join(fields))


def text_key(caption: str, encoder_identity: str) -> str:
    """The key of :func:`text_components`; the caption comes last, so no caption can mimic another field."""
    return _hash("\x1f".join(("text", str(CACHE_FORMAT_VERSION), json.dumps(encoder_identity), caption)))


def change_reason(old: dict, new: dict) -> str:
    """Why ``new`` needs an encode where ``old`` was cached, e.g. ``caption changed``."""
    parts = []
    for name, text in _CHANGE_NAMES.items():
        if old.get(name) == new.get(name):
            continue
        if name == "prep" and isinstance(old.get(name), dict):
            diffs = [f"{k} {old[name].get(k)} -> {v}" for k, v in sorted(new[name].items()) if old[name].get(k) != v]
            text = f"{text} ({', '.join(diffs)})"
        parts.append(text)
    return "; ".join(parts) or "entry missing from the cache"
