"""Previews that are the result: each new LoRA file rendered by ComfyUI's own code, in the ComfyUI process.

For a step's LoRA file this does what a user's graph does with it: the stock ``LoraLoaderModelOnly``
on the Train node's input MODEL, the stock ``CLIPTextEncode`` for the prompts, an empty latent of the
VAE's size, the stock KSampler code path (``nodes.common_ksampler``) and the stock ``VAEDecode``. So a
preview equals, pixel for pixel, what the same settings give in a graph with the same file.

While the training processes go on (they never wait for it), rendering runs in one worker thread of the
Train node, so the node thread keeps forwarding progress while a preview renders; the final LoRA's
previews render in the node thread after training (docs/previews.md). A preview that fails is reported
(node text, ``events.jsonl`` ``preview_failed``, ``logs/previews.log``, ComfyUI's console) and never ends
the run; so is each due step skipped because a newer one was due (``preview_skipped``). Cancel during a
preview still cancels.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import queue
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import comfy.model_management
import comfy.utils
import folder_paths
import numpy as np
import torch
from PIL import Image

from ...training.loop.tensorboard_log import TensorBoardLog
from ...training.process.events import EventWriter
from ..preview_settings import PreviewSettings

PREVIEWS_DIR = "previews"


def encode(clip, text: str):
    """The stock CLIPTextEncode."""
    import nodes

    return nodes.CLIPTextEncode().encode(clip, text)[0]


def empty_latent(vae, width: int, height: int, frames: int) -> torch.Tensor:
    """Zeros of the VAE's latent shape for one image (or video), as the family's Empty*Latent* node makes
    them (``common_ksampler`` then fits the channels and dimensions to the model, as for any empty latent)."""
    ratio = vae.downscale_ratio
    device = comfy.model_management.intermediate_device()
    if isinstance(ratio, tuple):  # video VAEs: (frames -> latent frames, height ratio, width ratio)
        frames_of, rh, rw = ratio
        return torch.zeros([1, vae.latent_channels, frames_of(frames), height // rh, width // rw], device=device)
    if getattr(vae, "latent_dim", 2) != 2:
        raise ValueError(f"previews need an image or video VAE; this one has {vae.latent_dim}-D latents.")
    return torch.zeros([1, vae.latent_channels, height // ratio, width // ratio], device=device)


def lora_name_in_loras(path: str) -> str | None:
    """``path`` as the stock LoRA loaders name it (relative to a ComfyUI loras folder), or None (also when
    that name finds another file first, in an earlier loras folder)."""
    full = os.path.realpath(path)
    for root in folder_paths.get_folder_paths("loras"):
        rel = os.path.relpath(full, os.path.realpath(root))
        if not rel.startswith(".."):
            found = folder_paths.get_full_path("loras", rel)
            return rel if found is not None and os.path.realpath(found) == full else None
    return None


def with_lora(model, lora_path: str):
    """The model with the LoRA file applied at strength 1 by the stock LoraLoaderModelOnly."""
    import nodes

    name = lora_name_in_loras(lora_path)
    if name is not None:
        return nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, 1.0)[0]
    import comfy.sd
    import comfy.utils

    lora = comfy.utils.load_torch_file(lora_path, safe_load=True)
    return comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]


def render(model, positive, negative, settings: PreviewSettings) -> torch.Tensor:
    """Images [frames, H, W, 3] in 0..1 for one prompt: the stock KSampler + VAEDecode code path."""
    import nodes

    latent = {"samples": empty_latent(settings.vae, settings.width, settings.height, settings.frames)}
    sampled = nodes.common_ksampler(model, settings.seed, settings.steps, settings.cfg, settings.sampler_name,
                                    settings.scheduler, positive, negative, latent)[0]
    return nodes.VAEDecode().decode(settings.vae, sampled)[0]


def to_pil(image: torch.Tensor) -> Image.Image:
    """One [H, W, 3] image as the stock SaveImage turns it into 8-bit pixels."""
    pixels = 255.0 * image.cpu().numpy()
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def save_preview(images: torch.Tensor, folder: Path, step: int, index: int) -> Path:
    """``step_<N>_<i>.png`` (the first frame); a video also as ``step_<N>_<i>.webp`` (every frame)."""
    folder.mkdir(parents=True, exist_ok=True)
    frames = [to_pil(img) for img in images]
    path = folder / f"step_{step}_{index}.png"
    frames[0].save(path)
    if len(frames) > 1:
        frames[0].save(path.with_suffix(".webp"), save_all=True, append_images=frames[1:], duration=62, lossless=True)
    return path


class _Abandoned(Exception):
    """The node gave the render up (the run stopped or failed): the worker ends it at its next check."""


class _WorkerProgress:
    """ComfyUI's progress-bar hook while the preview worker lives.

    ComfyUI's ``ProgressBar`` takes the global hook when it is made, and the sampler makes one per render,
    in the worker. There a sampler step only checks whether to stop (Cancel, or the node giving the render
    up), without moving the Train node's bar (it shows training's steps) and without consuming ComfyUI's
    interrupt flag (the node thread acts on it). Every other thread gets ComfyUI's own hook.
    """

    def __init__(self, runner: PreviewRunner) -> None:
        self.runner = runner
        self.original = comfy.utils.PROGRESS_BAR_HOOK

    def __call__(self, value, total, preview, *args, **kwargs):
        if threading.current_thread() is self.runner._thread:
            self.runner._stop_if_asked()
            return None
        return self.original(value, total, preview, *args, **kwargs) if self.original is not None else None

    def install(self) -> None:
        comfy.utils.set_progress_bar_global_hook(self)

    def uninstall(self) -> None:
        if comfy.utils.PROGRESS_BAR_HOOK is self:
            comfy.utils.set_progress_bar_global_hook(self.original)


def skipped_sentence(steps: list[int], due: int) -> str:
    """``step 150 skipped: the step-200 preview was already due`` (``steps 100, 150 skipped: ...``)."""
    names = ", ".join(str(s) for s in steps)
    return f"step{'s' if len(steps) > 1 else ''} {names} skipped: the step-{due} preview was already due"


class PreviewRunner:
    """Follows a run's ``saved`` events and renders the LoRA files of its preview steps.

    ``on_event`` notes a due step. After ``start`` one worker thread renders the newest due step while the
    node thread goes on forwarding progress; due steps older than the one it takes are skipped and
    reported. What the worker has to show reaches the node's callbacks through ``poll`` (called by the node
    thread between polls of the event log), so every text and picture is sent from the node thread.
    ``finish`` waits for a render under way and renders the final LoRA in the calling thread after the
    training processes exited; ``close`` gives up a render under way (it stops at its next sampler step)
    and waits for the worker. Without ``start``, ``render_pending`` renders in the calling thread. Never
    two renders at once. A disabled runner (no Preview Settings connected) does nothing.
    """

    def __init__(self, settings: PreviewSettings | None, model, run_dir: str,
                 show: Callable[[str], None] = lambda text: None, on_shown: Callable[[], None] = lambda: None,
                 weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        """``show`` gets :attr:`status` when it changes, ``on_shown`` is called when new previews are there
        (both in the node thread). ``weights``: a context in which the MODEL holds its weights
        (nodes/run/held_weights.py: ComfyUI's copy is released while training runs and comes back for each
        preview)."""
        self.settings = settings
        self.model = model
        self.run_dir = Path(run_dir)
        self._show = show
        self._on_shown = on_shown
        self._weights = weights
        self._conds: list | None = None
        self._negative = None
        self._pending: list[dict] = []
        self._board: TensorBoardLog | None = None
        self._shown: tuple[int | None, list[Image.Image], list[Path]] = (None, [], [])  # one assignment
        self.status = ""  # the lines the node keeps under its progress text
        self.failures: list[dict] = []
        self.skipped: list[int] = []
        self._lock = threading.Condition()
        self._render_lock = threading.Lock()  # never two renders at once
        self._thread: threading.Thread | None = None
        self._closing = False
        self._abandon = threading.Event()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._hook: _WorkerProgress | None = None

    @property
    def enabled(self) -> bool:
        return self.settings is not None

    @property
    def latest_step(self) -> int | None:
        return self._shown[0]

    @property
    def latest(self) -> list[Image.Image]:
        return self._shown[1]

    @property
    def latest_files(self) -> list[Path]:
        return self._shown[2]

    # ---- the prompts, once, before training starts ---------------------------------------------------
    def prepare(self) -> None:
        """Encode the prompts with the graph's CLIP (before the node frees ComfyUI's models for training)."""
        if not self.enabled:
            return
        try:
            with torch.inference_mode():
                self._conds = [encode(self.settings.clip, prompt) for prompt in self.settings.prompts]
                self._negative = encode(self.settings.clip, self.settings.negative)
        except comfy.model_management.InterruptProcessingException:
            raise
        except Exception as exc:  # noqa: BLE001 - a preview never ends a run: reported, then off
            self._report(None, exc, "encoding the preview prompts failed; no previews this run")

    # ---- following the run -------------------------------------------------------------------------
    def on_event(self, event: dict) -> None:
        if not self.enabled or self._conds is None or event.get("type") != "saved" or not event.get("path"):
            return
        step = int(event["step"])
        if event.get("final") or step % self.settings.every_n_steps == 0:
            with self._lock:
                self._pending = [e for e in self._pending if int(e["step"]) != step] + [event]
                self._lock.notify_all()

    def start(self) -> None:
        """Render from now on in one worker thread (a no-op without previews)."""
        if not self.enabled or self._conds is None or self._thread is not None or self._closing:
            return
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._hook = _WorkerProgress(self)
        self._hook.install()
        context = contextvars.copy_context()  # the node's execution context, as if the node rendered
        self._thread = threading.Thread(target=context.run, args=(self._work, device), daemon=True,
                                        name="PipeTrainer previews")
        self._thread.start()

    def poll(self) -> None:
        """In the node thread: show what the worker did since the last call (status, new previews)."""
        while True:
            try:
                what = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._deliver(what)

    def render_pending(self) -> None:
        """Render the newest due step in the calling thread (older due steps are skipped and reported)."""
        taken = self._take()
        if taken is not None:
            self._render_newest(*taken)

    def finish(self) -> None:
        """After a finished run: wait for a render under way, render the final LoRA (if not yet) in the
        calling thread, close the TensorBoard writer."""
        try:
            self._stop_worker(abandon=False)
            self.poll()
            comfy.model_management.throw_exception_if_processing_interrupted()  # Cancel met by the worker
            self.render_pending()
        finally:
            self.close()

    def close(self) -> None:
        """Give up a render under way (it ends at its next sampler step), wait for the worker, close the
        TensorBoard writer. What the worker did last is not shown (the node shows how the run ended)."""
        self._stop_worker(abandon=True)
        if self._board is not None:
            board, self._board = self._board, None
            try:
                board.close()
            except Exception:  # noqa: BLE001 - an optional viewer's file
                logging.exception("[PipeTrainer] closing the previews' TensorBoard writer failed")

    def summary(self) -> list[str]:
        """The lines for the node's final text: the last preview status, and every skipped step."""
        lines = [self.status.split("\n")[0]] if self.status else []
        if self.skipped:
            steps = ", ".join(str(s) for s in self.skipped[:12]) + (", ..." if len(self.skipped) > 12 else "")
            lines.append(f"previews skipped: {len(self.skipped)} (step{'s' if len(self.skipped) > 1 else ''} "
                         f"{steps}: training outran the renders; see {self.run_dir / 'logs' / 'previews.log'})")
        return lines

    # ---- the worker ---------------------------------------------------------------------------------
    def _work(self, device: int | None) -> None:
        if device is not None:
            torch.cuda.set_device(device)
        while True:
            with self._lock:  # a reentrant lock: _take takes it too
                while not (self._pending or self._closing):
                    self._lock.wait()
                if self._closing:
                    return
                taken = self._take()
            try:
                self._render_newest(*taken)
            except _Abandoned:
                self._log(f"preview of step {taken[0]['step']} abandoned: the run stopped before it was rendered")
                return
            except comfy.model_management.InterruptProcessingException:
                # ComfyUI's layers consume the interrupt flag where they meet it: put it back for the node thread
                comfy.model_management.interrupt_current_processing(True)
                return
            except Exception:  # noqa: BLE001 - a preview never ends a run (the node thread goes on)
                logging.exception("[PipeTrainer] the preview worker failed")
                return

    def _stop_worker(self, abandon: bool) -> None:
        with self._lock:
            self._closing = True
            if abandon:
                self._abandon.set()
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._hook is not None:
            self._hook.uninstall()
            self._hook = None

    def _stop_if_asked(self) -> None:
        """Between the parts of a render: in the worker, stop when the node gave the render up or on Cancel
        (leaving ComfyUI's flag to the node thread); in the node thread, ComfyUI's own check."""
        if threading.current_thread() is self._thread:
            if self._abandon.is_set():
                raise _Abandoned()
            if comfy.model_management.processing_interrupted():
                raise comfy.model_management.InterruptProcessingException()
        else:
            comfy.model_management.throw_exception_if_processing_interrupted()

    def _take(self) -> tuple[dict, list[int]] | None:
        """The newest due step and the older due ones it skips (None when none is due)."""
        with self._lock:
            if not self._pending:
                return None
            pending = sorted(self._pending, key=lambda e: int(e["step"]))
            self._pending.clear()
        return pending[-1], [int(e["step"]) for e in pending[:-1]]

    def _tell(self, what: str) -> None:
        """Hand ``what`` ("status" or "shown") to the node thread (directly when already in it)."""
        if threading.current_thread() is self._thread:
            self._inbox.put(what)
        else:
            self._deliver(what)

    def _deliver(self, what: str) -> None:
        if what == "status":
            self._show(self.status)
        else:
            self._on_shown()

    def _render_newest(self, newest: dict, skipped: list[int]) -> None:
        step = int(newest["step"])
        skip_line = ""
        if skipped:
            skip_line = skipped_sentence(skipped, step)
            self.skipped += skipped
            self._log(skip_line)
            try:
                writer = EventWriter(self.run_dir, source="node")
                for s in skipped:
                    writer.emit("preview_skipped", step=s, due=step, message=skipped_sentence([s], step))
            except OSError:  # the log has it; a full disk must not end the run
                logging.exception("[PipeTrainer] could not write the skipped previews into %s", self.run_dir)
        with self._render_lock:
            self._render(step, str(newest["path"]), skip_line)

    def _render(self, step: int, lora_path: str, skip_line: str = "") -> None:
        self._set_status(f"rendering previews of step {step}", skip_line)
        folder = self.run_dir / PREVIEWS_DIR
        try:
            self._stop_if_asked()
            images, files = self._images(step, lora_path, folder)
            self._shown = (step, images, files)
            count = f"{len(files)} image{'s' if len(files) != 1 else ''}"
            self._set_status(f"previews: step {step} ({count} in {folder})", skip_line)
            self._log(f"step {step} rendered: {', '.join(f.name for f in files)}")
            EventWriter(self.run_dir, source="node").emit("preview", step=step, files=[str(f) for f in files])
            self._to_tensorboard(step, images)
        except (comfy.model_management.InterruptProcessingException, _Abandoned):
            raise
        except Exception as exc:  # noqa: BLE001 - a preview never ends a run
            self._report(step, exc, f"preview of step {step} failed", skip_line)
            return
        finally:  # the training ranks may share the GPU: give ComfyUI's memory back
            comfy.model_management.unload_all_models()
            comfy.model_management.soft_empty_cache()
        self._tell("shown")

    def _images(self, step: int, lora_path: str, folder: Path) -> tuple[list[Image.Image], list[Path]]:
        images, files = [], []
        with self._weights(), torch.inference_mode():  # inference mode: as ComfyUI runs every node
            self._stop_if_asked()  # the reload may take a while
            model = with_lora(self.model, lora_path)
            for index, positive in enumerate(self._conds):
                self._stop_if_asked()
                frames = render(model, positive, self._negative, self.settings)
                files.append(save_preview(frames, folder, step, index))
                images.append(to_pil(frames[0]))
        return images, files

    def _set_status(self, line: str, extra: str = "") -> None:
        self.status = "\n".join(t for t in (line, extra) if t)
        self._tell("status")

    # ---- reporting --------------------------------------------------------------------------------
    def _report(self, step: int | None, exc: BaseException, what: str, extra: str = "") -> None:
        message = f"{what} ({type(exc).__name__}: {exc}); training goes on"
        trace = traceback.format_exc()
        self.failures.append({"step": step, "message": message})
        logging.warning("[PipeTrainer] %s\n%s", message, trace)
        try:
            EventWriter(self.run_dir, source="node").emit("preview_failed", step=step, message=message, traceback=trace)
        except OSError:  # the console has it; a full disk must not end the run either
            logging.exception("[PipeTrainer] could not write the preview failure into %s", self.run_dir)
        self._log(f"{message}\n{trace}")
        self._set_status(f"warning: {message}; see {self.run_dir / 'logs' / 'previews.log'}", extra)

    def _log(self, text: str) -> None:
        """Append to ``logs/previews.log`` (on a write error, to ComfyUI's console only)."""
        try:
            logs = self.run_dir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            with open(logs / "previews.log", "a", encoding="utf-8") as f:
                f.write(text.rstrip("\n") + "\n")
        except OSError:
            logging.exception("[PipeTrainer] could not write %s; it said: %s", self.run_dir / "logs", text)

    def _to_tensorboard(self, step: int, images: list[Image.Image]) -> None:
        if self._board is None:
            self._board = TensorBoardLog.open(self.run_dir, self._log)
        self._board.images(step, {f"preview/{i}": np.asarray(img) for i, img in enumerate(images)})

    # ---- what the node shows ------------------------------------------------------------------------
    def ui_images(self) -> list[dict]:
        """The latest previews as UI image results (files under ComfyUI's output folder)."""
        out = []
        root = os.path.realpath(folder_paths.get_output_directory())
        for path in self.latest_files:
            rel = os.path.relpath(os.path.realpath(path.parent), root)
            if not rel.startswith(".."):
                out.append({"filename": path.name, "subfolder": "" if rel == "." else rel, "type": "output"})
        return out
