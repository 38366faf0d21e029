"""Per-item loss scales: SD3's loss weighting by sigma, and a scale on the labels of a micro-batch.

The SD3 paper (Esser et al. 2024, section 3.1) writes every flow-matching timestep density as a loss
weight. Two of its schemes are offered, with the raw weights of its reference training code (diffusers'
``compute_loss_weighting_for_sd3``), not normalized:

- ``sigma_sqrt``: ``w(s) = s^-2``. It grows without bound at low noise (1e8 at the trainer's sigma floor
  1e-4), so a micro-batch of one low sigma can dominate a step; gradient clipping (``max_grad_norm``)
  or ``sigma_min`` on the Timestep Sampling node tame it.
- ``cosmap``: ``w(s) = 2 / (pi * (1 - 2s + 2s^2))``, the density of the cosine-map timesteps
  ``t = 1 - 1 / (tan(pi u / 2) + 1)`` for uniform ``u``: it integrates to 1 over [0, 1], so its mean
  weight under uniform sigmas is 1 (between 2/pi at the ends and 4/pi at s = 0.5).

They scale each item's share of the mean squared error (the ``item_scale`` of the labels contract in
training/objective/loss.py), so the loss and its gradient change, the sampled sigmas do not. They mean something
for flow (CONST) models only, whose sigma is the noise share in [0, 1]; eps and v models are refused.
"""

from __future__ import annotations

import math

import torch

from ..spec.choices import LOSS_WEIGHTINGS
from .loss import prediction_type


def sigma_weights(kind: str, sigma: torch.Tensor) -> torch.Tensor:
    """``w(sigma)`` of scheme ``kind`` (``none``: ones), fp32, the shape of ``sigma``."""
    s = sigma.float()
    if kind == "none":
        return torch.ones_like(s)
    if kind == "sigma_sqrt":
        return s.pow(-2.0)
    if kind == "cosmap":
        return 2.0 / (math.pi * (1.0 - 2.0 * s + 2.0 * s * s))
    raise ValueError(f"Loss weighting {kind!r} is not one of {', '.join(LOSS_WEIGHTINGS)}.")


def item_scales(kind: str, sigma: torch.Tensor, model_sampling) -> torch.Tensor | None:
    """Per-item scales ``[B]`` of a micro-batch drawn at ``sigma``, or None for ``none`` (labels untouched,
    so the loss stays bit for bit what it was before the option). ``model_sampling``: the model's own
    (ComfyUI's), whose prediction type must be flow; preflight refuses the others first."""
    if kind == "none":
        return None
    prediction = prediction_type(model_sampling)
    if prediction != "flow":
        raise ValueError(f"Loss weighting {kind!r} is defined for flow-matching models (sigma in [0, 1]); this "
                         f"model is {prediction}-prediction: set loss_weighting to none on the Timestep Sampling node.")
    return sigma_weights(kind, sigma).view(-1)


def scale_labels(labels, scale: torch.Tensor):
    """``labels`` (``target``, ``(target, weight)`` or ``(target, weight, item_scale)``) with every item's
    share of the loss multiplied by ``scale`` (``[B]``, or a scalar tensor for the whole micro-batch)."""
    if isinstance(labels, (tuple, list)):
        target, weight, *old = labels
    else:
        target, weight, old = labels, None, []
    scale = scale.float().to(target.device).reshape(-1).expand(target.shape[0])
    if weight is None:
        weight = torch.ones((1,) * target.ndim, device=target.device)
    if old:
        scale = old[0].float().view(-1) * scale
    return target, weight, scale
