"""Baseline trust regions for the paper's ablations, as per-token gradient coefficients.

Every function returns a detached float32 (float64 for float64 inputs) coefficient `coef` of shape `(...)` such
that the method's per-token policy gradient is `-A · coef · ∇ log π(y_t)`; the matching surrogate loss is
`-A · coef · log π(y_t)` with `coef` detached. DPPO's coefficient is `min(π/μ, C) · M`. Everything runs under `torch.no_grad()`. Ratios are formed in log
space and clamped to the dtype's largest finite value, so π/μ up to e^80 (and beyond) never overflows.

Inputs are log-probabilities of the sampled token: `pi` (trainer policy), `mu` (behaviour / rollout engine policy)
and, where needed, `old` (π_old, the trainer's recomputed log-probs of the rollout policy). Advantages broadcast
against them.

| name              | coefficient                                                                      |
|-------------------|----------------------------------------------------------------------------------|
| `grpo_clip`       | r = π/μ, 0 where the PPO clip is active (A>0, r>1+ε_h or A<0, r<1-ε_l)           |
| `clip_higher`     | `grpo_clip` with ε_h = 0.28 (DAPO)                                               |
| `cispo`           | min(r, ε_max), never 0 (CISPO truncated IS, ε_max = 5.0)                         |
| `pg_is`           | r (importance-weighted PG, no trust region)                                      |
| `minirl`          | π/μ, 0 where the clip on r_old = π/π_old is active                               |
| `dppo`            | min(π/μ, C) · M(D(π, μ)) (the paper's method, eqs. 11-12)                        |
| `dppo_decoupled`  | min(π/μ, C) · M(D(π, π_old)) (mask anchored on the recompute)                    |
| `relaxed_clip`    | `grpo_clip` with one or both clips removed for tokens with μ < α (§6 ablation)   |

`relaxed_clip` is **our interpretation** of the paper's §6 ablation: GRPO ratio clipping (r = π/μ, ε_l = ε_h = 0.2)
where, for tokens whose behaviour probability μ(y_t) is below α, the clip on the negative-advantage side
(`relax="low"`: the r < 1-ε_l clip), on the positive-advantage side (`relax="high"`: the r > 1+ε_h clip) or on both
sides (`relax="both"`) is removed, so those tokens keep the plain importance-weighted gradient r. Tokens with
μ >= α are clipped as in GRPO.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from dppo_trl.trust_region import (
    _as_logp,
    _compute_dtype,
    _exp_clamped,
    default_delta,
    divergence,
    ratio_coefficient,
    trust_region_mask,
)

# TRL's `loss_type="cispo"` uses `epsilon_high` as the absolute cap on the ratio; its docs recommend 5.0 (ScaleRL).
# Its literal fallback (epsilon_high=None -> epsilon=0.2) would cap every ratio at 0.2, so we use the recommendation.
CISPO_EPS_MAX = 5.0


def _log_ratio(num_logps: Tensor, den_logps: Tensor, dtype: torch.dtype) -> Tensor:
    num = _as_logp(num_logps, dtype)
    den = _as_logp(den_logps, dtype)
    # -inf - -inf is NaN; a token with numerator probability 0 has ratio 0.
    return torch.where(num == -math.inf, num, num - den)


def _clip_active(log_r: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """Where PPO's clipped surrogate is the minimum and has zero gradient (strict inequalities)."""
    high = (adv > 0) & (log_r > math.log1p(eps_high))
    # eps_low >= 1 means no lower clip at all (1 - eps_low <= 0 < r).
    low = (adv < 0) & (log_r < math.log1p(-eps_low)) if eps_low < 1 else torch.zeros_like(high)
    return high, low


@torch.no_grad()
def grpo_clip_coefficient(pi: Tensor, mu: Tensor, adv: Tensor, eps_low: float = 0.2, eps_high: float = 0.2) -> Tensor:
    """PPO/GRPO ratio clipping anchored on μ: gradient of -min(r·A, clip(r, 1-ε_l, 1+ε_h)·A), r = π/μ.

    coef = r where the clip is inactive, 0 where it is active (A > 0 and r > 1+ε_h, or A < 0 and r < 1-ε_l).
    """
    dtype = _compute_dtype(pi, mu)
    log_r = _log_ratio(pi, mu, dtype)
    high, low = _clip_active(log_r, adv.to(dtype), eps_low, eps_high)
    r = _exp_clamped(log_r)
    return torch.where(high | low, torch.zeros_like(r), r)


def clip_higher_coefficient(
    pi: Tensor, mu: Tensor, adv: Tensor, eps_low: float = 0.2, eps_high: float = 0.28
) -> Tensor:
    """Clip-Higher (DAPO): `grpo_clip_coefficient` with the decoupled upper bound ε_h = 0.28."""
    return grpo_clip_coefficient(pi, mu, adv, eps_low=eps_low, eps_high=eps_high)


@torch.no_grad()
def cispo_coefficient(pi: Tensor, mu: Tensor, adv: Tensor, eps_max: float = CISPO_EPS_MAX) -> Tensor:
    """CISPO (MiniMax-M1): truncated importance sampling without masking, coef = min(r, ε_max), r = π/μ.

    `eps_max` is the absolute cap on the ratio, as TRL's `epsilon_high` for `loss_type="cispo"` (recommended 5.0).
    `adv` is unused (kept for a uniform signature).
    """
    del adv
    dtype = _compute_dtype(pi, mu)
    return ratio_coefficient(pi.to(dtype), mu.to(dtype), eps_max)


@torch.no_grad()
def pg_is_coefficient(pi: Tensor, mu: Tensor, adv: Tensor) -> Tensor:
    """Plain importance-weighted policy gradient, no trust region: coef = r = π/μ (clamped to the dtype's max)."""
    del adv
    dtype = _compute_dtype(pi, mu)
    return _exp_clamped(_log_ratio(pi, mu, dtype))


