"""Noise, timesteps and the training target, built with the model's own ``model_sampling``.

Using ComfyUI's ``model_sampling`` (the object its samplers use) guarantees the trainer sees inputs
exactly as inference produces them: the same sigma-to-timestep map, the same noise scaling and shift.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_EPS = 1e-4


def sample_sigmas(n: int, method: str, generator: torch.Generator, model_sampling) -> torch.Tensor:
    """Sigmas in (0, 1] for flow models: ``uniform``, ``logit_normal``, or ``shift`` (the model's shift)."""
    if method == "uniform":
        u = torch.rand(n, generator=generator)
    elif method == "logit_normal":
        u = torch.sigmoid(torch.randn(n, generator=generator))
    elif method == "shift":
        import comfy.model_sampling

        u = torch.rand(n, generator=generator)
        u = comfy.model_sampling.time_snr_shift(float(getattr(model_sampling, "shift", 1.0)), u)
    else:
        raise ValueError(f"Unknown timestep sampling {method!r}.")
    return u.clamp(_EPS, 1.0)


def noisy_input_and_target(model_sampling, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor):
    """``(noisy latent, network timestep, target of the raw network output)``."""
    import comfy.model_sampling as ms

    s = sigma.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    if isinstance(model_sampling, ms.CONST):  # flow matching: the network predicts noise - x0
        noisy = model_sampling.noise_scaling(s, noise, x0)
        target = noise - x0
    else:
        raise NotImplementedError(
            f"{type(model_sampling).__name__} prediction is not supported yet; flow-matching models are."
        )
    timestep = model_sampling.timestep(sigma).float()
    return noisy, timestep, target


def mse_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(prediction.float(), target.float())
