"""Noisy input, network timestep and training target, built with the model's own ``model_sampling``.

Using ComfyUI's ``model_sampling`` (the object its samplers use) guarantees the trainer sees inputs
exactly as inference produces them: the same sigma-to-timestep map, the same noise scaling and input
scaling. The target is what the raw network output must be for ComfyUI's ``calculate_denoised`` to
give back the clean latent, for each prediction type ComfyUI's samplers know:

- ``CONST`` (flow matching: SD3, Flux, Wan, ...): velocity ``noise - x0``;
- ``EPS``: the noise;
- ``V_PREDICTION``: ``v = (sigma_data^2 * noise - sigma * x0) / (sigma_data * sqrt(sigma^2 + sigma_data^2))``;
- ``COSMOS_RFLOW`` (Cosmos Predict2, kind ``rflow``): EDM sigmas (``x0 + sigma * noise``), the network sees the
  rectified-flow point ``t = sigma / (sigma + 1)`` (``calculate_input``) and ComfyUI denoises its output as
  ``noisy * (1 - t) - output * t``, which gives back ``x0`` for the velocity ``noise - x0``. Its sigmas are not
  flow noise shares in [0, 1], so it is a kind of its own (flow-only settings are refused for it).

Other types (EDM, X0, ...) are refused by name rather than trained against a wrong target.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Noised(NamedTuple):
    network_input: torch.Tensor  # what the network sees: model_sampling.calculate_input(sigma, noisy)
    timestep: torch.Tensor  # what BaseModel.apply_model passes: model_sampling.timestep(sigma)
    target: torch.Tensor  # the raw network output that denoises to x0


_KINDS = {"CONST": "flow", "EPS": "eps", "V_PREDICTION": "v", "COSMOS_RFLOW": "rflow"}


def prediction_type(model_sampling) -> str:
    """``"flow"``, ``"v"``, ``"eps"`` or ``"rflow"``: the ComfyUI prediction class whose ``calculate_denoised`` the
    model's sampling uses (the most derived one that defines it). A subclass with its own formula
    (EDM, X0, current ComfyUI's IMG_TO_IMG_FLOW, ...) is refused by name, never trained as its parent."""
    import comfy.model_sampling as ms

    owner = next((cls for cls in type(model_sampling).__mro__ if "calculate_denoised" in vars(cls)), None)
    name = owner.__name__ if owner is not None else type(model_sampling).__name__
    if owner is not None and getattr(ms, name, None) is owner and name in _KINDS:
        return _KINDS[name]
    raise NotImplementedError(
        f"{name} prediction is not supported yet ({type(model_sampling).__name__}); flow-matching, eps- and "
        "v-prediction models and Cosmos' rectified flow are."
    )


def noisy_input_and_target(model_sampling, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> Noised:
    """``(network input, network timestep, target of the raw network output)``.

    The noised latent is ComfyUI's ``noise_scaling`` (``x0 + sigma * noise`` for eps/v, the flow
    interpolation for CONST); flow models see it unchanged, eps/v models divide it by
    ``sqrt(sigma^2 + sigma_data^2)`` (``calculate_input``), exactly as ``BaseModel.apply_model`` does.
    """
    kind = prediction_type(model_sampling)
    s = sigma.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    noisy = model_sampling.noise_scaling(s, noise, x0)
    if kind in ("flow", "rflow"):
        target = noise - x0
    elif kind == "eps":
        target = noise
    else:
        sd = float(model_sampling.sigma_data)
        target = (sd**2 * noise - s * x0) / (sd * (s**2 + sd**2).sqrt())
    network_input = model_sampling.calculate_input(s, noisy)
    timestep = model_sampling.timestep(sigma).float()
    return Noised(network_input, timestep, target)


def mse_loss(prediction: torch.Tensor, target) -> torch.Tensor:
    """Mean squared error; ``target`` may be ``(target, weight)`` or ``(target, weight, item_scale)``.

    ``weight`` (broadcastable to the target: the family's loss mask times the items' own masks) says
    which elements count: the mean is over the weighted elements, so weight 0 leaves an element out
    entirely (masking a clean conditioning frame does not dilute the loss of the rest, and an item
    whose mask is all zero adds nothing). ``item_scale`` (``[B]``: a regularization dataset's weight,
    a loss weighting by sigma) multiplies each item's share of that mean without renormalizing, so a
    scale of 0.5 halves that item's pull on the gradient.
    """
    if isinstance(target, (tuple, list)):
        target, weight, *scale = target
        squared = (prediction.float() - target.float()).pow(2)
        weight = weight.float().expand_as(squared)
        if not scale:
            return (squared * weight).sum() / weight.sum().clamp_min(1e-12)
        per_item = (squared * weight).flatten(1).sum(1) * scale[0].float().view(-1)
        return per_item.sum() / weight.sum().clamp_min(1e-12)
    return F.mse_loss(prediction.float(), target.float())
