"""Literal references the tests compare the library against (not used by training)."""

from __future__ import annotations

import torch
from torch import Tensor

from dppo_trl.core.functional import compute_dtype, ratio_coefficient


def dppo_per_token_loss(
    pi_logps: Tensor,
    mu_logps: Tensor,
    advantages: Tensor,
    keep_mask: Tensor,
    ratio_cap: float,
) -> Tensor:
    """Eq. 11 written out as a loss: -A_t · sg(min(π/μ, C)) · M_t · log π(y_t).

    `pi_logps` carries the gradient, so ∇ loss_t = -A_t · min(π/μ, C) · M_t · ∇ log π(y_t). Tokens whose weight
    A · coef · M is exactly 0 contribute exactly 0 (also when log π = -inf). Returns float32 (float64 for float64
    inputs), shape broadcast of the inputs; aggregation over tokens is the caller's choice.
    """
    dtype = compute_dtype(pi_logps, mu_logps)
    pi_lp = pi_logps.to(dtype)
    coef = ratio_coefficient(pi_lp.detach(), mu_logps, ratio_cap)
    weight = (advantages.to(dtype) * coef * keep_mask.to(dtype)).detach()
    loss = -weight * pi_lp
    return torch.where(weight == 0, torch.zeros((), dtype=dtype, device=loss.device), loss)
