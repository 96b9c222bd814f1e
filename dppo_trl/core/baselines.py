"""Baseline trust regions for the paper's ablations, as per-token policy-gradient coefficients.

Each function has the form of DPPO's `dppo_trl.core.functional.dppo_coefficient` (eq. 11): it returns the detached
coefficient `w_t` such that the method's per-token gradient is `−A_t · w_t · ∇log π(y_t)` (surrogate loss
`−A_t · sg(w_t) · log π(y_t)`), float32 (float64 for float64 inputs), shape `(...)`. Ratios are formed in log space
and clamped to the dtype's largest finite value, so π/μ up to e^80 (and beyond) never overflows.

Inputs are sampled-token log-probabilities: `pi_logps` (π, the trainer policy), `mu_logps` (μ, the behavior policy
that sampled) and, where needed, `old_logps` (π_old, the trainer's recompute of the weights that generated).
Advantages broadcast against them. Which config fields each reads is in `dppo_trl.core.registry.TRUST_REGIONS`.

| function                      | coefficient w                                                                   |
|-------------------------------|---------------------------------------------------------------------------------|
| `grpo_clip_coefficient`       | r = π/μ, 0 where the PPO clip is active (A>0, r>1+ε_h or A<0, r<1-ε_l)          |
| `cispo_coefficient`           | min(r, ε_max), never 0 (CISPO truncated IS, ε_max = 5.0)                        |
| `pg_is_coefficient`           | r (importance-weighted PG, no trust region)                                     |
| `minirl_coefficient`          | π/μ, 0 where the clip on r_old = π/π_old is active                              |
| `dppo_decoupled_coefficient`  | min(π/μ, C) · M(D(π, π_old)) (eq. 12 mask taken against the recompute)          |
| `relaxed_clip_coefficient`    | `grpo_clip` with one or both clips removed for tokens with μ < α (§6 ablation)  |

`relaxed_clip_coefficient` is **our interpretation** of the paper's §6 ablation: GRPO ratio clipping (r = π/μ,
ε_l = ε_h = 0.2) where, for tokens whose behavior probability μ(y_t) is below α, the clip on the negative-advantage
side (`relax="low"`: the r < 1-ε_l clip), on the positive-advantage side (`relax="high"`: the r > 1+ε_h clip) or on
both sides (`relax="both"`) is removed, so those tokens keep the plain importance-weighted gradient r. Tokens with
μ >= α are clipped as in GRPO.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dppo_trl.core.functional import (
    DEFAULT_RATIO_CAP,
    as_logp,
    compute_dtype,
    dppo_coefficient,
    exp_clamped,
    log_ratio,
    ratio_coefficient,
)

# TRL's `loss_type="cispo"` uses `epsilon_high` as the absolute cap on the ratio; its docs recommend 5.0 (ScaleRL).
# Its literal fallback (epsilon_high=None -> epsilon=0.2) would cap every ratio at 0.2, so we use the recommendation.
CISPO_EPS_MAX = 5.0


def _clip_active(log_r: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """Where PPO's clipped surrogate is the minimum and has zero gradient (strict inequalities)."""
    high = (advantages > 0) & (log_r > math.log1p(eps_high))
    # eps_low >= 1 means no lower clip at all (1 - eps_low <= 0 < r).
    low = (advantages < 0) & (log_r < math.log1p(-eps_low)) if eps_low < 1 else torch.zeros_like(high)
    return high, low


@torch.no_grad()
def grpo_clip_coefficient(
    pi_logps: Tensor, mu_logps: Tensor, advantages: Tensor, eps_low: float = 0.2, eps_high: float = 0.2
) -> Tensor:
    """PPO/GRPO ratio clipping of r = π/μ: gradient of -min(r·A, clip(r, 1-ε_l, 1+ε_h)·A), r = π/μ.

    w = r where the clip is inactive, 0 where it is active (A > 0 and r > 1+ε_h, or A < 0 and r < 1-ε_l). Clip-Higher
    (DAPO) is this function with ε_h = 0.28.
    """
    dtype = compute_dtype(pi_logps, mu_logps)
    log_r = log_ratio(pi_logps, mu_logps, dtype)
    high, low = _clip_active(log_r, advantages.to(dtype), eps_low, eps_high)
    r = exp_clamped(log_r)
    return torch.where(high | low, torch.zeros_like(r), r)


