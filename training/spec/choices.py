"""The run spec's vocabulary: the choices each option takes, and the error that lists every problem.

Pure Python (no torch): the node layer builds its widgets from these tuples, and the spec checks against
them, so a choice is named in one place."""

from __future__ import annotations

WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")  # the stock loader's choices


TRAIN_DTYPES = ("fp32", "bf16")


# Choices that load and sample, but cannot train; each with the reason and what to pick instead.
UNTRAINABLE_WEIGHT_DTYPES = {
    "fp8_e4m3fn_fast": "ComfyUI's fast fp8 path multiplies with torch._scaled_mm, which has no backward. "
                       "Choose weight_dtype fp8_e4m3fn on the loader: the same fp8 weights and memory, "
                       "computed through a cast that trains",
}


UNTRAINABLE_TRAIN_DTYPES = {
    "fp16": "fp16 compute needs loss scaling to keep small gradients from underflowing, which PipeTrainer "
            "does not do. Choose bf16 (same memory, fp32's range)",
}


OPTIMIZERS = ("AdamW", "AdamW8bit", "Adafactor", "Prodigy", "Lion", "CAME", "AdamWScheduleFree")


SCHEDULE_FREE_OPTIMIZERS = ("AdamWScheduleFree",)  # they warm up themselves and take no schedule


STEP_SIZE_ESTIMATING_OPTIMIZERS = ("Prodigy",)  # learning rate 1.0, one rate for every parameter group


SCHEDULES = ("constant", "linear", "cosine", "cosine_with_restarts")


DECAYING_SCHEDULES = ("linear", "cosine", "cosine_with_restarts")


TIMESTEP_DISTRIBUTIONS = ("uniform", "logit_normal")


TIMESTEP_SHIFTS = ("model", "none", "fixed", "resolution")


LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")  # SD3's per-sigma loss weights (training/objective/loss_weighting.py)


TARGET_PRESETS = ("attention", "attention_mlp", "all_linear")


# Presets of families whose blocks update several token streams (LTX-2: video and audio), one stream each; a family
# lists the ones it has in ``stream_presets`` and preflight refuses them for every other family.
STREAM_TARGET_PRESETS = ("video", "audio")


ADAPTER_TYPES = ("lora", "lokr", "loha")  # training/adapters/kinds.py registers one entry for each


SAVE_DTYPES = ("bf16", "fp32")  # dtype of the saved adapter file (training keeps fp32 weights)


PARTITION_METHODS = ("parameters", "uniform")


class SpecError(ValueError):
    """Raised with every problem found in a spec, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("Invalid training setup:\n- " + "\n- ".join(self.problems))
