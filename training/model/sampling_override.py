"""Replay a ModelSampling* node's ``model_sampling`` patch in the training process.

ModelSamplingSD3, ModelSamplingAuraFlow and ModelSamplingFlux change the shift by an object patch on
the graph's MODEL. The training process rebuilds the model from its recipe, so that patch would be
lost and training would draw sigmas unlike the graph's sampler. The node layer records the patched
object (:func:`describe_sampling`), the training process rebuilds the same ComfyUI classes with the
same parameters (:func:`rebuild_sampling`) and proves it by comparing sigmas at fixed timesteps.
"""

from __future__ import annotations

import math

import torch

from ..spec.options import SamplingOverride

# Sampling classes whose full state is set_parameters(**these): the ones ComfyUI's ModelSampling*
# nodes for flow models build. Anything else is refused by name rather than replayed approximately.
_REPLAYABLE = {
    "ModelSamplingDiscreteFlow": ("shift", "multiplier"),
    "ModelSamplingFlux": ("shift",),
}
_PREDICTIONS = ("CONST", "EPS", "V_PREDICTION", "EDM", "X0", "IMG_TO_IMG")
_PROBE_FRACTIONS = (0.05, 0.25, 0.5, 0.75, 0.95)


class UnreplayableSampling(ValueError):
    pass


def sampling_probe(model_sampling) -> tuple[float, ...]:
    """Sigmas at fixed fractions of the timestep range: equal probes mean equal schedules."""
    from ..objective.timesteps import model_sigma

    return tuple(float(v) for v in model_sigma(model_sampling, torch.tensor(_PROBE_FRACTIONS)))


def _class_named(model_sampling, names) -> str | None:
    import comfy.model_sampling as cms

    for cls in type(model_sampling).__mro__:
        if cls.__name__ in names and getattr(cms, cls.__name__, None) is cls:
            return cls.__name__
    return None


def describe_sampling(model_sampling) -> SamplingOverride:
    """The recipe of a patched ``model_sampling`` object, or :class:`UnreplayableSampling` naming it."""
    base = _class_named(model_sampling, _REPLAYABLE)
    prediction = _class_named(model_sampling, _PREDICTIONS)
    if getattr(model_sampling, "audio_shift", None) is not None:
        # ModelSamplingAV (MiniMaxH3SigmaShift): the audio shift also rides in transformer_options, which the
        # training process does not rebuild; a flow replay would drop it and the audio carry with it
        raise UnreplayableSampling(
            "The MODEL's sampling was replaced by an audio-video shift node (ModelSamplingMiniMaxH3), which PipeTrainer "
            "cannot replay in training: MiniMax-H3 trains at its own shifts (video 12, audio 3). Put that node after "
            "the Train node's MODEL output to sample with other shifts.")
    if base is None or prediction is None:
        raise UnreplayableSampling(
            f"The MODEL's sampling was replaced by {type(model_sampling).__name__} "
            f"({', '.join(c.__name__ for c in type(model_sampling).__mro__[1:3])}), which PipeTrainer cannot "
            "replay in training. Remove that node before 'Train LoRA' (put it after the Train node's MODEL "
            "output to sample with it), or use ModelSamplingSD3 / ModelSamplingAuraFlow / ModelSamplingFlux.")
    parameters = tuple((name, float(getattr(model_sampling, name))) for name in _REPLAYABLE[base])
    return SamplingOverride(base, prediction, parameters, sampling_probe(model_sampling))


def rebuild_sampling(override: SamplingOverride, model_config):
    """A ``model_sampling`` object equal to the graph's patched one (checked against its probe)."""
    import comfy.model_sampling as cms

    base, prediction = getattr(cms, override.base), getattr(cms, override.prediction)
    replayed_class = type("ModelSamplingReplayed", (base, prediction), {})
    sampling = replayed_class(model_config)
    sampling.set_parameters(**dict(override.parameters))
    probe = sampling_probe(sampling)
    if len(probe) != len(override.probe) or not all(
            math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7) for a, b in zip(probe, override.probe, strict=True)):
        raise UnreplayableSampling(
            f"Rebuilding the graph's {override.base} sampling with {dict(override.parameters)} gave sigmas "
            f"{probe} instead of {override.probe}; this ComfyUI version changed the class. Remove the "
            "ModelSampling* node before 'Train LoRA' and set the shift on 'Timestep Sampling' instead.")
    return sampling


def apply_sampling_override(patcher, override: SamplingOverride | None) -> None:
    """Give the rebuilt model the graph's sampling (the training process owns this model)."""
    if override is not None:
        patcher.model.model_sampling = rebuild_sampling(override, patcher.model.model_config)
