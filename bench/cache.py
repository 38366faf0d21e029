"""Benchmark: revalidating an unchanged cache of many items (target: 10,000 items in <= 2 s).

Builds a folder of tiny captioned PNGs, fills a cache once with small synthetic encoders (so the
figure measures the cache, not a VAE), then times a second fill that must reuse everything.

    .venv/bin/python bench/cache.py [--items 10000] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path

from _pack import import_pack


class SyntheticEncoders:
    """Small deterministic tensors derived from the inputs (implements the cache's ``Encoders``)."""

    def latent_identity(self) -> str:
        return "synthetic-vae:float32"

    def text_identity(self) -> str:
        return "synthetic-text:float32"

    def encode_latent(self, pixels):
        import torch

        x = pixels.permute(0, 3, 1, 2)  # [F, 3, H, W]
        pooled = torch.nn.functional.avg_pool2d(x, 8)
        return torch.cat([pooled, pooled.mean(1, keepdim=True)], 1)[0].contiguous()  # [4, H/8, W/8]

    def encode_text(self, caption: str) -> dict:
        import torch

        seed = int.from_bytes(hashlib.blake2b(caption.encode(), digest_size=8).digest(), "little")
        g = torch.Generator().manual_seed(seed)
        return {"cond": torch.randn(8, 16, generator=g), "pooled": torch.randn(16, generator=g)}


def make_dataset(folder: Path, items: int) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(items):
        img = folder / f"img_{i:05d}.png"
        if not img.exists():
            Image.new("RGB", (16, 16), (i % 256, (i // 256) % 256, 7)).save(img)
            img.with_suffix(".txt").write_text(f"synthetic picture {i}", encoding="utf-8")




def run(items: int, workdir: Path, repeats: int = 3) -> dict[str, float]:
    """Fill once, then time the scan and ``repeats`` revalidations of the unchanged cache."""
    import torch

    torch.set_num_threads(1)  # the synthetic encoders are tiny; threads only add contention
    import_pack()
    from pipetrainer.training.cache.store import fill_cache
    from pipetrainer.training.data.dataset import scan_dataset

    data, cache = workdir / f"data_{items}", workdir / f"cache_{items}"
    t = time.perf_counter()
    make_dataset(data, items)
    made = time.perf_counter() - t
    encoders = SyntheticEncoders()
    t = time.perf_counter()
    first = fill_cache(scan_dataset(data, 16), encoders, cache)
    filled = time.perf_counter() - t
    t = time.perf_counter()
    dataset = scan_dataset(data, 16)
    scanned = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        again = fill_cache(dataset, encoders, cache)
        times.append(time.perf_counter() - t)
        if sum(again.report.encoded.values()) or len(again.items) != items:
            raise RuntimeError(f"revalidation re-encoded something:\n{again.report.text()}")
    times.sort()
    return {"items": items, "make_dataset_s": made, "first_fill_s": filled,
            "first_encoded": sum(first.report.encoded.values()), "scan_s": scanned,
            "revalidate_s": times[0], "revalidate_median_s": times[len(times) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3, help="revalidations timed (best and median shown)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the dataset and cache here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pipetrainer-bench-") as tmp:
        r = run(args.items, args.workdir or Path(tmp), args.repeats)
    print(f"{r['items']} items: dataset {r['make_dataset_s']:.1f} s, first fill {r['first_fill_s']:.1f} s "
          f"({r['first_encoded']} encodes), scan {r['scan_s']:.2f} s")
    print(f"revalidate unchanged cache: best {r['revalidate_s']:.2f} s, median {r['revalidate_median_s']:.2f} s "
          f"(target <= 2 s)")


if __name__ == "__main__":
    main()
