"""Previews that are the result: a step's LoRA rendered by ComfyUI's own loader and sampler (nodes/run/previews.py).

The oracle is the stock graph: LoraLoaderModelOnly + KSampler + VAEDecode + SaveImage on the real server,
with the final LoRA file and the same settings, must give the preview's pixels exactly.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pipetrainer.devkit.host import history_error, output_images
from pipetrainer.training.process.events import read_all
from safetensors.torch import save_file

WORKFLOW = Path(__file__).resolve().parent.parent / "workflows" / "api" / "pipetrainer_tiny_mmdit.json"
TRAIN, SETTINGS = "8", "30"
PROMPT = "a red circle on a blue background"
SAMPLING = {"seed": 42, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple"}


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def _random_lora(model_patcher, path: Path, seed: int = 0) -> Path:
    """A LoRA in the pack's file format on the first two attention/MLP Linears of the model (random values)."""
    g = torch.Generator().manual_seed(seed)
    linears = [(name, w) for name, w in model_patcher.model.diffusion_model.state_dict().items()
               if name.endswith(".weight") and w.ndim == 2 and "joint_blocks" in name][:2]
    tensors = {}
    for name, weight in linears:
        key = "diffusion_model." + name[: -len(".weight")]
        tensors[f"{key}.lora_A.weight"] = torch.randn(4, weight.shape[1], generator=g) * 0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(weight.shape[0], 4, generator=g) * 0.5
        tensors[f"{key}.alpha"] = torch.tensor(4.0)
    save_file(tensors, str(path))
    return path


# ---- fast: failures are reported, never raised, and the next preview still comes ----------------------
def test_a_failing_preview_is_reported_and_the_next_one_renders(comfy_root, fixture_paths, encoders, tmp_path):
    import comfy.sd
    from pipetrainer.nodes.preview_settings import PreviewSettings, preview_save_every
    from pipetrainer.nodes.run.previews import PreviewRunner

    assert [preview_save_every(0, 50), preview_save_every(100, 150), preview_save_every(20, 10)] == [50, 50, 10]
    vae, clip = encoders
    model = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))
    good = _random_lora(model, tmp_path / "good.safetensors")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    settings = PreviewSettings(clip=clip, vae=vae, prompts=(PROMPT,), width=64, height=64, every_n_steps=2,
                               **SAMPLING)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shown: list[str] = []
    runner = PreviewRunner(settings, model, str(run_dir), show=shown.append)
    runner.prepare()
    runner.on_event({"type": "saved", "step": 1, "path": str(good), "final": False})  # not a preview step
    runner.on_event({"type": "saved", "step": 2, "path": str(broken), "final": False})
    runner.render_pending()  # must not raise
    assert runner.latest_step is None and runner.status.startswith("warning: preview of step 2 failed")
    assert shown[-1] == runner.status
    # Training outran the previews: steps 4 and 5 (final) are due together; the newest is rendered.
    runner.on_event({"type": "saved", "step": 4, "path": str(good), "final": False})
    runner.on_event({"type": "saved", "step": 5, "path": str(good), "final": True})
    runner.finish()
    skipped = "step 4 skipped: the step-5 preview was already due"
    assert runner.latest_step == 5 and runner.status.startswith("previews: step 5")
    assert runner.status.endswith(skipped) and shown[-1] == runner.status  # on the node, under the progress
    assert runner.summary()[1].startswith("previews skipped: 1 (step 4: training outran the renders")
    assert sorted(p.name for p in (run_dir / "previews").iterdir()) == ["step_5_0.png"]
    events = read_all(run_dir)
    assert [(e["type"], e["step"]) for e in events if e["type"].startswith("preview")] == [
        ("preview_failed", 2), ("preview_skipped", 4), ("preview", 5)]
    log = (run_dir / "logs" / "previews.log").read_text()
    assert "Traceback" in log and skipped in log and "step 5 rendered: step_5_0.png" in log
    assert "safetensors" in events[0]["message"].lower() or "header" in events[0]["message"]

    # A prompt that cannot be encoded: reported once, and no preview is attempted.
    (tmp_path / "run2").mkdir()
    silent = PreviewRunner(PreviewSettings(clip=None, vae=vae, prompts=(PROMPT,), **SAMPLING), model,
                           str(tmp_path / "run2"), show=shown.append)
    silent.prepare()
    silent.on_event({"type": "saved", "step": 100, "path": str(good), "final": True})
    silent.finish()
    assert silent.latest_step is None and "encoding the preview prompts failed" in silent.status
    assert not (tmp_path / "run2" / "previews").exists()


