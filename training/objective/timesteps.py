"""Training sigmas, drawn the way the model samples (or the way the user asked), reproducibly.

The default (``distribution="uniform"``, ``shift="model"``) gives exactly the sigma distribution of
the model's inference schedule: u ~ U(0, 1) is a fraction of the way from the first to the last
timestep and ComfyUI's own ``model_sampling`` maps it to a sigma (:func:`model_sigma`). That object
knows the family's policy (SD3's ``time_snr_shift(3.0)``, Flux's ``flux_time_shift(mu=1.15)`` which is
a shift of e^1.15 ~ 3.16, a ModelSampling* node's override), so nothing here guesses a shift.

The other shifts follow what users of diffusion-pipe / musubi-tuner set by hand: none, a fixed shift,
and a resolution-dependent one. Bounds redraw out-of-range sigmas, which conditions any of these
distributions on the range (what a Wan 2.2 high- or low-noise expert trains on).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..spec.options import TimestepSpec

SIGMA_FLOOR = 1e-4  # sigma 0 is a clean latent: no signal to learn from, and some schedules divide by it
_REDRAW_ROUNDS = 64
_RANGE_RTOL = 1e-4  # sigma(timestep) round trips in float32
MIN_SIGMA_RANGE = 0.01  # a sigma range narrower than this leaves (almost) nothing to train

# ComfyUI's ModelSamplingFlux node interpolates mu linearly between these image token counts.
_BASE_TOKENS, _MAX_TOKENS = 256, 4096


def timestep_range(model_sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, last)`` timestep of the model's inference schedule, in the model's own units.

    ``last = timestep(sigma_max)`` (1000 for SD3, 1 for Flux, 999 for discrete-time UNets). The range
    starts at timestep 0 wherever ``sigma(0)`` is at or below ``sigma_min``: discrete schedules
    (``sigma(0)`` is their smallest sigma) and flow schedules (``sigma(0) = 0``). There ``timestep()``
    must not be used for the start: a flow class's ``timestep(sigma)`` is ``sigma * multiplier``, not
    the inverse of its shifted ``sigma(t)``. Continuous EDM schedules (CosXL-style ``edm_vpred``
    SDXL files, ComfyUI's ``ModelSamplingContinuousEDM``) number timesteps by ``log(sigma) / 4``, so
    timestep 0 is sigma 1, inside the range: their range starts at ``timestep(sigma_min)``, which
    inverts their ``sigma()`` exactly (checked; a class where it does not is refused by name). This
    is the span ComfyUI's ``normal`` scheduler walks (``timestep(sigma_max)`` to ``timestep(sigma_min)``).
    """
    low = torch.as_tensor(model_sampling.sigma_min, dtype=torch.float32)
    last = model_sampling.timestep(torch.as_tensor(model_sampling.sigma_max, dtype=torch.float32)).float()
    zero = torch.zeros_like(last)
    if float(model_sampling.sigma(zero)) <= float(low) * (1 + _RANGE_RTOL):
        return zero, last
    first = model_sampling.timestep(low).float()
    if not math.isclose(float(model_sampling.sigma(first)), float(low), rel_tol=_RANGE_RTOL):
        raise NotImplementedError(
            f"{type(model_sampling).__name__}: timestep 0 lies inside its sigma range and its timestep() does not "
            "invert its sigma(), so PipeTrainer cannot tell where its schedule starts; this sampling is not "
            "supported for training.")
    return first, last


# Sampling classes whose ``timestep()`` is not the parameter their sigma table is spaced in: ComfyUI's
# ModelSamplingCosmosRFlow numbers timesteps by the rectified-flow time sigma / (sigma + 1), while its
# ``sigmas`` table (EDM's, log-spaced from sigma_min to sigma_max) is what its schedulers walk; its
# ``sigma()`` also takes one timestep at a time only.
_TABLE_SCHEDULES = ("ModelSamplingCosmosRFlow",)


def _walks_its_table(model_sampling) -> bool:
    return any(cls.__name__ in _TABLE_SCHEDULES for cls in type(model_sampling).__mro__)


def table_sigma(model_sampling, u: torch.Tensor) -> torch.Tensor:
    """Sigma at fraction ``u`` of the model's own ``sigmas`` table, interpolated in log sigma (as ComfyUI's
    discrete ``sigma()`` interpolates its ``log_sigmas``): ``u`` uniform gives the table's distribution."""
    log = model_sampling.log_sigmas.float()
    position = u.float().clamp(0, 1) * (len(log) - 1)
    low = position.floor().long().clamp(max=len(log) - 2)
    frac = position - low
    return ((1 - frac) * log[low] + frac * log[low + 1]).exp()