@torch.no_grad()
def cispo_coefficient(
    pi_logps: Tensor, mu_logps: Tensor, advantages: Tensor, eps_max: float = CISPO_EPS_MAX
) -> Tensor:
    """CISPO (MiniMax-M1): truncated importance sampling without masking, w = min(r, ε_max), r = π/μ.

    `eps_max` is the absolute cap on the ratio, as TRL's `epsilon_high` for `loss_type="cispo"` (recommended 5.0).
    `advantages` is unused (kept for a uniform signature).
    """
    del advantages
    dtype = compute_dtype(pi_logps, mu_logps)
    return ratio_coefficient(pi_logps.to(dtype), mu_logps.to(dtype), eps_max)


@torch.no_grad()
def pg_is_coefficient(pi_logps: Tensor, mu_logps: Tensor, advantages: Tensor) -> Tensor:
    """Plain importance-weighted policy gradient, no trust region: w = r = π/μ (clamped to the dtype's max)."""
    del advantages
    dtype = compute_dtype(pi_logps, mu_logps)
    return exp_clamped(log_ratio(pi_logps, mu_logps, dtype))


@torch.no_grad()
def minirl_coefficient(
    pi_logps: Tensor,
    mu_logps: Tensor,
    advantages: Tensor,
    old_logps: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> Tensor:
    """MiniRL: PPO clipping of r_old = π/π_old (the recompute), with the train-inference IS weight π_old/μ.

    The surrogate is -(π_old/μ) · min(r_old·A, clip(r_old)·A) with r_old = π/π_old, so w = (π_old/μ)·r_old = π/μ
    where the r_old clip is inactive and 0 where it is active. The IS weight is not truncated.
    """
    dtype = compute_dtype(pi_logps, mu_logps, old_logps)
    log_r_old = log_ratio(pi_logps, old_logps, dtype)
    high, low = _clip_active(log_r_old, advantages.to(dtype), eps_low, eps_high)
    r = exp_clamped(log_ratio(pi_logps, mu_logps, dtype))
    return torch.where(high | low, torch.zeros_like(r), r)


@torch.no_grad()
def dppo_decoupled_coefficient(
    pi_logps: Tensor,
    mu_logps: Tensor,
    advantages: Tensor,
    old_logps: Tensor,
    divergence: str = "binary_tv",
    delta_low: float | None = None,
    delta_high: float | None = None,
    ratio_cap: float = DEFAULT_RATIO_CAP,
) -> Tensor:
    """DPPO with the trust region taken against the recompute: w = min(π/μ, C) · M, with M from eq. 12 on D(π, π_old)
    and the direction π vs π_old; the ratio stays π/μ. With π_old = μ it is DPPO."""
    return dppo_coefficient(
        pi_logps, mu_logps, advantages, divergence, delta_low, delta_high, ratio_cap, mask_logps=old_logps
    )


@torch.no_grad()
def relaxed_clip_coefficient(
    pi_logps: Tensor,
    mu_logps: Tensor,
    advantages: Tensor,
    alpha: float,
    relax: str = "low",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> Tensor:
    """GRPO clipping with the clip removed on the `relax` side(s) for tokens with μ(y_t) < α (see module docstring).

    relax="low" drops the A<0, r<1-ε_l clip; "high" drops the A>0, r>1+ε_h clip; "both" drops both.
    """
    if relax not in ("low", "high", "both"):
        raise ValueError(f"`relax` must be 'low', 'high' or 'both', got {relax!r}.")
    dtype = compute_dtype(pi_logps, mu_logps)
    log_r = log_ratio(pi_logps, mu_logps, dtype)
    high, low = _clip_active(log_r, advantages.to(dtype), eps_low, eps_high)
    mu_lp = as_logp(mu_logps, dtype)
    rare = mu_lp < math.log(alpha) if alpha > 0 else torch.zeros_like(mu_lp, dtype=torch.bool)
    if relax in ("low", "both"):
        low = low & ~rare
    if relax in ("high", "both"):
        high = high & ~rare
    r = exp_clamped(log_r)
    return torch.where(high | low, torch.zeros_like(r), r)