@torch.no_grad()
def minirl_coefficient(
    pi: Tensor, mu: Tensor, adv: Tensor, old: Tensor, eps_low: float = 0.2, eps_high: float = 0.2
) -> Tensor:
    """MiniRL: PPO clipping anchored on the recomputed π_old, with the train-inference IS weight π_old/μ.

    The surrogate is -(π_old/μ) · min(r_old·A, clip(r_old)·A) with r_old = π/π_old, so coef = (π_old/μ)·r_old = π/μ
    where the r_old clip is inactive and 0 where it is active. The IS weight is not truncated.
    """
    dtype = _compute_dtype(pi, mu, old)
    log_r_old = _log_ratio(pi, old, dtype)
    high, low = _clip_active(log_r_old, adv.to(dtype), eps_low, eps_high)
    r = _exp_clamped(_log_ratio(pi, mu, dtype))
    return torch.where(high | low, torch.zeros_like(r), r)


@torch.no_grad()
def _capped_ratio_with_mask(
    pi: Tensor,
    mu: Tensor,
    adv: Tensor,
    anchor: Tensor,
    divergence_kind: str,
    delta_low: float | None,
    delta_high: float | None,
    ratio_cap: float,
    pi_topk: Tensor | None,
    anchor_topk: Tensor | None,
) -> Tensor:
    """min(π/μ, C) · M, with the eq.-12 mask M taken against `anchor` (μ for DPPO, π_old for the decoupled variant)."""
    d_low = default_delta(divergence_kind) if delta_low is None else delta_low
    d_high = default_delta(divergence_kind) if delta_high is None else delta_high
    div = divergence(divergence_kind, pi, anchor, pi_topk, anchor_topk)
    mask = trust_region_mask(pi, anchor, adv, div, d_low, d_high)
    coef = ratio_coefficient(pi, mu, ratio_cap)
    return coef * mask.to(coef.dtype)


@torch.no_grad()
def dppo_coefficient(
    pi: Tensor,
    mu: Tensor,
    adv: Tensor,
    divergence_kind: str = "binary_tv",
    delta_low: float | None = None,
    delta_high: float | None = None,
    ratio_cap: float = math.inf,
    pi_topk: Tensor | None = None,
    mu_topk: Tensor | None = None,
) -> Tensor:
    """DPPO (eqs. 11-12): coef = min(π/μ, C) · M with the mask from D(π, μ). δ defaults to the authors' values;
    C defaults to no cap (the authors' runs used 10000, effectively off)."""
    return _capped_ratio_with_mask(
        pi, mu, adv, mu, divergence_kind, delta_low, delta_high, ratio_cap, pi_topk, mu_topk
    )


@torch.no_grad()
def dppo_decoupled_coefficient(
    pi: Tensor,
    mu: Tensor,
    adv: Tensor,
    old: Tensor,
    divergence_kind: str = "binary_tv",
    delta_low: float | None = None,
    delta_high: float | None = None,
    ratio_cap: float = math.inf,
    pi_topk: Tensor | None = None,
    old_topk: Tensor | None = None,
) -> Tensor:
    """DPPO with the trust region anchored on the recompute: coef = min(π/μ, C) · M, M from D(π, π_old) and the
    direction π vs π_old (eq. 12 with μ replaced by π_old); the ratio stays π/μ."""
    return _capped_ratio_with_mask(
        pi, mu, adv, old, divergence_kind, delta_low, delta_high, ratio_cap, pi_topk, old_topk
    )


@torch.no_grad()
def relaxed_clip_coefficient(
    pi: Tensor,
    mu: Tensor,
    adv: Tensor,
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
    dtype = _compute_dtype(pi, mu)
    log_r = _log_ratio(pi, mu, dtype)
    high, low = _clip_active(log_r, adv.to(dtype), eps_low, eps_high)
    mu_lp = _as_logp(mu, dtype)
    rare = mu_lp < math.log(alpha) if alpha > 0 else torch.zeros_like(mu_lp, dtype=torch.bool)
    if relax in ("low", "both"):
        low = low & ~rare
    if relax in ("high", "both"):
        high = high & ~rare
    r = _exp_clamped(log_r)
    return torch.where(high | low, torch.zeros_like(r), r)


TRUST_REGIONS: dict[str, Callable[..., Tensor]] = {
    "grpo_clip": grpo_clip_coefficient,
    "clip_higher": clip_higher_coefficient,
    "cispo": cispo_coefficient,
    "pg_is": pg_is_coefficient,
    "minirl": minirl_coefficient,
    "dppo": dppo_coefficient,
    "dppo_decoupled": dppo_decoupled_coefficient,
    "relaxed_clip": relaxed_clip_coefficient,
}
# Methods whose fourth positional argument is the recomputed π_old log-probs.
NEEDS_OLD_LOGPS = frozenset({"minirl", "dppo_decoupled"})


def trust_region_coefficient(
    name: str, pi: Tensor, mu: Tensor, adv: Tensor, old: Tensor | None = None, **kwargs
) -> Tensor:
    """Uniform entry point: look up `name` in `TRUST_REGIONS`, pass `old` to the methods that need it."""
    if name not in TRUST_REGIONS:
        raise ValueError(f"Unknown trust region {name!r}; expected one of {sorted(TRUST_REGIONS)}.")
    fn = TRUST_REGIONS[name]
    if name in NEEDS_OLD_LOGPS:
        if old is None:
            raise ValueError(f"Trust region {name!r} needs the recomputed `old` log-probs.")
        return fn(pi, mu, adv, old, **kwargs)
    return fn(pi, mu, adv, **kwargs)
