"""``Train LoRA``: validate everything, start the training process tree, follow it, load the result."""

from __future__ import annotations

import dataclasses
import os
import time

import comfy.model_management
import comfy.sd
import comfy.utils
import folder_paths
from comfy_api.latest import io
from safetensors.torch import load_file

from ..training.events import read_all
from ..training.pipelines.base import UnknownFamilyError, family_name_for
from ..training.spec import PARTITION_METHODS, TIMESTEP_SAMPLING, TRAIN_DTYPES, RunSpec, SpecError, TrainSpec
from . import paths, preflight, run_process
from .loss_plot import as_image_tensor, loss_curve
from .model_source import recipe_of
from .stacked_loras import write_stacked_loras
from .types import CATEGORY, Cache, LoraConfig, LoraModel, LossMap, OptimizerConfig

PREVIEW_EVERY_S = 2.0


def _progress_text(event: dict) -> str:
    eta = event.get("eta_s")
    eta_txt = f"{eta:.0f} s" if isinstance(eta, (int, float)) else "?"
    return (f"step {event['step']}/{event['total']}  loss {event['loss']:.4f}  "
            f"{event.get('it_s', 0):.2f} it/s  ETA {eta_txt}")


def _find_resume_checkpoint(name: str, training_hash: str) -> str:
    """The newest checkpoint of an earlier run of this LoRA with the same training settings."""
    root = paths.runs_root()
    if not os.path.isdir(root):
        return ""
    stem = paths.lora_stem(name)
    candidates = sorted((d for d in os.listdir(root) if d.startswith(stem + "-")), reverse=True)
    for d in candidates:
        run_dir = os.path.join(root, d)
        try:
            earlier = RunSpec.load(os.path.join(run_dir, "spec.json"))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if earlier.training_hash() != training_hash:
            continue
        saved = [e for e in read_all(run_dir) if e.get("type") == "saved"]
        for event in reversed(saved):
            if os.path.isdir(event["checkpoint"]):
                return event["checkpoint"]
    return ""


