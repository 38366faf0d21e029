"""The cache across real processes: a killed filler loses only its unfinished item, and two fillers of
one cache encode each item once. Each process loads the real tiny VAE and CLIP with ComfyUI's loaders."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image
from pipetrainer.training.cache.store import build_cache
from pipetrainer.training.data.dataset import scan_dataset
from pipetrainer.training.data.micro_batches import load_examples

PACK_DIR = Path(__file__).resolve().parent.parent

_FILLER = """
import importlib.util, json, sys
pack, comfy_root, vae_path, clip_path, data, cache = sys.argv[1:7]
spec = importlib.util.spec_from_file_location("_entry", pack + "/training/process/entry.py")
entry = importlib.util.module_from_spec(spec); spec.loader.exec_module(entry); entry.import_pack()
from pipetrainer.training.model.comfy_env import use_comfyui
use_comfyui(comfy_root, "cpu")
import comfy.sd, comfy.utils
from pipetrainer.training.cache.store import build_cache
from pipetrainer.training.data.dataset import scan_dataset
vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(vae_path))
clip = comfy.sd.load_clip([clip_path], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION)
r = build_cache(scan_dataset(data, 64), vae, clip, cache)
print("REPORT " + json.dumps({"encoded": dict(r.report.encoded), "reused": dict(r.report.reused),
      "other": dict(r.report.by_other_process), "items": len(r.items)}))
"""


def _dataset(folder: Path, n: int) -> Path:
    folder.mkdir()
    for i in range(n):
        Image.new("RGB", (64, 64), (i * 30 % 256, 255 - i * 20, (i * 70) % 256)).save(folder / f"img_{i:02d}.png")
        (folder / f"img_{i:02d}.txt").write_text(f"a flat picture number {i}", encoding="utf-8")
    return folder


def _filler(comfy_root, fixture_paths, data: Path, cache: Path) -> subprocess.Popen:
    args = [str(PACK_DIR), str(comfy_root), str(fixture_paths.vae), str(fixture_paths.clip), str(data), str(cache)]
    return subprocess.Popen([sys.executable, "-c", _FILLER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _report(proc: subprocess.Popen, timeout: float = 600) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(next(line for line in out.splitlines() if line.startswith("REPORT "))[7:])


def _entry_count(cache: Path) -> int:
    index = cache / "index.sqlite"
    if not index.exists():
        return 0
    db = sqlite3.connect(f"file:{index}?mode=ro", uri=True, timeout=30)
    try:
        return db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
    except sqlite3.OperationalError:  # tables not created yet
        return 0
    finally:
        db.close()


@pytest.mark.slow
def test_killed_filler_resumes_where_it_stopped(comfy_root, fixture_paths, encoders, tmp_path):
    data, cache = _dataset(tmp_path / "data", 8), tmp_path / "cache"
    proc = _filler(comfy_root, fixture_paths, data, cache)
    deadline = time.monotonic() + 300
    while _entry_count(cache) < 3:
        assert proc.poll() is None, "the filler finished before it could be killed; use a larger dataset"
        assert time.monotonic() < deadline, "the filler made no progress"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = _entry_count(cache)
    assert 3 <= done < 16
    vae, clip = encoders
    result = build_cache(scan_dataset(data, 64), vae, clip, cache)
    r = result.report
    assert sum(r.reused.values()) == done and sum(r.encoded.values()) == 16 - done
    assert r.reencoded == [] and r.skipped == []
    assert len(load_examples(result.items)) == 8


@pytest.mark.slow
def test_two_processes_filling_one_cache_encode_each_item_once(comfy_root, fixture_paths, tmp_path):
    data, cache = _dataset(tmp_path / "data", 4), tmp_path / "cache"
    procs = [_filler(comfy_root, fixture_paths, data, cache) for _ in range(2)]
    reports = [_report(p) for p in procs]
    for kind in ("latent", "text"):
        assert sum(r["encoded"].get(kind, 0) for r in reports) == 4, reports
        for r in reports:
            assert r["encoded"].get(kind, 0) + r["reused"].get(kind, 0) + r["other"].get(kind, 0) == 4, reports
    assert all(r["items"] == 4 for r in reports)
    assert _entry_count(cache) == 8
