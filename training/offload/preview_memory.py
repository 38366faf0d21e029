"""What a preview needs on ComfyUI's GPU next to what the memory plan leaves free there (pure arithmetic).

Previews render in the ComfyUI process, on ComfyUI's own device (docs/previews.md). When a rank trains
on that GPU too, a preview has what the rank's plan leaves free: the GPU's available memory minus the
stage's estimated peak (training/offload/memory_plan.py). The Train node reads the facts from ComfyUI's
MODEL and VAE (nodes/checks/memory.py); here they become a verdict and a line for the node and the run log.

A preview's need, as ComfyUI's own loader decides it (comfy/sampler_helpers.py ``prepare_sampling``,
comfy/model_management.py ``load_models_gpu``), in bytes::

    loaded whole = max(weights + sampling, decode)
        weights  = the MODEL as ComfyUI keeps it on the GPU (ModelPatcher.model_size(): each weight in
                   the dtype ComfyUI loaded it in, fp8 stays fp8) + the step's LoRA file
        sampling = max(minimum_inference_memory, memory_required(latent at the sampled batch) +
                   extra_reserved_memory): the model's own ``memory_usage_factor`` formula over the
                   preview's latent, the batch 2 (cond and uncond together) when cfg != 1, else 1
        decode   = the VAE's weights + its own VAEDecode estimate (``memory_used_decode``) for that latent
                   (ComfyUI unloads the model for it when it must)
    in part (lowvram) = largest layer + max(minimum_inference_memory, memory_required(batch 1) + reserve)
        ComfyUI's floor: with less free memory than the weights plus the one-batch estimate it keeps only
        what fits on the GPU and casts every other layer to the compute dtype as it runs, so at least
        the largest layer (weight and bias, in the compute dtype) must fit beside the activations. Slower,
        and a VAE decode that runs out falls back to tiles.

Not counted: text-conditioning shapes some models add to ``memory_required`` (reference latents of edit
models), and ComfyUI's CUDA context, which already exists (the free memory read has it taken out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .memory_plan import gib

FITS, IN_PART, SHORT, UNKNOWN = "fits", "in part", "short", "unknown"


@dataclass(frozen=True)
class PreviewNeed:
    """A preview's GPU memory in bytes, by part (module docstring)."""

    weights: int
    sampling: int
    decode: int
    lowvram_weights: int
    lowvram_sampling: int
    size: str = ""  # e.g. "1024x1024" or "832x480x81": what the sampling figure is for

    @property
    def whole(self) -> int:
        return max(self.weights + self.sampling, self.decode)

    @property
    def minimum(self) -> int:
        return min(self.whole, self.lowvram_weights + self.lowvram_sampling)


@dataclass(frozen=True)
class PreviewFit:
    """A preview on ComfyUI's GPU: what it needs, what is left there beside training, and the advice.

    ``rank``/``stage``: the rank training on that GPU (None: no rank uses it); ``left``: the GPU's available
    memory minus that stage's planned peak (None: the free memory was not read)."""

    gpu_label: str
    need: PreviewNeed
    left: int | None
    rank: int | None = None
    stage: int | None = None
    swap: int = 0
    advice: str = ""

    @property
    def verdict(self) -> str:
        if self.left is None:
            return UNKNOWN
        if self.left >= self.need.whole:
            return FITS
        return IN_PART if self.left >= self.need.minimum else SHORT

    def text(self) -> str:
        need = self.need
        where = (f"where rank {self.rank} (stage {self.stage}) trains" if self.rank is not None
                 else "which no rank uses")
        head = (f"Previews render on {self.gpu_label}, ComfyUI's device, {where}: a {need.size} preview needs "
                f"{gib(need.whole)} loaded whole (model {gib(need.weights)} + sampling {gib(need.sampling)}"
                f"{f', VAE decode {gib(need.decode)}' if need.decode > need.weights + need.sampling else ''}), "
                f"at least {gib(need.minimum)} loaded in part (lowvram)")
        if self.left is None:
            return f"{head}; its free memory was not read (install pynvml to see it)."
        if self.rank is not None:
            head += (f"; the memory plan (blocks_to_swap {self.swap}) leaves {gib(max(0, self.left))} free there "
                     "beside training")
        else:
            head += f"; {gib(max(0, self.left))} free there"
        verdict = self.verdict
        if verdict == FITS:
            return f"{head}: it fits."
        if verdict == IN_PART:
            tail = ("ComfyUI will load the model in part (lowvram): previews render slower"
                    + (", and a rank at its peak may run out of memory while one renders" if self.rank is not None
                       else ""))
        else:
            tail = ("less than a preview needs even loaded in part: previews will run out of memory (reported, "
                    "training goes on)" + (" and may push the rank out of memory" if self.rank is not None else ""))
        return f"{head}: {tail}." + (f" {self.advice}" if self.advice else "")


def gpu_advice(comfy_gpu: int, rank_gpus: Sequence[int], visible: Sequence[int]) -> str:
    """What to change so previews do not share a training GPU: ``gpus`` that leave out ComfyUI's device
    (when enough GPUs are visible), ``--default-device`` to choose which GPU renders, never ``--cuda-device``."""
    ranks = len(rank_gpus)
    others = [g for g in visible if g != comfy_gpu]
    not_cuda_device = ("(--cuda-device is not the fix: it hides every other GPU from ComfyUI, and so from the "
                       "ranks)")
    smaller = "a smaller preview (width, height, frames), more blocks_to_swap, or no previews"
    if comfy_gpu not in rank_gpus:
        return f"To make it fit, use {smaller}."
    if len(others) >= ranks:
        listed = ",".join(str(g) for g in others[:ranks])
        return (f"To keep previews off the training GPUs, set gpus to '{listed}' (it leaves out GPU {comfy_gpu}, "
                "ComfyUI's device, where previews render); to render them on a GPU of your choice, start ComfyUI "
                "with --default-device N (that GPU becomes ComfyUI's GPU 0, the others stay visible) and leave "
                f"0 out of gpus {not_cuda_device}. Or use {smaller}.")
    if len(visible) <= 1:
        return f"ComfyUI sees one GPU, so previews share it with training: to make them fit, use {smaller}."
    return (f"Every GPU ComfyUI sees trains ({ranks} ranks on {len(visible)} GPUs): with fewer pipeline_stages or "
            f"data_parallel, gpus can leave out GPU {comfy_gpu} (ComfyUI's device, where previews render) "
            f"{not_cuda_device}; or use {smaller}.")
