"""Pure tensor functions for DPPO's divergence trust region (Qi et al., arXiv 2602.04879, eqs. 11-16).

Notation: π is the trainer policy, μ the behaviour (rollout engine) policy, A the advantage. All inputs are
log-probabilities: sampled-token ones have shape `(...)`, top-K ones `(..., J)`.

Numerics, shared by every function here:

- Computation happens in float32 whatever the input dtype (bf16, fp16, fp32), and the result is float32. float64
  inputs are kept in float64 (the result is float64) so that references and tests can be exact.
- Log-probabilities are clamped to `<= 0` (engines and bf16 rounding can return tiny positive values), so every
  probability lies in `[0, 1]`; `-inf` (probability 0) and `0` (probability 1) are valid inputs and never produce
  NaN or inf.
- Divergences are clamped at 0 from below: rounding can make them slightly negative.
- Binary divergences propagate NaN inputs to NaN outputs (the trainer masks tokens with a NaN μ itself). In the
  top-K functions a NaN slot in either tensor is treated as padding in both.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

DIVERGENCES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl")
# The authors' thresholds (verl example of the paper): δ = 0.15 for TV and 0.05 for KL, on both sides.
DEFAULT_DELTAS = {"tv": 0.15, "kl": 0.05}

# Smallest probability π is pushed to in the KL denominators; only used when π is closer to {0, 1} than both `eps`
# and μ, i.e. where the exact KL would be infinite or dominated by the engine's rounding.
_KL_EPS = 1e-7


def default_delta(kind: str) -> float:
    """Return the authors' threshold δ for a divergence kind: 0.15 for `*_tv`, 0.05 for `*_kl`."""
    if kind not in DIVERGENCES:
        raise ValueError(f"Unknown divergence {kind!r}; expected one of {DIVERGENCES}.")
    return DEFAULT_DELTAS[kind.rsplit("_", 1)[1]]


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    # float64 is kept (exact references), anything else is upcast to float32.
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _as_logp(x: Tensor, dtype: torch.dtype) -> Tensor:
    # clamp(max=0) keeps NaN as NaN and -inf as -inf.
    return x.to(dtype).clamp(max=0.0)


def _log1mexp(logp: Tensor) -> Tensor:
    """log(1 - exp(logp)) for logp <= 0, exact at logp = -inf (0) and logp = 0 (-inf)."""
    # Two branches keep full precision: log1p(-p) when p is small, log(-expm1(logp)) when p is close to 1.
    return torch.where(logp < -math.log(2.0), torch.log1p(-torch.exp(logp)), torch.log(-torch.expm1(logp)))


def _exp_clamped(log_x: Tensor) -> Tensor:
    """exp(log_x) clamped to the dtype's largest finite value (never inf)."""
    fmax = torch.finfo(log_x.dtype).max
    return torch.exp(log_x.clamp(max=math.log(fmax))).clamp(max=fmax)


def _bernoulli_kl_term(p: Tensor, logp: Tensor, logq: Tensor) -> Tensor:
    """p * (log p - log q) with the 0 * log 0 = 0 convention (q > 0 wherever p > 0)."""
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    # Substitute finite logs where p == 0 so the unused branch does not compute 0 * (-inf - -inf) = NaN.
    safe_diff = torch.where(p > 0, logp - logq, zero)
    return torch.where(p > 0, p * safe_diff, zero)


def binary_tv(pi_logps: Tensor, mu_logps: Tensor) -> Tensor:
    """Binary total variation of eq. 13: D = |π(y_t) - μ(y_t)|.

    TV between the Bernoulli distributions ({y_t}, rest) equals the absolute probability difference of the sampled
    token.
    """
    dtype = _compute_dtype(pi_logps, mu_logps)
    pi = torch.exp(_as_logp(pi_logps, dtype))
    mu = torch.exp(_as_logp(mu_logps, dtype))
    return (pi - mu).abs()


