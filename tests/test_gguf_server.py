"""``Load GGUF Model (PipeTrainer)`` in a real ComfyUI server, with ComfyUI-GGUF installed next to the pack.

Runs when ``COMFYUI_GGUF_PATH`` points at a checkout of github:city96/ComfyUI-GGUF (skipped otherwise;
the pack is on no package registry). The server gets it through an extra custom-nodes folder holding a
link to that checkout (devkit/host.py ``extra_custom_nodes_args``), so the host's own ``custom_nodes``
stays untouched. The GGUF file is the tiny MMDiT written in Q8_0 with the ``gguf`` package. One graph:
the GGUF loader, the demo dataset and cache, a few training steps, and stock KSampler/VAEDecode/SaveImage
on both the trained MODEL and the untrained one. ComfyUI's own LoRA loader applies the trained LoRA to
the GGUF MODEL (nodes/train.py): every key must map (no "lora key not loaded" in the server log).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pipetrainer.devkit import quant_fixtures
from pipetrainer.devkit.host import ComfyServer, extra_custom_nodes_args, history_error, output_images
from safetensors.torch import load_file

GGUF_PATH = os.environ.get("COMFYUI_GGUF_PATH", "")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not GGUF_PATH or not Path(GGUF_PATH, "ops.py").is_file(),
                                 reason="set COMFYUI_GGUF_PATH to a checkout of github:city96/ComfyUI-GGUF")]
WORKFLOW = Path(__file__).resolve().parent.parent / "workflows" / "api" / "pipetrainer_tiny_mmdit.json"


@pytest.fixture(scope="module")
def gguf_server(comfy_root, fixture_paths, tmp_path_factory):
    """A server of its own with ComfyUI-GGUF loaded, and the Q8_0 file's name in models/diffusion_models."""
    folder = tmp_path_factory.mktemp("gguf-nodes")
    (folder / "ComfyUI-GGUF").symlink_to(Path(GGUF_PATH).resolve(), target_is_directory=True)
    name = f"pipetrainer-test-{uuid.uuid4().hex[:6]}-Q8_0.gguf"
    path = comfy_root / "models" / "diffusion_models" / name
    quant_fixtures.write_gguf(fixture_paths.mmdit, path, "Q8_0")
    server = ComfyServer(comfy_root, folder / "comfyui.log", extra_custom_nodes_args(folder, folder / "config"))
    try:
        yield server.start(), name
    finally:
        server.stop()
        path.unlink(missing_ok=True)


def _graph(gguf_name: str, lora_name: str, steps: int) -> dict:
    prompt = json.loads(WORKFLOW.read_text())
    prompt.pop("21", None)  # the sample-preview output: not needed here
    prompt["1"] = {"class_type": "PipeTrainerLoadGGUF", "inputs": {"unet_name": gguf_name}}
    prompt["8"]["inputs"].update(lora_name=lora_name, steps=steps, training_dtype="bf16")
    prompt["14"]["inputs"]["filename_prefix"] = lora_name
    prompt["15"] = {"class_type": "KSampler", "inputs": {**prompt["12"]["inputs"], "model": ["1", 0]}}
    prompt["16"] = {"class_type": "VAEDecode", "inputs": {"samples": ["15", 0], "vae": ["3", 0]}}
    prompt["17"] = {"class_type": "SaveImage", "inputs": {"images": ["16", 0], "filename_prefix": lora_name + "_base"}}
    return prompt


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def test_gguf_model_trains_and_samples_in_a_real_server(gguf_server, comfy_root):
    server, gguf_name = gguf_server
    info = server.get("/object_info/PipeTrainerLoadGGUF")["PipeTrainerLoadGGUF"]
    kind, *extra = info["input"]["required"]["unet_name"]  # V1 lists the options, V3 says COMBO + {"options"}
    assert gguf_name in (kind if isinstance(kind, list) else extra[0]["options"])  # ComfyUI-GGUF's unet_gguf list
    name = f"gguf_e2e_{uuid.uuid4().hex[:6]}"
    entry = server.wait(server.queue(_graph(gguf_name, name, steps=4)), timeout=900)
    assert history_error(entry) is None, server.log_tail()
    log = server.log_path.read_text(errors="replace")
    assert "lora key not loaded" not in log, log[-4000:]
    lora_path = comfy_root / "models" / "loras" / f"{name}.safetensors"
    lora = load_file(str(lora_path))
    lora_path.unlink()  # a test file: not left in the host's LoRA list
    assert lora and all(k.startswith("diffusion_model.") for k in lora)
    trained, base = (output_images({"outputs": {node: entry["outputs"][node]}}, comfy_root) for node in ("14", "17"))
    assert len(trained) == len(base) == 1
    assert np.abs(_pixels(trained[0]) - _pixels(base[0])).max() > 0  # the trained LoRA is applied