class PipeTrainerTrain(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerTrain",
            display_name="Train LoRA",
            category=CATEGORY,
            is_output_node=True,
            description="Trains a LoRA in a separate process (DeepSpeed pipeline) and returns the model with it applied.",
            inputs=[
                io.Model.Input("model", tooltip="From 'Load Diffusion Model (train)' (LoRAs stacked on it are merged first)."),
                Cache.Input("cache", tooltip="From 'Cache Latents & Text'."),
                LoraConfig.Input("lora", tooltip="From 'LoRA Adapter'."),
                OptimizerConfig.Input("optimizer", tooltip="From 'Optimizer'."),
                io.String.Input("lora_name", default="my_lora",
                                tooltip="File name for models/loras/<name>.safetensors (no folders)."),
                io.Int.Input("steps", default=500, min=1, max=1_000_000, tooltip="Optimizer steps to train."),
                io.Int.Input("batch_size", default=1, min=1, max=256, tooltip="Examples per micro-batch."),
                io.Int.Input("gradient_accumulation", default=1, min=1, max=1024,
                             tooltip="Micro-batches per optimizer step (also the pipeline's micro-batches)."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=True,
                             tooltip="Seed for LoRA init, data order, noise and timesteps: same seed, same run."),
                io.Combo.Input("timestep_sampling", options=list(TIMESTEP_SAMPLING), default="shift",
                               tooltip="uniform; logit_normal (mid timesteps favoured); shift (the model's own "
                                       "sampling shift, as used at inference)."),
                io.Int.Input("save_every", default=0, min=0, max=1_000_000,
                             tooltip="Also save a LoRA and a checkpoint every N steps into the run dir (0: only at the end)."),
                io.Combo.Input("training_dtype", options=list(TRAIN_DTYPES), default="bf16",
                               tooltip="Compute dtype of the frozen base model; the LoRA always trains in fp32."),
                io.Boolean.Input("gradient_checkpointing", default=True,
                                 tooltip="Recompute activations in backward: much less memory, ~30% slower."),
                io.Int.Input("pipeline_stages", default=1, min=1, max=64,
                             tooltip="Split the model over this many GPUs (pipeline parallel); 1 = one device."),
                io.Int.Input("data_parallel", default=1, min=1, max=64, optional=True,
                             tooltip="Copies of the whole pipeline that split each batch (data parallel); "
                                     "ranks = pipeline_stages x data_parallel."),
                io.Int.Input("checkpoint_interval", default=1, min=1, max=64, optional=True,
                             tooltip="With gradient checkpointing: layers per recomputed chunk (more = fewer "
                                     "recompute boundaries, more memory)."),
                io.Int.Input("blocks_to_swap", default=0, min=0, max=1024, optional=True,
                             tooltip="Per pipeline stage: keep the frozen weights of the last N transformer blocks "
                                     "in CPU memory and bring each block to the GPU only while it runs (LoRA "
                                     "stays on the GPU). With gradient checkpointing it saves VRAM; costs speed, same results. 0 = off. "
                                     "On CPU it is accepted and changes nothing."),
                io.Combo.Input("partition_method", options=list(PARTITION_METHODS), default="parameters",
                               tooltip="How layers are split into stages: balanced by parameter count, or equal layer counts."),
                io.Boolean.Input("resume", default=True,
                                 tooltip="Continue from the newest checkpoint of an earlier run of this LoRA with the same settings."),
            ],
            outputs=[
                io.Model.Output(display_name="model", tooltip="The input model with the trained LoRA applied."),
                io.String.Output(display_name="lora_name", tooltip="The LoRA file name in models/loras."),
                LoraModel.Output(display_name="lora", tooltip="The LoRA weights, for the stock 'Load LoRA Model'."),
                LossMap.Output(display_name="loss_map", tooltip="Loss per step, for the stock 'Plot Loss Graph'."),
                io.Image.Output(display_name="loss_curve", tooltip="The loss curve as an image."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, lora_name: str = "", **_) -> bool | str:
        problems = paths.lora_name_problems(lora_name) if isinstance(lora_name, str) else []
        return "\n".join(problems) if problems else True

    @classmethod
    def build_spec(cls, model, cache, lora, optimizer, lora_name: str, **settings) -> RunSpec:
        """The validated run spec; raises with every problem at once."""
        problems = paths.lora_name_problems(lora_name)
        recipe = recipe_of(model)
        if recipe is None:
            problems.append("The MODEL was not loaded by 'Load Diffusion Model (train)': use that node so the "
                            "training process can load the same weights.")
        try:
            family_name_for(model.model)
        except UnknownFamilyError as exc:
            problems.append(str(exc))
        train = TrainSpec(
            steps=settings["steps"], batch_size=settings["batch_size"], grad_accum=settings["gradient_accumulation"],
            seed=settings["seed"], timestep_sampling=settings["timestep_sampling"], save_every=settings["save_every"],
            dtype=settings["training_dtype"], gradient_checkpointing=settings["gradient_checkpointing"],
            pipeline_stages=settings["pipeline_stages"], partition_method=settings["partition_method"],
            data_parallel=settings.get("data_parallel", 1), checkpoint_interval=settings.get("checkpoint_interval", 1),
            blocks_to_swap=settings.get("blocks_to_swap", 0),
        )
        device = "cuda" if comfy.model_management.get_torch_device().type == "cuda" else "cpu"
        ranks = train.pipeline_stages * train.data_parallel
        # CPU ranks are processes: two per core still trains (4 ranks on 2 cores is tested); more only thrashes.
        if device == "cpu" and ranks > 2 * (os.cpu_count() or 1):
            problems.append(f"pipeline_stages x data_parallel = {ranks} ranks is more than this machine can run on "
                            "CPU. Lower them, or export the run (run dir 'cluster/') to a bigger machine.")
        if device == "cuda":
            import torch

            if ranks > torch.cuda.device_count():
                problems.append(f"pipeline_stages x data_parallel = {ranks} ranks needs that many GPUs; "
                                f"{torch.cuda.device_count()} visible. Lower pipeline_stages or data_parallel.")
        problems += preflight.train_problems(model, cache, lora, train, paths.runs_root())
        if problems:
            raise SpecError(problems)
        spec = RunSpec(
            model=recipe, items=cache.items, lora=lora, optimizer=optimizer, train=train,
            run_dir="/pending", lora_output=paths.lora_output_path(lora_name),
            comfyui_path=os.path.dirname(os.path.abspath(folder_paths.__file__)), device=device,
            parent_pid=os.getpid(),
        )
        spec.validated()
        return spec

    @classmethod
    def execute(cls, model, cache, lora, optimizer, lora_name: str, **settings) -> io.NodeOutput:
        resume = settings.pop("resume")
        spec = cls.build_spec(model, cache, lora, optimizer, lora_name, **settings)
        run_dir = paths.new_run_dir(lora_name)
        spec = dataclasses.replace(spec, model=write_stacked_loras(model, spec.model, run_dir), run_dir=run_dir)
        resume_from = _find_resume_checkpoint(lora_name, spec.training_hash()) if resume else ""
        spec = dataclasses.replace(spec, resume_from=resume_from).validated()
        comfy.model_management.unload_all_models()
        comfy.model_management.soft_empty_cache()

        losses: list[float] = []
        bar = comfy.utils.ProgressBar(spec.train.steps)
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        last_preview = [0.0]

        def on_event(event: dict) -> None:
            if event.get("type") != "step":
                return
            losses.append(float(event["loss"]))
            preview = None
            now = time.monotonic()
            if now - last_preview[0] >= PREVIEW_EVERY_S or event["step"] == event["total"]:
                preview = ("PNG", loss_curve(losses), 640)
                last_preview[0] = now
            bar.update_absolute(event["step"], event["total"], preview)
            _send_text(_progress_text(event), node_id)

        handle = run_process.launch(spec)
        code = run_process.follow(handle, on_event, comfy.model_management.processing_interrupted)
        if code == run_process.EXIT_STOPPED or comfy.model_management.processing_interrupted():
            comfy.model_management.throw_exception_if_processing_interrupted()
            raise run_process.TrainingFailed(
                f"Training stopped before the last step (run dir {spec.run_dir}); the checkpoint there resumes it.")
        if code != run_process.EXIT_OK or not os.path.exists(spec.lora_output):
            raise run_process.TrainingFailed(run_process.failure_message(handle))

        lora_sd = load_file(spec.lora_output)
        trained, _ = comfy.sd.load_lora_for_models(model, None, lora_sd, 1.0, 0)
        curve = as_image_tensor(loss_curve(losses))
        name = os.path.basename(spec.lora_output)
        return io.NodeOutput(trained, name, lora_sd, {"loss": losses}, curve)


def _send_text(text: str, node_id: str | None) -> None:
    if node_id is None:
        return
    try:
        from server import PromptServer

        PromptServer.instance.send_progress_text(text, node_id)
    except (ImportError, AttributeError):  # not running inside the ComfyUI server
        pass