def binary_kl(pi_logps: Tensor, mu_logps: Tensor) -> Tensor:
    """Binary KL of eq. 14: D = KL((μ, 1-μ) ‖ (π, 1-π)) = μ log(μ/π) + (1-μ) log((1-μ)/(1-π)), μ/π of y_t.

    Computed in log space (`log(1-p)` via log1p/expm1). Boundary convention: 0 log 0 = 0, so μ ∈ {0, 1} and π = μ
    are exact. Where the exact value is infinite (π ∈ {0, 1} but μ is not), π is moved towards μ to at most
    `eps = 1e-7` from the boundary (or to μ itself when μ is even closer), so D stays finite and large (≈ 16 at most
    for the 1-π side) and the token is masked by any sensible δ.
    """
    dtype = _compute_dtype(pi_logps, mu_logps)
    pi_lp = _as_logp(pi_logps, dtype)
    mu_lp = _as_logp(mu_logps, dtype)
    log_eps = math.log(_KL_EPS)
    log_1m_eps = math.log1p(-_KL_EPS)
    # π ∈ [min(eps, μ), max(1 - eps, μ)]: unchanged when it already lies there, so π = μ gives exactly 0.
    lo = torch.clamp(mu_lp, max=log_eps)
    hi = torch.clamp(mu_lp, min=log_1m_eps)
    pi_lp = torch.minimum(torch.maximum(pi_lp, lo), hi)
    mu = torch.exp(mu_lp)
    one_minus_mu = -torch.expm1(mu_lp)
    kl = _bernoulli_kl_term(mu, mu_lp, pi_lp) + _bernoulli_kl_term(one_minus_mu, _log1mexp(mu_lp), _log1mexp(pi_lp))
    return kl.clamp(min=0.0)


