"""``Train LoRA``: validate everything, start the training process tree, follow it, load the result."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import comfy.model_management
import comfy.sd
import comfy.utils
import folder_paths
from comfy_api.latest import io, ui
from safetensors.torch import load_file

from ..training.adapters.problems import adapter_target_problems
from ..training.pipelines.base import UnknownFamilyError, family_name_for
from ..training.spec.choices import PARTITION_METHODS, TRAIN_DTYPES, SpecError
from ..training.spec.options import BLOCKS_TO_SWAP_AUTO, RegularizationSpec, TimestepSpec, TrainSpec, ValidationSpec
from ..training.spec.run_spec import RunSpec
from .advanced import advanced
from .checks import graph_patches, memory, preflight
from .checks.launch import launch_settings, resolve_gpus
from .checks.stacked_loras import write_stacked_loras
from .checks.training_adapter import training_adapter_problems, with_training_adapter
from .family_options import FamilyOptionsConfig, run_family_options
from .gpus_memory import GpusMemoryConfig
from .model_source import no_recipe_message, recipe_of
from .presets import NO_PRESET, apply_preset, preset_choices
from .preview_settings import PreviewConfig, preview_save_every
from .regularization import RegularizationConfig
from .run import checkpoints, paths, run_messages, run_process
from .run.held_weights import HeldWeights
from .run.loss_plot import as_image_tensor, loss_curve
from .run.preview_sheet import progress_sheet
from .run.previews import PreviewRunner
from .run.progress_text import show_text
from .run.warm_pool import WarmPool
from .types import CATEGORY, Cache, LoraConfig, LoraModel, LossMap, OptimizerConfig, TimestepConfig, ValidationConfig
from .validation import hold_out_note

PREVIEW_EVERY_S = 2.0
# This ComfyUI process's pre-started training tree for the next run (state, not configuration).
WARM_POOL = WarmPool()


class DoneText(ui.PreviewText):
    """What the node shows at the end: its text, and the final previews' images when previews ran."""

    def __init__(self, value: str, images: list | None = None):
        super().__init__(value)
        self.images = images or []

    def as_dict(self) -> dict:
        out = super().as_dict()
        if self.images:
            out["images"] = self.images
        return out