def model_sigma(model_sampling, u: torch.Tensor) -> torch.Tensor:
    """Sigma at fraction ``u`` of the model's timestep range (:func:`timestep_range`), by the model's own
    ``model_sampling``: ``u`` uniform in [0, 1] gives the inference schedule's sigma distribution. A sampling
    class whose timestep is not its table's parameter (Cosmos Predict2's) walks its table (:func:`table_sigma`)."""
    if _walks_its_table(model_sampling):
        return table_sigma(model_sampling, u)
    first, last = timestep_range(model_sampling)
    return model_sampling.sigma(first + u * (last - first)).float()


def snr_shift(shift: float, u: torch.Tensor) -> torch.Tensor:
    """The flow-matching shift ``shift * u / (1 + (shift - 1) * u)`` (ComfyUI's ``time_snr_shift``)."""
    return shift * u / (1 + (shift - 1) * u)


def resolution_shift(spec: TimestepSpec, image_tokens: int) -> float:
    """e^mu with mu linear in the image token count (``base_shift`` at 256 tokens, ``max_shift`` at 4096)."""
    slope = (spec.max_shift - spec.base_shift) / (_MAX_TOKENS - _BASE_TOKENS)
    mu = spec.base_shift + slope * (image_tokens - _BASE_TOKENS)
    return math.exp(mu)


def _draw_u(n: int, spec: TimestepSpec, generator: torch.Generator) -> torch.Tensor:
    if spec.distribution == "uniform":
        return torch.rand(n, generator=generator)
    if spec.distribution == "logit_normal":
        return torch.sigmoid(spec.logit_mean + spec.logit_std * torch.randn(n, generator=generator))
    raise ValueError(f"Unknown timestep distribution {spec.distribution!r}.")


def _u_to_sigma(u: torch.Tensor, spec: TimestepSpec, model_sampling, image_tokens: int) -> torch.Tensor:
    if spec.shift == "model":
        return model_sigma(model_sampling, u)
    if spec.shift == "none":
        return u
    if spec.shift == "fixed":
        return snr_shift(spec.shift_value, u)
    if spec.shift == "resolution":
        return snr_shift(resolution_shift(spec, image_tokens), u)
    raise ValueError(f"Unknown timestep shift {spec.shift!r}.")


def sample_sigmas(n: int, spec: TimestepSpec, generator: torch.Generator, model_sampling,
                  image_tokens: int = 0) -> torch.Tensor:
    """``n`` sigmas for one micro-batch; ``image_tokens`` (per image) feeds the ``resolution`` shift."""
    bounded = spec.sigma_min > 0.0 or spec.sigma_max < 1.0
    sigma = _u_to_sigma(_draw_u(n, spec, generator), spec, model_sampling, image_tokens)
    if bounded:
        kept = sigma[(sigma >= spec.sigma_min) & (sigma <= spec.sigma_max)]
        for _ in range(_REDRAW_ROUNDS):
            if kept.numel() >= n:
                break
            more = _u_to_sigma(_draw_u(8 * n, spec, generator), spec, model_sampling, image_tokens)
            kept = torch.cat((kept, more[(more >= spec.sigma_min) & (more <= spec.sigma_max)]))
        if kept.numel() < n:
            raise ValueError(
                f"Almost no sigma of this timestep sampling falls in [{spec.sigma_min}, {spec.sigma_max}]: "
                "widen the range or change the distribution or shift.")
        sigma = kept[:n]
    return sigma.clamp_min(SIGMA_FLOOR)


def family_timesteps(spec: TimestepSpec, adapter: object, diffusion_model: object, options: object) -> TimestepSpec:
    """``spec`` with its sigma range narrowed to the family's (a Wan 2.2 expert's), if the adapter has one.

    An adapter may define ``sigma_bounds(diffusion_model, options) -> (low, high) | None``; the user's own
    range is kept where it is narrower. A range left empty is an error naming both."""
    bounds_of = getattr(adapter, "sigma_bounds", None)
    bounds = bounds_of(diffusion_model, options) if bounds_of is not None else None
    if bounds is None:
        return spec
    low, high = max(spec.sigma_min, bounds[0]), min(spec.sigma_max, bounds[1])
    if high - low < MIN_SIGMA_RANGE:
        raise ValueError(
            f"The timestep range [{spec.sigma_min}, {spec.sigma_max}] leaves (almost) nothing of this model's "
            f"range [{bounds[0]}, {bounds[1]}] (the expert being trained): widen sigma_min/sigma_max on the "
            "Timestep Sampling node or remove it.")
    return dataclasses.replace(spec, sigma_min=low, sigma_max=high)
