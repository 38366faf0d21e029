"""Cache keys: every input that changes an encoded tensor is part of its key.

A latent's key covers the source bytes, the preprocessing, the VAE's weights fingerprint and dtype
and the format version; a text embedding's key covers the caption, the text encoder's fingerprint and
dtype and the format version. A stale entry would need a hash collision, not a forgotten setting.
"""

from __future__ import annotations

import hashlib
import json

CACHE_FORMAT_VERSION = 1


def _digest(kind: str, fields: dict) -> str:
    payload = json.dumps({"kind": kind, "v": CACHE_FORMAT_VERSION, **fields}, sort_keys=True)
    return hashlib.blake2b(payload.encode(), digest_size=20).hexdigest()


def source_digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def latent_key(source: str, preprocessing: dict, vae_identity: str) -> str:
    return _digest("latent", {"source": source, "prep": preprocessing, "vae": vae_identity})


def text_key(caption: str, encoder_identity: str) -> str:
    return _digest("text", {"caption": caption, "encoder": encoder_identity})