class PipeTrainerTrain(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerTrain",
            display_name="Train LoRA (PipeTrainer)",
            category=CATEGORY,
            is_output_node=True,
            description="Trains a LoRA in a separate process (DeepSpeed pipeline) and returns the model with it applied.",
            inputs=[
                io.Model.Input("model", tooltip="From 'Load Diffusion Model (PipeTrainer)' (LoRAs stacked on it are merged first)."),
                Cache.Input("cache", tooltip="From 'Cache Latents & Text'."),
                LoraConfig.Input("lora", tooltip="From 'LoRA Adapter'."),
                OptimizerConfig.Input("optimizer", tooltip="From 'Optimizer'."),
                io.String.Input("lora_name", default="my_lora",
                                tooltip="File name for models/loras/<name>.safetensors (no folders)."),
                io.Int.Input("steps", default=500, min=1, max=1_000_000, tooltip="Optimizer steps to train."),
                io.Int.Input("batch_size", default=1, min=1, max=256, tooltip="Examples per micro-batch."),
                io.Int.Input("gradient_accumulation", default=1, min=1, max=1024,
                             tooltip="Micro-batches per optimizer step (also the pipeline's micro-batches).", **advanced()),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=False,
                             tooltip="Seed for LoRA init, data order, noise and timesteps: same seed, same run. "
                                     "It stays as set after each queue (a new seed is a new run: resume "
                                     "continues only the same settings)."),
                io.Int.Input("save_every", default=0, min=0, max=1_000_000,
                             tooltip="Also save a LoRA and a checkpoint every N steps into the run dir (0: only at the end)."),
                io.Combo.Input("training_dtype", options=list(TRAIN_DTYPES), default=TrainSpec().dtype,
                               tooltip="Compute dtype of the frozen base (fp8 weights are cast to it); the LoRA "
                                       "trains in fp32. It wins over ComfyUI's precision flags; the run log names"
                                       " each flag set aside."),
                io.Boolean.Input("gradient_checkpointing", default=True,
                                 tooltip="Recompute activations in backward: much less memory, ~30% slower.", **advanced()),
                io.Int.Input("pipeline_stages", default=1, min=1, max=64,
                             tooltip="Split the model over this many GPUs (pipeline parallel); 1 = one device."),
                io.Int.Input("data_parallel", default=1, min=1, max=64, optional=True,
                             tooltip="Copies of the whole pipeline that split each batch (data parallel); "
                                     "ranks = pipeline_stages x data_parallel.", **advanced()),
                io.String.Input("gpus", default="", optional=True,
                                tooltip="One GPU per rank in rank order, e.g. '0,1' (ComfyUI's numbering, after "
                                        "--cuda-device). Empty: ComfyUI's first GPUs. Leave empty on the CPU.", **advanced()),
                io.Int.Input("checkpoint_interval", default=1, min=1, max=64, optional=True,
                             tooltip="With gradient checkpointing: layers per recomputed chunk (more = fewer "
                                     "recompute boundaries, more memory).", **advanced()),
                io.Int.Input("blocks_to_swap", default=0, min=BLOCKS_TO_SWAP_AUTO, max=1024, optional=True,
                             tooltip="Per stage: keep the last N blocks' frozen weights in CPU memory, each "
                                     "brought to the GPU while it runs (saves VRAM with checkpointing). 0 = off; "
                                     "-1 = auto: the fewest that fit."),
                io.Combo.Input("partition_method", options=list(PARTITION_METHODS), default="parameters",
                               tooltip="How layers are split into stages: balanced by parameter count, or equal layer counts.", **advanced()),
                TimestepConfig.Input("timesteps", optional=True,
                                     tooltip="From 'Timestep Sampling (PipeTrainer)'. Unconnected: uniform through the "
                                             "model's own sampling (its shift, or a ModelSampling* node's before this "
                                             "one): the noise levels its sampler visits."),
                ValidationConfig.Input("validation", optional=True,
                                       tooltip="From 'Validation Loss (PipeTrainer)': held-out images evaluated "
                                               "every N steps at fixed noise, plotted with the training loss."),
                RegularizationConfig.Input("regularization", optional=True,
                                           tooltip="From 'Regularization Images (PipeTrainer)': prior images "
                                                   "mixed in by micro-batch, their loss scaled by its weight."),
                io.Float.Input("guidance", default=1.0, min=0.0, max=100.0, step=0.1, optional=True,
                               tooltip="Guidance-distilled models (FLUX.1 dev): the guidance the model sees while"
                                       " training. 1.0, as the other trainers use: samples well at 3.5. Unused by"
                                       " other families.", **advanced()),
                io.Boolean.Input("resume", default=True,
                                 tooltip="Continue an earlier run: from the checkpoint chosen in resume_from (by "
                                         "default the newest of this LoRA with the same settings). Off: start fresh."),
                io.Combo.Input("resume_from", options=checkpoints.checkpoint_choices(paths.runs_root()),
                               default=checkpoints.NEWEST, optional=True,
                               tooltip="With resume on: 'newest' (the newest checkpoint of this LoRA with these "
                                       "settings) or a checkpoint (run / step; R reloads). A changed model, rank "
                                       "or optimizer is refused."),
                io.Boolean.Input("first_frame_clean", default=False, optional=True,
                                 tooltip="Image-to-video as ComfyUI samples it: the first latent frame stays "
                                         "clean and out of the loss (Wan 2.2 TI2V, LTX-Video, Kandinsky 5, Cosmos"
                                         " Video2World). Off: text-to-video.", **advanced()),
                io.Combo.Input("expert", options=["none", "high_noise", "low_noise"], default="none", optional=True,
                               tooltip="Wan 2.2 A14B: which expert this file is; training draws only its noise "
                                       "levels (high_noise: sigma at or above the boundary). Recorded in the LoRA"
                                       " file.", **advanced()),
                io.Float.Input("expert_boundary", default=0.0, min=0.0, max=0.999, step=0.005, optional=True,
                               tooltip="Wan 2.2 A14B expert boundary sigma; 0 = the Wan 2.2 default (0.875 "
                                       "text-to-video, 0.9 image-to-video).", **advanced()),
                io.Float.Input("frame_rate", default=25.0, min=0.01, max=1000.0, step=0.001, optional=True,
                               tooltip="LTX-Video: the clips' frames per second, the frame_rate its "
                                       "LTXVConditioning node gets at sampling (it sets the model's time "
                                       "positions). Other families do not use it.", **advanced()),
                PreviewConfig.Input("previews", optional=True,
                                    tooltip="From 'Preview Settings (PipeTrainer)': every N steps, that step's LoRA "
                                            "rendered by ComfyUI's own LoRA loader and sampler, shown here as it "
                                            "arrives and saved in the run folder (previews/)."),
                FamilyOptionsConfig.Input("family_options", optional=True,
                                          tooltip="From 'Family Options (PipeTrainer)': guidance, image-to-video, "
                                                  "Wan 2.2 expert or frame rate of the model's family; its values "
                                                  "replace this node's of the same names."),
                GpusMemoryConfig.Input("gpus_and_memory", optional=True,
                                       tooltip="From 'GPUs & Memory (PipeTrainer)': stages, GPUs, block swap and "
                                               "checkpointing; its values replace this node's of the same names."),
                io.Combo.Input("preset", options=preset_choices(), default=NO_PRESET, optional=True,
                               tooltip="Settings another trainer's example config sets for this model and GPU size"
                                       " (rank, optimizer, rate, batch, dtype); each value it changes is shown here "
                                       "before step 0."),
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
    def validate_inputs(cls, lora_name: str | None = None) -> bool | str:
        """Only ``lora_name``: ComfyUI attaches the message to each input named here (so it lands on that
        widget) and still range-checks every other input itself. A linked lora_name has no value yet
        (None): execute checks it."""
        if lora_name is None:
            return True
        if not isinstance(lora_name, str):
            return "lora_name must be text."
        problems = paths.lora_name_problems(lora_name)
        return "\n".join(problems) if problems else True

    @classmethod
    def build_spec(cls, model, cache, lora, optimizer, lora_name: str, notes: list[str] | None = None,
                   **settings) -> RunSpec:
        """The validated run spec; raises with every problem at once. ``blocks_to_swap`` auto (-1) becomes
        the memory plan's number (nodes/checks/memory.py); the plan's line is appended to ``notes``."""
        family_node = settings.pop("family_options", None)
        preset = settings.pop("preset", NO_PRESET)
        devices = settings.pop("gpus_and_memory", None)
        if devices is not None:  # the GPUs & Memory node's values are the run's; Train's own are named if set aside
            settings, overridden = devices.merged(settings)
            if notes is not None:
                notes += overridden
        problems = paths.lora_name_problems(lora_name)
        recipe = recipe_of(model)
        if recipe is None:
            problems.append(no_recipe_message(model))
        family_options: dict = {}
        try:
            family = family_name_for(model.model)
        except UnknownFamilyError as exc:
            problems.append(str(exc))
        else:
            family_options, option_problems, overridden = run_family_options(family, settings, family_node)
            problems += option_problems
            if notes is not None:
                notes += overridden
            problems += training_adapter_problems(model, family, recipe)
            applied = apply_preset(preset, family, model, lora, optimizer, settings)
            lora, optimizer, settings = applied.lora, applied.optimizer, applied.settings
            problems += applied.problems
            if notes is not None:
                notes += applied.notes
        problems += graph_patches.patch_problems(model)
        sampling, sampling_problems = graph_patches.sampling_override(model)
        problems += sampling_problems
        if recipe is not None:
            recipe = dataclasses.replace(recipe, sampling=sampling)
        train = TrainSpec(
            steps=settings["steps"], batch_size=settings["batch_size"], grad_accum=settings["gradient_accumulation"],
            seed=settings["seed"], timesteps=settings.get("timesteps") or TimestepSpec(), save_every=settings["save_every"],
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
        gpus_text = settings.get("gpus") or ""  # GPU count and indices are checked in preflight
        problems += preflight.train_problems(model, cache, lora, train, paths.runs_root(), gpus=gpus_text,
                                             family_options=family_options)
        problems += adapter_target_problems(model.model, lora)  # lokr/loha on quantized layers
        items, validation = cache.items, ValidationSpec()
        if settings.get("validation") is not None:
            try:
                items, validation = settings["validation"].split(cache.items)
            except SpecError as exc:
                problems += exc.problems
            else:
                if settings["validation"].cache is not None:
                    problems += preflight.validation_cache_problems(model, validation.items)
                if notes is not None:  # the hold-out is shown on the node before step 0
                    notes.append(hold_out_note(validation, settings["validation"].cache is not None))
        regularization = RegularizationSpec()
        if settings.get("regularization") is not None:
            try:
                regularization = settings["regularization"].spec()
            except SpecError as exc:
                problems += exc.problems
            else:
                problems += preflight.regularization_cache_problems(model, settings["regularization"].cache)
        if not problems:  # the plan reads what preflight accepted: the cache's shapes, the ranks' GPUs
            swap, note, swap_problems = memory.resolve_auto(model, cache, lora, optimizer, train, device, gpus_text)
            problems += swap_problems
            train = dataclasses.replace(train, blocks_to_swap=swap)
            if note and notes is not None:
                notes.append(note)
        if problems:
            raise SpecError(problems)
        spec = RunSpec(
            model=recipe, items=items, lora=lora, optimizer=optimizer, train=train, validation=validation,
            regularization=regularization,
            run_dir="/pending", lora_output=paths.lora_output_path(lora_name),
            step_loras_dir=paths.step_loras_dir(lora_name),
            comfyui_path=os.path.dirname(os.path.abspath(folder_paths.__file__)), device=device,
            parent_pid=os.getpid(), family_options=family_options,
            launch=launch_settings(resolve_gpus(gpus_text, ranks, device)[0]),  # how ComfyUI was launched
        )
        spec.validated()
        return spec

    @classmethod
    def execute(cls, model, cache, lora, optimizer, lora_name: str, **settings) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        show_text(run_messages.CHECKING, node_id)  # replaces the previous run's text at once
        resume = settings.pop("resume")
        resume_choice = settings.pop("resume_from", None) or checkpoints.NEWEST
        previews = settings.pop("previews", None)
        if previews is not None:  # each preview step needs its LoRA file
            settings["save_every"] = preview_save_every(settings["save_every"], previews.every_n_steps)
        notes: list[str] = []  # the memory plan of blocks_to_swap auto, then what the run starts over or replaces
        try:
            spec = cls.build_spec(model, cache, lora, optimizer, lora_name, notes=notes, **settings)
        except SpecError as exc:
            show_text(f"not started: {len(exc.problems)} problem(s), see the error", node_id)
            raise
        notes += memory.preview_notes(model, cache, spec, previews)  # a preview's need beside the plan (GPU)
        run_dir = paths.new_run_dir(lora_name)
        recipe = with_training_adapter(model, write_stacked_loras(model, spec.model, run_dir), run_dir)
        spec = dataclasses.replace(spec, model=recipe, run_dir=run_dir)
        try:
            resume_from = checkpoints.resume_source(resume, resume_choice, lora_name, spec, paths.runs_root())
            spec = dataclasses.replace(spec, resume_from=resume_from).validated()
            warning = checkpoints.resume_warning(spec)  # a checkpoint of other weights is refused here
        except SpecError:
            show_text("not started: the checkpoint cannot be continued, see the error", node_id)
            shutil.rmtree(run_dir, ignore_errors=True)  # only what this call just wrote
            raise
        if warning:
            show_text(f"warning: {warning}", node_id)
        # said before step 0, in the run log and when done: a resume that starts over, a LoRA file it replaces
        notes += [note for note in (
            checkpoints.resume_miss_note(lora_name, spec, paths.runs_root()) if resume and not resume_from else "",
            paths.keep_earlier_lora(spec.lora_output, spec.step_loras_dir)) if note]
        view = run_messages.RunView(spec.train.steps)
        view.add_history(checkpoints.earlier_history(spec.resume_from))  # the loss curve shows the whole run
        bar = comfy.utils.ProgressBar(spec.train.steps)

        def sheet() -> tuple:
            curve = loss_curve(view.losses, view.steps, validation=view.validation_points)
            return "PNG", progress_sheet(curve, runner.latest, runner.latest_step), 640

        progress = ["\n".join([*notes, run_messages.LAUNCHING])]  # the run's own text: step, loss, ETA

        def show_progress(text: str | None = None) -> None:
            """The run's text, with the previews' status lines under it (one rendering keeps the step)."""
            if text is not None:
                progress[0] = text
            show_text("\n".join(t for t in (progress[0], runner.status) if t), node_id)

        held = HeldWeights(model, spec.model.path, spec.model.fingerprint)
        runner = PreviewRunner(previews, model, run_dir, show=lambda status: show_progress(),
                               on_shown=lambda: bar.update_absolute(view.steps[-1] if view.steps else 0,
                                                                    spec.train.steps, sheet()),
                               weights=held.lent)
        runner.prepare()  # encodes the prompts while ComfyUI's models are still loaded
        comfy.model_management.unload_all_models()
        comfy.model_management.soft_empty_cache()

        last_preview = [0.0]

        def on_event(event: dict) -> None:
            text = view.on_event(event)
            runner.on_event(event)
            if event.get("type") == "phase" and event.get("phase") == "first_step":
                bar.update_absolute(view.resumed_from, spec.train.steps)
            elif event.get("type") == "step":
                preview = None
                now = time.monotonic()
                if now - last_preview[0] >= PREVIEW_EVERY_S or event["step"] == event["total"]:
                    preview = sheet()
                    last_preview[0] = now
                bar.update_absolute(event["step"], event["total"], preview)
            if text and event.get("type") == "phase":  # the memory plan stays in sight until step 0
                text = "\n".join([*notes, text])
            if text:
                show_progress(text)

        show_progress()
        held.release()  # ComfyUI's own copy of the model is idle while the ranks train
        try:
            handle = run_process.launch(spec, WARM_POOL, notes=[*notes, *held.notes()])
            runner.start()  # previews render in their own thread: progress goes on while one renders
            try:
                code = run_process.follow(handle, on_event, comfy.model_management.processing_interrupted,
                                          on_idle=runner.poll, on_stop=lambda text: show_text(text, node_id))
            except comfy.model_management.InterruptProcessingException:
                show_text(run_messages.stopped_text(handle.events, resume), node_id)  # shown on the cancelled node
                raise
            finally:  # the next run's processes do their imports now, while this result is looked at
                WARM_POOL.refill(run_process.warm_key(spec), os.path.join(paths.runs_root(), ".warm"))
            if code != run_process.EXIT_OK:  # a render under way is given up; Cancel's flag is the user's again
                runner.close()
            if code == run_process.EXIT_STOPPED or comfy.model_management.processing_interrupted():
                stopped = run_messages.stopped_text(handle.events, resume)
                show_text(stopped, node_id)
                comfy.model_management.throw_exception_if_processing_interrupted()
                raise run_process.TrainingFailed(f"Training {stopped} (run folder {spec.run_dir}).")
            if code != run_process.EXIT_OK or not os.path.exists(spec.lora_output):
                show_text(f"failed: see the error (run folder {spec.run_dir})", node_id)
                raise run_process.TrainingFailed(run_process.failure_message(handle))

            runner.finish()  # the final LoRA's previews; a failed one is reported, never raised
            held.restore()  # the samplers after this node use the MODEL: its weights come back now
        finally:  # a cancelled or failed run gives the graph its model back too (after the preview worker)
            runner.close()
            reload_problem = held.restore_or_report()
            if reload_problem:
                show_text(f"warning: {reload_problem}", node_id)
        lora_sd = load_file(spec.lora_output)
        trained, _ = comfy.sd.load_lora_for_models(model, None, lora_sd, 1.0, 0)
        curve = as_image_tensor(loss_curve(view.losses, view.steps, validation=view.validation_points))
        name = os.path.basename(spec.lora_output)
        done = run_messages.done_text(spec.lora_output, spec.run_dir, view)
        if warning:
            done += f"\nwarning: {warning}"
        done += "".join(f"\n{note}" for note in notes)
        done += "".join(f"\n{line}" for line in runner.summary())  # the last previews, the skipped ones
        show_text(done, node_id)
        return io.NodeOutput(trained, name, lora_sd, {"loss": view.losses}, curve,
                             ui=DoneText(done, runner.ui_images()))
