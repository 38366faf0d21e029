"""A content-addressed cache on disk: one small safetensors file per key, written atomically.

Because the file name *is* the key (see keys.py), reuse is a lookup and invalidation is automatic: a
changed input produces a different key and therefore a fresh encode. An unreadable file is treated
as missing and re-encoded.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..dataset import DatasetSpec
from ..lora_file import atomic_save
from ..spec import CacheItem
from . import encoders
from .keys import latent_key, source_digest, text_key


@dataclass
class CacheReport:
    encoded: Counter = field(default_factory=Counter)  # kind -> count
    reused: Counter = field(default_factory=Counter)
    reencoded: list[str] = field(default_factory=list)  # "file: reason"
    skipped: list[str] = field(default_factory=list)  # "file: reason"
    seconds: float = 0.0

    def text(self) -> str:
        lines = [
            f"latents: {self.encoded['latent']} encoded, {self.reused['latent']} reused; "
            f"text: {self.encoded['text']} encoded, {self.reused['text']} reused ({self.seconds:.1f} s)"
        ]
        lines += [f"re-encoded {r}" for r in self.reencoded]
        lines += [f"skipped {s}" for s in self.skipped]
        return "\n".join(lines)


@dataclass(frozen=True)
class CacheResult:
    items: tuple[CacheItem, ...]
    report: CacheReport
    latent_channels: int
    text_dim: int
    pooled_dim: int


def _entry_path(root: Path, kind: str, key: str) -> Path:
    return root / kind / key[:2] / f"{key}.safetensors"


def _readable(path: Path) -> tuple[bool, str]:
    if not path.exists():
        return False, ""
    try:
        load_file(str(path))
        return True, ""
    except (SafetensorError, OSError, ValueError) as exc:
        return False, f"unreadable cache file ({exc.__class__.__name__})"


def build_cache(dataset: DatasetSpec, vae, clip, cache_dir: str | Path) -> CacheResult:
    """Encode what is missing; return one :class:`CacheItem` per image and repeat, and a report."""
    start = time.monotonic()
    root = Path(cache_dir)
    report = CacheReport()
    vae_id = encoders.vae_identity(vae)
    text_id = encoders.text_encoder_identity(clip)
    prep = {"resolution": dataset.resolution, "crop": "center", "resize": "lanczos"}
    items: list[CacheItem] = []
    shapes: tuple[int, int, int] = (0, 0, 0)
    for entry in dataset.entries:
        name = Path(entry.path).name
        try:
            data = Path(entry.path).read_bytes()
            lat_path = _entry_path(root, "latents", latent_key(source_digest(data), prep, vae_id))
            ok, why = _readable(lat_path)
            if ok:
                report.reused["latent"] += 1
            else:
                latent = encoders.encode_latent(vae, encoders.load_pixels(entry.path, dataset.resolution))[0]
                atomic_save({"latent": latent}, lat_path, {"source": name})
                report.encoded["latent"] += 1
                if why:
                    report.reencoded.append(f"{name} latent: {why}")
            txt_path = _entry_path(root, "text", text_key(entry.caption, text_id))
            ok, why = _readable(txt_path)
            if ok:
                report.reused["text"] += 1
            else:
                cond, pooled = encoders.encode_text(clip, entry.caption)
                tensors = {"cond": cond[0]}
                if pooled is not None:
                    tensors["pooled"] = pooled[0]
                atomic_save(tensors, txt_path, {"caption": entry.caption})
                report.encoded["text"] += 1
                if why:
                    report.reencoded.append(f"{name} text: {why}")
        except (OSError, ValueError, RuntimeError) as exc:  # one bad file never stops the cache
            report.skipped.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if not shapes[0]:
            lat = load_file(str(lat_path))["latent"]
            txt = load_file(str(txt_path))
            shapes = (lat.shape[0], txt["cond"].shape[-1], txt["pooled"].shape[-1] if "pooled" in txt else 0)
        items.extend([CacheItem(str(lat_path), str(txt_path), entry.path, entry.caption)] * dataset.repeats)
    report.seconds = time.monotonic() - start
    return CacheResult(tuple(items), report, *shapes)


def load_item_tensors(item: CacheItem) -> dict[str, torch.Tensor]:
    return {**load_file(item.latent_file), **load_file(item.text_file)}