# ---- slow: through the real server, the preview is the stock graph's image ------------------------------
def _train_with_previews(name: str) -> dict:
    prompt = json.loads(WORKFLOW.read_text())
    prompt[TRAIN]["inputs"].update(lora_name=name, steps=4, previews=[SETTINGS, 0])
    prompt[SETTINGS] = {"class_type": "PipeTrainerPreviewSettings", "inputs": {
        "clip": ["2", 0], "vae": ["3", 0], "prompts": PROMPT, "negative": "", "width": 64, "height": 64,
        "frames": 1, "every_n_steps": 2, **SAMPLING}}
    # Only the training branch: the example's own sampler is not what this test is about.
    return {k: v for k, v in prompt.items() if k in {"1", "2", "3", "4", "5", "6", "7", TRAIN, SETTINGS}}


def _stock_graph(lora_file: str, prefix: str) -> dict:
    prompt = json.loads(WORKFLOW.read_text())
    keep = {k: v for k, v in prompt.items() if k in {"1", "2", "3", "9", "10", "11", "12", "13", "14"}}
    keep["20"] = {"class_type": "LoraLoaderModelOnly",
                  "inputs": {"model": ["1", 0], "lora_name": lora_file, "strength_model": 1.0}}
    keep["12"]["inputs"].update(model=["20", 0], **SAMPLING)
    keep["9"]["inputs"]["text"] = PROMPT
    keep["11"]["inputs"].update(width=64, height=64)
    keep["14"]["inputs"]["filename_prefix"] = prefix
    return keep


@pytest.mark.slow
def test_the_final_preview_is_the_stock_graph_image_pixel_for_pixel(server, comfy_root):
    name = f"prev_{uuid.uuid4().hex[:6]}"
    entry = server.wait(server.queue(_train_with_previews(name)), timeout=600)
    assert history_error(entry) is None, server.log_tail()
    [run_dir] = sorted((comfy_root / "output" / "pipetrainer" / "runs").glob(f"{name}-*"))
    events = read_all(run_dir)
    rendered = [e["step"] for e in events if e["type"] == "preview"]
    # Ranks never wait for previews: on a loaded machine step 4 may come before step 2's render started,
    # and then only the newest due step renders (the skip is reported). The final step always renders.
    assert rendered in ([2, 4], [4]), server.log_tail()
    if rendered == [4]:
        assert "step 2 skipped: the step-4 preview was already due" in (
            run_dir / "logs" / "previews.log").read_text()
        assert [e["step"] for e in events if e["type"] == "preview_skipped"] == [2]
    assert not [e for e in events if e["type"] == "preview_failed"]
    shown = entry["outputs"][TRAIN]["images"]  # the node's UI output: the final step's previews
    assert [(i["filename"], i["type"]) for i in shown] == [("step_4_0.png", "output")]
    assert (comfy_root / "output" / shown[0]["subfolder"] / "step_4_0.png").is_file()

    stock = server.wait(server.queue(_stock_graph(f"{name}.safetensors", name + "_stock")), timeout=300)
    assert history_error(stock) is None, server.log_tail()
    [stock_image] = output_images(stock, comfy_root)
    final = _pixels(run_dir / "previews" / "step_4_0.png")
    assert np.array_equal(final, _pixels(stock_image))
    if rendered == [2, 4]:
        assert np.abs(final - _pixels(run_dir / "previews" / "step_2_0.png")).max() > 0  # step 2's LoRA differs

    try:  # an optional package: without it the run log says how to turn it on
        from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator
    except ImportError:
        assert "pip install tensorboard" in (run_dir / "logs" / "previews.log").read_text()
        return
    board = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={IMAGES: 0}).Reload()
    assert [e.step for e in board.Images("preview/0")] == rendered
