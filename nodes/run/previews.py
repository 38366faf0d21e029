"""Previews that are the result: each new LoRA file rendered by ComfyUI's own code, in the ComfyUI process.

For a step's LoRA file this does what a user's graph does with it: the stock ``LoraLoaderModelOnly``
on the Train node's input MODEL, the stock ``CLIPTextEncode`` for the prompts, an empty latent of the
VAE's size, the stock KSampler code path (``nodes.common_ksampler``) and the stock ``VAEDecode``. So a
preview equals, pixel for pixel, what the same settings give in a graph with the same file.

Rendering runs in the node's thread while the training processes go on (they never wait for it), see
docs/previews.md. A preview that fails is reported (node text, ``events.jsonl`` ``preview_failed``,
``logs/previews.log``, ComfyUI's console) and never ends the run; Cancel during a preview still cancels.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import comfy.model_management
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


class PreviewRunner:
    """Follows a run's ``saved`` events and renders the LoRA files of its preview steps.

    ``on_event`` only notes a due step; ``render_pending`` (called by the node between polls of the
    event log) renders the newest due step, skipping older ones when training outran the previews;
    ``finish`` renders the final LoRA after the training processes exited. A disabled runner (no Preview
    Settings connected) does nothing.
    """

    def __init__(self, settings: PreviewSettings | None, model, run_dir: str,
                 show: Callable[[str], None] = lambda text: None, on_shown: Callable[[], None] = lambda: None,
                 weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        """``weights``: a context in which the MODEL holds its weights (nodes/run/held_weights.py: ComfyUI's
        copy is released while training runs and comes back for each preview)."""
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
        self.latest: list[Image.Image] = []
        self.latest_step: int | None = None
        self.latest_files: list[Path] = []
        self.status = ""  # one line the node keeps under its progress text
        self.failures: list[dict] = []

    @property
    def enabled(self) -> bool:
        return self.settings is not None

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
            self._pending.append(event)

    def render_pending(self) -> None:
        """Render the newest due step (older due steps are skipped and logged)."""
        if not self._pending:
            return
        newest, skipped = self._pending[-1], self._pending[:-1]
        self._pending.clear()
        if skipped:
            self._log(f"previews of step(s) {', '.join(str(e['step']) for e in skipped)} skipped: training "
                      f"reached step {newest['step']} first")
        self._render(int(newest["step"]), str(newest["path"]))

    def finish(self) -> None:
        """After a finished run: render the final LoRA (if not yet), close the TensorBoard writer."""
        try:
            self.render_pending()
        finally:
            if self._board is not None:
                try:
                    self._board.close()
                except Exception:  # noqa: BLE001 - an optional viewer's file
                    logging.exception("[PipeTrainer] closing the previews' TensorBoard writer failed")

    def _render(self, step: int, lora_path: str) -> None:
        self._show(f"rendering previews of step {step}")
        folder = self.run_dir / PREVIEWS_DIR
        try:
            images, files = self._images(step, lora_path, folder)
            self.latest, self.latest_step, self.latest_files = images, step, files
            self.status = f"previews: step {step} ({len(files)} image{'s' if len(files) != 1 else ''} in {folder})"
            EventWriter(self.run_dir, source="node").emit("preview", step=step, files=[str(f) for f in files])
            self._to_tensorboard(step, images)
        except comfy.model_management.InterruptProcessingException:
            raise
        except Exception as exc:  # noqa: BLE001 - a preview never ends a run
            self._report(step, exc, f"preview of step {step} failed")
            return
        finally:  # the training ranks may share the GPU: give ComfyUI's memory back
            comfy.model_management.unload_all_models()
            comfy.model_management.soft_empty_cache()
        self._on_shown()

    def _images(self, step: int, lora_path: str, folder: Path) -> tuple[list[Image.Image], list[Path]]:
        images, files = [], []
        with self._weights(), torch.inference_mode():  # inference mode: as ComfyUI runs every node
            model = with_lora(self.model, lora_path)
            for index, positive in enumerate(self._conds):
                comfy.model_management.throw_exception_if_processing_interrupted()
                frames = render(model, positive, self._negative, self.settings)
                files.append(save_preview(frames, folder, step, index))
                images.append(to_pil(frames[0]))
        return images, files

    # ---- reporting --------------------------------------------------------------------------------
    def _report(self, step: int | None, exc: BaseException, what: str) -> None:
        message = f"{what} ({type(exc).__name__}: {exc}); training goes on"
        trace = traceback.format_exc()
        self.status = f"warning: {message}; see {self.run_dir / 'logs' / 'previews.log'}"
        self.failures.append({"step": step, "message": message})
        logging.warning("[PipeTrainer] %s\n%s", message, trace)
        try:
            EventWriter(self.run_dir, source="node").emit("preview_failed", step=step, message=message, traceback=trace)
        except OSError:  # the console has it; a full disk must not end the run either
            logging.exception("[PipeTrainer] could not write the preview failure into %s", self.run_dir)
        self._log(f"{message}\n{trace}")
        self._show(self.status)

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