def _topk_probs(pi_topk_logps: Tensor, mu_topk_logps: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Log-probs of the J slots (padding/NaN -> -inf in both) and the probabilities of the rest bucket."""
    if pi_topk_logps.shape != mu_topk_logps.shape:
        raise ValueError(
            f"Top-K tensors must list the same tokens: got shapes {tuple(pi_topk_logps.shape)} and "
            f"{tuple(mu_topk_logps.shape)}."
        )
    dtype = _compute_dtype(pi_topk_logps, mu_topk_logps)
    pi_lp = _as_logp(pi_topk_logps, dtype)
    mu_lp = _as_logp(mu_topk_logps, dtype)
    invalid = pi_lp.isnan() | mu_lp.isnan()
    neg_inf = torch.full((), -math.inf, dtype=dtype, device=pi_lp.device)
    pi_lp = torch.where(invalid, neg_inf, pi_lp)
    mu_lp = torch.where(invalid, neg_inf, mu_lp)
    # Rounding can make the listed mass exceed 1 by a few ulps; the rest bucket is never negative.
    pi_rest = (1.0 - torch.exp(pi_lp).sum(-1)).clamp(min=0.0)
    mu_rest = (1.0 - torch.exp(mu_lp).sum(-1)).clamp(min=0.0)
    return pi_lp, mu_lp, pi_rest, mu_rest


def topk_tv(pi_topk_logps: Tensor, mu_topk_logps: Tensor) -> Tensor:
    """Top-K total variation of eq. 15: D = ½ (Σ_k |π_k - μ_k| + |π_rest - μ_rest|).

    The last dimension lists the same tokens in both tensors (TopK(μ) ∪ {y_t}); `rest = 1 - Σ_k p_k` lumps every
    other token. Padding slots (-inf in both) contribute exactly 0; NaN slots are treated as padding.
    """
    pi_lp, mu_lp, pi_rest, mu_rest = _topk_probs(pi_topk_logps, mu_topk_logps)
    listed = (torch.exp(pi_lp) - torch.exp(mu_lp)).abs().sum(-1)
    return (0.5 * (listed + (pi_rest - mu_rest).abs())).clamp(min=0.0, max=1.0)


def topk_kl(pi_topk_logps: Tensor, mu_topk_logps: Tensor) -> Tensor:
    """Top-K KL of eq. 16: D = Σ_k μ_k log(μ_k/π_k) + μ_rest log(μ_rest/π_rest), i.e. KL(μ ‖ π) on the lumped set.

    Same token-set, padding and NaN conventions as `topk_tv`; 0 log 0 = 0. Where a listed π_k (or π_rest) is 0 but
    μ is not, π is raised to `min(1e-7, μ)` so the value stays finite (see `binary_kl`).
    """
    pi_lp, mu_lp, pi_rest, mu_rest = _topk_probs(pi_topk_logps, mu_topk_logps)
    log_eps = math.log(_KL_EPS)
    pi_lp = torch.maximum(pi_lp, torch.clamp(mu_lp, max=log_eps))
    listed = _bernoulli_kl_term(torch.exp(mu_lp), mu_lp, pi_lp).sum(-1)
    pi_rest = torch.maximum(pi_rest, torch.clamp(mu_rest, max=_KL_EPS))
    rest = _bernoulli_kl_term(mu_rest, torch.log(mu_rest), torch.log(pi_rest))
    return (listed + rest).clamp(min=0.0)


def divergence(
    kind: str,
    pi_logps: Tensor,
    mu_logps: Tensor,
    pi_topk_logps: Tensor | None = None,
    mu_topk_logps: Tensor | None = None,
) -> Tensor:
    """Dispatch to one of eqs. 13-16. KL is always KL(μ ‖ π); top-K kinds need the `(..., J)` tensors."""
    if kind == "binary_tv":
        return binary_tv(pi_logps, mu_logps)
    if kind == "binary_kl":
        return binary_kl(pi_logps, mu_logps)
    if kind in ("topk_tv", "topk_kl"):
        if pi_topk_logps is None or mu_topk_logps is None:
            raise ValueError(f"Divergence {kind!r} needs `pi_topk_logps` and `mu_topk_logps`.")
        fn = topk_tv if kind == "topk_tv" else topk_kl
        return fn(pi_topk_logps, mu_topk_logps)
    raise ValueError(f"Unknown divergence {kind!r}; expected one of {DIVERGENCES}.")


def trust_region_mask(
    pi_logps: Tensor,
    mu_logps: Tensor,
    advantages: Tensor,
    div: Tensor,
    delta_low: float,
    delta_high: float,
) -> Tensor:
    """Keep-mask M_t of eq. 12 as float32 (1 keep, 0 drop).

    M_t = 0 iff (A > 0 and π > μ and D > δ_high) or (A < 0 and π < μ and D > δ_low). The direction compares the
    sampled-token log-probs, so a move back towards μ (A > 0 with π <= μ, A < 0 with π >= μ) and A = 0 are always
    kept. NaN in any input yields 1 (comparisons with NaN are false); invalid μ is the caller's business. The
    comparisons run in the compute dtype (float32 unless an input is float64), so δ is rounded to it.
    """
    dtype = _compute_dtype(pi_logps, mu_logps, div)
    pi_lp = pi_logps.to(dtype)
    mu_lp = mu_logps.to(dtype)
    adv = advantages.to(dtype)
    d = div.to(dtype)
    drop_pos = (adv > 0) & (pi_lp > mu_lp) & (d > delta_high)
    drop_neg = (adv < 0) & (pi_lp < mu_lp) & (d > delta_low)
    return (~(drop_pos | drop_neg)).to(torch.float32)


def ratio_coefficient(pi_logps: Tensor, mu_logps: Tensor, ratio_cap: float) -> Tensor:
    """The truncated importance ratio min(π/μ, C) of eq. 11, computed as exp(min(log π - log μ, log C)).

    Never overflows. `ratio_cap = inf` means no cap; the ratio is then clamped at the dtype's largest finite value.
    π = 0 gives 0 (also when μ = 0), μ = 0 < π gives C. NaN inputs give NaN. Not detached: callers detach.
    """
    if not ratio_cap > 0:
        raise ValueError(f"`ratio_cap` must be > 0, got {ratio_cap}.")
    dtype = _compute_dtype(pi_logps, mu_logps)
    pi_lp = _as_logp(pi_logps, dtype)
    mu_lp = _as_logp(mu_logps, dtype)
    # -inf - -inf is NaN; a zero-probability token under π has ratio 0 whatever μ says.
    log_ratio = torch.where(pi_lp == -math.inf, pi_lp, pi_lp - mu_lp)
    if math.isfinite(ratio_cap):
        log_ratio = log_ratio.clamp(max=math.log(ratio_cap))
    return _exp_clamped(log_ratio)


def dppo_per_token_loss(
    pi_logps: Tensor,
    mu_logps: Tensor,
    advantages: Tensor,
    keep_mask: Tensor,
    ratio_cap: float,
) -> Tensor:
    """Reference per-token DPPO loss of eq. 11: -A_t · sg(min(π/μ, C)) · M_t · log π(y_t).

    `pi_logps` carries the gradient, so ∇ loss_t = -A_t · min(π/μ, C) · M_t · ∇ log π(y_t). Tokens whose weight
    A · coef · M is exactly 0 contribute exactly 0 (also when log π = -inf). Returns float32 (float64 for float64
    inputs), shape broadcast of the inputs; aggregation over tokens is the caller's choice.
    """
    dtype = _compute_dtype(pi_logps, mu_logps)
    pi_lp = pi_logps.to(dtype)
    coef = ratio_coefficient(pi_lp.detach(), mu_logps, ratio_cap)
    weight = (advantages.to(dtype) * coef * keep_mask.to(dtype)).detach()
    loss = -weight * pi_lp
    return torch.where(weight == 0, torch.zeros((), dtype=dtype, device=loss.device), loss)
