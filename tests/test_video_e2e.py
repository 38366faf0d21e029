"""Wan 2.1 text-to-video end to end on a real ComfyUI server: the example workflow
(workflows/api/pipetrainer_wan_t2v.json) caches a mixed video dataset, trains a LoRA, samples a clip.

The server is this test's own: it also loads the test-only nodes of tests/custom_nodes (a tiny
UMT5-shaped text encoder; ComfyUI's CLIPLoader can only build the 5.7 B-parameter UMT5-XXL), so no
other test's server sees them. The workflow's loaders are swapped for tiny fixtures that ComfyUI's
own detection accepts (devkit.fixtures.build_tiny_wan_t2v, devkit.fixtures_video.build_tiny_wan21_vae),
everything else is the example graph: ModelSamplingSD3 shift 8 before Train LoRA, EmptyHunyuanLatentVideo,
KSampler, VAEDecode, SaveAnimatedWEBP.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pipetrainer.devkit.host import ComfyServer, extra_custom_nodes_args, history_error, output_images
from pipetrainer.tests.ui_client import NodeTexts
from pipetrainer.training.process.events import read_all
from safetensors.torch import load_file

PACK = Path(__file__).resolve().parent.parent
WORKFLOW = PACK / "workflows" / "api" / "pipetrainer_wan_t2v.json"
TEST_NODES = Path(__file__).resolve().parent / "custom_nodes"
MODEL, SHIFT, TEXT, VAE, DATASET, CACHE, LORA, OPTIMIZER, TRAIN = "1", "2", "3", "4", "5", "6", "7", "8", "9"
LATENT, SAMPLER, SAVE = "12", "13", "15"
FPS = 16

# name -> (container, frames written, width, height): a still image, clips of 5, 7 (cut to 5), 9 and 11 (cut
# to 9) frames, landscape / portrait / square, MP4 (H.264) and WebM (VP9). Few frames: the Wan VAE's 3-D
# convolutions are slow on a CPU, even this narrow.
CLIPS = {
    "still": ("png", 1, 64, 64),
    "wide": ("mp4", 5, 96, 48),
    "tall": ("webm", 7, 48, 96),
    "square": ("mp4", 9, 64, 64),
    "long": ("mp4", 11, 112, 64),
}


@pytest.fixture(scope="module")
def video_server(comfy_root, tmp_path_factory):
    """A ComfyUI server with this pack plus the test-only nodes, and the tiny Wan fixtures built."""
    from pipetrainer.devkit.fixtures import WAN_T2V_FILE, _build_atomically, build_tiny_wan_t2v
    from pipetrainer.devkit.fixtures_video import WAN21_VAE_FILE, build_tiny_wan21_vae

    for target, build in ((comfy_root / "models" / "diffusion_models" / WAN_T2V_FILE, build_tiny_wan_t2v),
                          (comfy_root / "models" / "vae" / WAN21_VAE_FILE, build_tiny_wan21_vae)):
        if not target.exists():
            _build_atomically(target, build)
    tmp = tmp_path_factory.mktemp("video_server")
    srv = ComfyServer(comfy_root, tmp / "comfyui.log", extra_custom_nodes_args(TEST_NODES, tmp)).start()
    yield srv
    srv.stop()


def _write_dataset(folder: Path, seed: int, tag: str) -> None:
    """A square moving over a background; colours from ``seed`` and ``tag`` in the captions, so every
    run's files and captions are new to the cache."""
    import av

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for name, (kind, frames, width, height) in CLIPS.items():
        bg, fg = rng.integers(0, 256, 3, dtype=np.uint8), rng.integers(0, 256, 3, dtype=np.uint8)
        pictures = []
        for f in range(frames):
            pixels = np.empty((height, width, 3), dtype=np.uint8)
            pixels[:] = bg
            x = (4 * f) % (width - 16)
            pixels[height // 2 - 8:height // 2 + 8, x:x + 16] = fg
            pictures.append(pixels)
        (folder / f"{name}.txt").write_text(f"a {name} clip of a moving square, {tag}\n", encoding="utf-8")
        if kind == "png":
            Image.fromarray(pictures[0]).save(folder / f"{name}.png")
            continue
        with av.open(str(folder / f"{name}.{kind}"), "w") as out:
            stream = out.add_stream("libx264" if kind == "mp4" else "libvpx-vp9", rate=FPS)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for pixels in pictures:
                out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
            out.mux(stream.encode())


def _tiny_workflow(name: str, folder: str) -> dict:
    """The example workflow with the tiny fixtures, an 80 px dataset (Wan needs 8 latent pixels a side), 3 fp32 steps and a 2-step 5-frame sample."""
    from pipetrainer.devkit.fixtures import WAN_T2V_FILE
    from pipetrainer.devkit.fixtures_video import WAN21_VAE_FILE

    prompt = json.loads(WORKFLOW.read_text())
    assert prompt[TEXT]["class_type"] == "CLIPLoader" and prompt[TEXT]["inputs"]["type"] == "wan"
    prompt[TEXT] = {"class_type": "PipeTrainerTestTinyUMT5Loader", "inputs": {"seed": 4096}}
    prompt[MODEL]["inputs"]["unet_name"] = WAN_T2V_FILE
    prompt[VAE]["inputs"]["vae_name"] = WAN21_VAE_FILE
    prompt[DATASET]["inputs"].update(folder=folder, resolution=80, max_frames=9, min_ratio=0.66, max_ratio=1.5)
    prompt[LORA]["inputs"].update(rank=4, alpha=4.0)
    prompt[OPTIMIZER]["inputs"].update(learning_rate=1e-3, warmup_steps=0, weight_decay=0.0)
    prompt[TRAIN]["inputs"].update(lora_name=name, steps=3, save_every=0, training_dtype="fp32")
    prompt[LATENT]["inputs"].update(width=64, height=64, length=5)
    prompt[SAMPLER]["inputs"].update(steps=2)
    prompt[SAVE]["inputs"]["filename_prefix"] = name
    return prompt


def _report(entry: dict) -> str:
    return "\n".join(entry["outputs"][CACHE]["text"])


def _cached_nodes(entry: dict) -> list[str]:
    return [n for kind, data in entry["status"]["messages"] if kind == "execution_cached" for n in data["nodes"]]


def _loaded_by_comfyui(model_path: Path, lora: dict) -> dict:
    """The patches ComfyUI's own LoRA loader makes of ``lora`` for the model file (``comfy.lora``)."""
    import comfy.lora
    import comfy.sd

    model = comfy.sd.load_diffusion_model(str(model_path))
    return comfy.lora.load_lora(lora, comfy.lora.model_lora_keys_unet(model.model, {}))


@pytest.mark.slow
def test_wan_t2v_workflow_caches_videos_trains_and_samples_a_clip(video_server, comfy_root, request):
    from pipetrainer.devkit.fixtures import WAN_T2V_FILE

    texts = NodeTexts(video_server).start()  # what the frontend draws on the nodes
    request.addfinalizer(texts.stop)

    name = f"wan_e2e_{uuid.uuid4().hex[:6]}"
    folder = f"pipetrainer_test_videos/{name}"
    _write_dataset(comfy_root / "input" / folder, seed=int(name[-6:], 16), tag=name)
    request.addfinalizer(lambda: shutil.rmtree(comfy_root / "input" / folder, ignore_errors=True))
    prompt = _tiny_workflow(name, folder)

    entry = video_server.wait(video_server.queue(prompt), timeout=600)
    assert history_error(entry) is None, video_server.log_tail()
    report = _report(entry)
    assert report.startswith("cached 5 latents, 5 texts; reused 0 latents, 0 texts; re-encoded 0 latents, 0 texts; "
                             "skipped 0 files"), report
    buckets = dict(re.findall(r"(\d+x\d+x\d+) \((\d+)\)", report.splitlines()[1]))
    frames = sorted(int(b.split("x")[2]) for b, n in buckets.items() for _ in range(int(n)))
    assert frames == [1, 5, 5, 9, 9], report  # 7 and 11 written frames are cut to the 4k+1 bucket below
    assert len({b.rsplit("x", 1)[0] for b in buckets}) == 3, report  # landscape, portrait, square

    # The run replayed the graph's ModelSamplingSD3 (shift 8) and trained every step.
    [run_dir] = sorted((comfy_root / "output" / "pipetrainer" / "runs").glob(f"{name}-*"))
    spec = json.loads((run_dir / "spec.json").read_text())
    assert dict(spec["model"]["sampling"]["parameters"])["shift"] == 8.0
    assert [e["step"] for e in read_all(run_dir) if e["type"] == "step"] == [1, 2, 3]
    assert texts.of(TRAIN)[-1].startswith("done: step 3/3"), texts.of(TRAIN)
    assert texts.of(CACHE)[-1] == report

    # The LoRA maps key for key in ComfyUI's own loader, in the server and here.
    lora_path = comfy_root / "models" / "loras" / f"{name}.safetensors"
    lora = load_file(str(lora_path))
    modules = {k.removesuffix(".lora_A.weight") for k in lora if k.endswith(".lora_A.weight")}
    assert modules and all(k.startswith("diffusion_model.blocks.") for k in modules)
    patches = _loaded_by_comfyui(comfy_root / "models" / "diffusion_models" / WAN_T2V_FILE, lora)
    assert len(patches) == len(modules)
    assert "lora key not loaded" not in video_server.log_path.read_text(errors="replace")

    # The sampled clip: 5 frames from 2 latent frames through the Wan VAE.
    [clip] = output_images(entry, comfy_root)
    assert clip.suffix == ".webp" and clip.exists()
    with Image.open(clip) as webp:
        assert webp.n_frames == 5 and webp.size == (64, 64)

    # A second queue of the caching part after ComfyUI forgot its node outputs: nothing is re-encoded.
    again = {k: prompt[k] for k in (TEXT, VAE, DATASET, CACHE)}
    again["20"] = {"class_type": "PreviewAny", "inputs": {"source": [CACHE, 1]}}
    for _ in range(2):  # /free is applied between prompts: a prompt queued at once may still hit the old cache
        video_server.post("/free", {"unload_models": True, "free_memory": True})
        time.sleep(1.0)
        second = video_server.wait(video_server.queue(again), timeout=300)
        assert history_error(second) is None, video_server.log_tail()
        if CACHE not in _cached_nodes(second):
            break
    assert CACHE not in _cached_nodes(second), second["status"]
    assert _report(second).startswith("cached 0 latents, 0 texts; reused 5 latents, 5 texts; "
                                      "re-encoded 0 latents, 0 texts; skipped 0 files"), _report(second)
