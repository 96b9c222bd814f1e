"""DPPO's math as pure tensor functions (Qi et al., *Rethinking the Trust Region in LLM Reinforcement Learning*,
arXiv 2602.04879, eqs. 11-16), top to bottom in the paper's terms. Everything DPPO changes with respect to GRPO:

- eqs. 13-16, the divergence D: `binary_tv`, `binary_kl`, `topk_tv`, `topk_kl` (dispatch: `compute_divergence`);
- eq. 12, the trust-region mask M_t: `trust_region_mask`;
- eq. 11, the objective: `dppo_coefficient` — per completion token, `loss_t = −A_t · sg(w_t) · log π(y_t)` with
  `w_t = min(π/μ, C) · M_t`;
- the optional μ-KL penalty `τ · (log π − log μ)²` that prime-rl pairs with DPPO: `mu_kl_penalty`;
- what μ may be: `sanitize_behavior_logps`;
- truncated sampling (top-k / top-p / min-p), π over the engine's kept set: `kept_log_mass`, `restrict_topk_to_kept`.

`dppo_trl.core.loss.policy_loss` assembles them into one loss call (D computed once, shared by the coefficient, the
metrics and the observers).

Vocabulary (docs/theory.md): π the trainer policy, μ the behavior policy (the rollout engine's log-probs when it
sampled), A the advantage, δ the thresholds, C the ratio cap. Every input is a log-probability (`*_logps`):
sampled-token ones have shape `(...)`, top-K ones `(..., J)`.

Numerics, shared by every function here:

- Computation happens in float32 whatever the input dtype (bf16, fp16, fp32), and the result is float32. float64
  inputs are kept in float64 (the result is float64) so that references and tests can be exact.
- Log-probabilities are clamped to `<= 0` (engines and bf16 rounding can return tiny positive values), so every
  probability lies in `[0, 1]`; `-inf` (probability 0) and `0` (probability 1) are valid inputs and never produce
  NaN or inf.
- Divergences are clamped at 0 from below: rounding can make them slightly negative.
- Binary divergences propagate NaN inputs to NaN outputs (the trainer masks tokens with a NaN μ itself). In the
  top-K functions a NaN slot in either tensor is treated as padding in both.
- KL is infinite only where π is exactly 0 or 1 and μ is not. There, and only there, π is moved to `1e-7` from the
  boundary (or to μ when μ is even closer), so D stays finite and far above any sensible δ. Every finite π is used
  as it is, so D is exact (up to float32 rounding) everywhere else.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

DIVERGENCES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl")
# The authors' thresholds (verl example of the paper): δ = 0.15 for TV and 0.05 for KL, on both sides.
DEFAULT_DELTAS = {"tv": 0.15, "kl": 0.05}
# C of eq. 11. The authors ran with the cap effectively off (1e4); 20 follows TRL's removed DPPOTrainer and bounds the
# weight of tokens the engine sampled far less likely than the trainer now finds them.
DEFAULT_RATIO_CAP = 20.0
# A log-prob this far above 0 is rounding of log 1 (engines and bf16 report such values); anything larger is not one.
LOGP_ROUNDING = 1e-6

# Where the exact KL is infinite (π exactly 0 or 1, μ not), π is moved this far from the boundary instead.
_KL_EPS = 1e-7


def default_delta(divergence: str) -> float:
    """Return the authors' threshold δ for a divergence: 0.15 for `*_tv`, 0.05 for `*_kl`."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"Unknown divergence {divergence!r}; expected one of {DIVERGENCES}.")
    return DEFAULT_DELTAS[divergence.rsplit("_", 1)[1]]


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64 (exact references), else float32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def as_logp(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`x` in `dtype`, clamped to `<= 0` (NaN stays NaN, -inf stays -inf)."""
    return x.to(dtype).clamp(max=0.0)


def log_ratio(num_logps: Tensor, den_logps: Tensor, dtype: torch.dtype) -> Tensor:
    """log(num/den) of two probabilities given as log-probs, in `dtype`; 0/0 (and 0/anything) is ratio 0, never NaN."""
    num = as_logp(num_logps, dtype)
    den = as_logp(den_logps, dtype)
    return torch.where(num == -math.inf, num, num - den)


def _log1mexp(logp: Tensor) -> Tensor:
    """log(1 - exp(logp)) for logp <= 0, exact at logp = -inf (0) and logp = 0 (-inf)."""
    # Two branches keep full precision: log1p(-p) when p is small, log(-expm1(logp)) when p is close to 1.
    return torch.where(logp < -math.log(2.0), torch.log1p(-torch.exp(logp)), torch.log(-torch.expm1(logp)))


def exp_clamped(log_x: Tensor) -> Tensor:
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
    dtype = compute_dtype(pi_logps, mu_logps)
    pi = torch.exp(as_logp(pi_logps, dtype))
    mu = torch.exp(as_logp(mu_logps, dtype))
    return (pi - mu).abs()


def binary_kl(pi_logps: Tensor, mu_logps: Tensor) -> Tensor:
    """Binary KL of eq. 14: D = KL((μ, 1-μ) ‖ (π, 1-π)) = μ log(μ/π) + (1-μ) log((1-μ)/(1-π)), μ/π of y_t.

    Computed in log space (`log(1-p)` via log1p/expm1). Boundary convention: 0 log 0 = 0, so μ ∈ {0, 1} and π = μ
    are exact. Where the exact value is infinite (π exactly 0 or 1 while μ is not), π is moved to `eps = 1e-7` from
    that boundary (or to μ itself when μ is even closer), so D stays finite and large (≈ 16 at most for the 1-π
    side) and the token is masked by any sensible δ. Every other π is used as it is.
    """
    dtype = compute_dtype(pi_logps, mu_logps)
    pi_lp = as_logp(pi_logps, dtype)
    mu_lp = as_logp(mu_logps, dtype)
    # Only the infinite cases move: π = 0 to min(eps, μ), π = 1 to max(1 - eps, μ) (π = μ stays exact).
    pi_lp = torch.where(pi_lp == -math.inf, torch.clamp(mu_lp, max=math.log(_KL_EPS)), pi_lp)
    pi_lp = torch.where(pi_lp == 0, torch.clamp(mu_lp, min=math.log1p(-_KL_EPS)), pi_lp)
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
    dtype = compute_dtype(pi_topk_logps, mu_topk_logps)
    pi_lp = as_logp(pi_topk_logps, dtype)
    mu_lp = as_logp(mu_topk_logps, dtype)
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

    Same token-set, padding and NaN conventions as `topk_tv`; 0 log 0 = 0. Where a listed π_k (or π_rest) is exactly
    0 but μ is not, the exact value is infinite: that π is raised to `min(1e-7, μ)` so D stays finite (see
    `binary_kl`). Every other π is used as it is.
    """
    pi_lp, mu_lp, pi_rest, mu_rest = _topk_probs(pi_topk_logps, mu_topk_logps)
    pi_lp = torch.where(pi_lp == -math.inf, torch.clamp(mu_lp, max=math.log(_KL_EPS)), pi_lp)
    listed = _bernoulli_kl_term(torch.exp(mu_lp), mu_lp, pi_lp).sum(-1)
    pi_rest = torch.where(pi_rest == 0, torch.clamp(mu_rest, max=_KL_EPS), pi_rest)
    rest = _bernoulli_kl_term(mu_rest, torch.log(mu_rest), torch.log(pi_rest))
    return (listed + rest).clamp(min=0.0)


def compute_divergence(
    divergence: str,
    pi_logps: Tensor,
    mu_logps: Tensor,
    pi_topk_logps: Tensor | None = None,
    mu_topk_logps: Tensor | None = None,
) -> Tensor:
    """D of eqs. 13-16, by name (`DPPOConfig.divergence`). KL is always KL(μ ‖ π); top-K kinds need the `(..., J)`
    tensors listing TopK(μ) ∪ {y_t}."""
    if divergence == "binary_tv":
        return binary_tv(pi_logps, mu_logps)
    if divergence == "binary_kl":
        return binary_kl(pi_logps, mu_logps)
    if divergence in ("topk_tv", "topk_kl"):
        if pi_topk_logps is None or mu_topk_logps is None:
            raise ValueError(f"Divergence {divergence!r} needs `pi_topk_logps` and `mu_topk_logps`.")
        fn = topk_tv if divergence == "topk_tv" else topk_kl
        return fn(pi_topk_logps, mu_topk_logps)
    raise ValueError(f"Unknown divergence {divergence!r}; expected one of {DIVERGENCES}.")


# ---------------------------------------------------------------------------------------------------------------------
# Eq. 12: the trust-region mask
# ---------------------------------------------------------------------------------------------------------------------


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
    dtype = compute_dtype(pi_logps, mu_logps, div)
    pi_lp = pi_logps.to(dtype)
    mu_lp = mu_logps.to(dtype)
    adv = advantages.to(dtype)
    d = div.to(dtype)
    drop_pos = (adv > 0) & (pi_lp > mu_lp) & (d > delta_high)
    drop_neg = (adv < 0) & (pi_lp < mu_lp) & (d > delta_low)
    return (~(drop_pos | drop_neg)).to(torch.float32)


# ---------------------------------------------------------------------------------------------------------------------
# Eq. 11: the DPPO objective
# ---------------------------------------------------------------------------------------------------------------------


def ratio_coefficient(pi_logps: Tensor, mu_logps: Tensor, ratio_cap: float = DEFAULT_RATIO_CAP) -> Tensor:
    """The truncated importance ratio min(π/μ, C) of eq. 11, computed as exp(min(log π - log μ, log C)).

    Never overflows. `ratio_cap = inf` means no cap; the ratio is then clamped at the dtype's largest finite value.
    π = 0 gives 0 (also when μ = 0), μ = 0 < π gives C. NaN inputs give NaN. Not detached: callers detach.
    """
    if not ratio_cap > 0:
        raise ValueError(f"`ratio_cap` must be > 0, got {ratio_cap}.")
    log_r = log_ratio(pi_logps, mu_logps, compute_dtype(pi_logps, mu_logps))
    if math.isfinite(ratio_cap):
        log_r = log_r.clamp(max=math.log(ratio_cap))
    return exp_clamped(log_r)


@torch.no_grad()
def dppo_coefficient(
    pi_logps: Tensor,
    mu_logps: Tensor,
    advantages: Tensor,
    divergence: str = "binary_tv",
    delta_low: float | None = None,
    delta_high: float | None = None,
    ratio_cap: float = DEFAULT_RATIO_CAP,
    pi_topk_logps: Tensor | None = None,
    mu_topk_logps: Tensor | None = None,
    div: Tensor | None = None,
    mask_logps: Tensor | None = None,
) -> Tensor:
    """Eq. 11. DPPO's per-token loss is

        loss_t = −A_t · sg(min(π/μ, C) · M_t) · log π(y_t),

    so its gradient is `−A_t · w_t · ∇log π(y_t)` with the detached coefficient returned here:

        w_t = min(π/μ, C) · M_t,    M_t from eq. 12 on D(π, μ) of eqs. 13-16.

    μ is the behavior policy itself (the engine that sampled) in both the ratio and the mask, never a recomputed
    π_old. δ defaults to the authors' values (0.15 TV, 0.05 KL); C to `DEFAULT_RATIO_CAP` (the config's default).
    Every baseline trust region in `dppo_trl.core.baselines` returns a coefficient of the same form.

    `div`, when given, is D of `divergence` already computed by the caller (`dppo_trl.core.loss.policy_loss`
    computes it once per loss call for the mask, the metrics and the observers); the top-K tensors are then not
    needed. `mask_logps` moves the mask's anchor from μ to another policy (the `dppo_decoupled` ablation takes it
    against π_old); the ratio stays π/μ.
    """
    delta_low = default_delta(divergence) if delta_low is None else delta_low
    delta_high = default_delta(divergence) if delta_high is None else delta_high
    anchor = mu_logps if mask_logps is None else mask_logps
    if div is None:
        div = compute_divergence(divergence, pi_logps, anchor, pi_topk_logps, mu_topk_logps)
    keep = trust_region_mask(pi_logps, anchor, advantages, div, delta_low, delta_high)
    return ratio_coefficient(pi_logps, mu_logps, ratio_cap) * keep.to(div.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# The μ-KL penalty (prime-rl's `kl_tau`)
# ---------------------------------------------------------------------------------------------------------------------


def mu_kl_penalty(pi_logps: Tensor, mu_logps: Tensor, coef: float) -> Tensor:
    """Per-token penalty `τ · (log π(y_t) − log μ(y_t))²` pulling π back toward the behavior policy μ.

    prime-rl adds it next to its DPPO-style mask (`kl_tau`, default 1e-3 there). Its gradient is
    `2τ · (log π − log μ) · ∇log π`, whatever the advantage: unlike the trust-region coefficient it also acts on
    A = 0 tokens, so it is an additive term of the per-token loss, not part of `−A · w`. Keeps `pi_logps`' graph;
    μ is detached. Computed in float32 (float64 for float64 inputs); NaN μ gives NaN (callers select valid tokens
    with `torch.where`, never by multiplying).
    """
    dtype = compute_dtype(pi_logps, mu_logps)
    log_ratio = pi_logps.to(dtype) - mu_logps.detach().to(dtype)
    return coef * log_ratio.square()


# ---------------------------------------------------------------------------------------------------------------------
# Truncated sampling: π over the engine's kept set
# ---------------------------------------------------------------------------------------------------------------------


def kept_log_mass(logps_at_ids: Tensor, kept: Tensor) -> Tensor:
    """log Σ_{k ∈ kept} π(k): the log of the probability π gives the tokens the engine's sampler kept.

    `logps_at_ids` `(..., J)` are π's full-softmax log-probs at the engine's listed ids, `kept` `(..., J)` bool marks
    the ids the sampler kept (top-k / top-p / min-p survivors, the sampled token among them). Then

        log π_kept(y) = log π(y) − kept_log_mass,

    the renormalised π the engine's processed log-prob μ_kept is to be compared with. Differentiable (the gradient
    flows through every kept id's log-prob); a row with no kept id gives 0 (and a zero gradient), never NaN.
    """
    dtype = compute_dtype(logps_at_ids)
    any_kept = kept.any(-1, keepdim=True)
    # Rows without a kept id take finite stand-ins, so neither the value nor the gradient of logsumexp is NaN there.
    masked = torch.where(kept, logps_at_ids.to(dtype), torch.full((), -math.inf, dtype=dtype, device=kept.device))
    masked = torch.where(any_kept, masked, torch.zeros((), dtype=dtype, device=kept.device))
    return torch.where(
        any_kept.squeeze(-1), torch.logsumexp(masked, dim=-1), torch.zeros((), dtype=dtype, device=kept.device)
    )


def restrict_topk_to_kept(pi_topk_logps: Tensor, mu_topk_logps: Tensor, log_mass: Tensor) -> Tensor:
    """π's top-K lists `(..., J)` as π_kept: `log π(k) − log_mass` where μ lists a kept token (finite), `-inf` (a
    probability of 0, like μ's) at ids the sampler dropped. μ's lists are the engine's processed log-probs, already
    renormalised over the kept set, so the top-K divergences then compare two distributions over the same support."""
    dtype = compute_dtype(pi_topk_logps, mu_topk_logps)
    kept = torch.isfinite(mu_topk_logps)
    shifted = pi_topk_logps.to(dtype) - log_mass.to(dtype).unsqueeze(-1)
    return torch.where(kept, shifted, torch.full((), -math.inf, dtype=dtype, device=shifted.device))


# ---------------------------------------------------------------------------------------------------------------------
# μ as the engine reports it
# ---------------------------------------------------------------------------------------------------------------------


def sanitize_behavior_logps(mu_logps: Tensor) -> tuple[Tensor, Tensor]:
    """`(μ, valid)` as the loss may use them: valid where μ is a log-probability (finite, ≤ `LOGP_ROUNDING`).

    Invalid entries (NaN, ±inf, clearly positive: values no engine can mean as a probability) become 0 and are
    reported in `valid` so the loss gives them weight 0 and counts them; rounding above 0 is read as log 1. float32
    out. Idempotent, so every consumer can apply it to whatever batch it is given.
    """
    mu_logps = mu_logps.float()
    valid = torch.isfinite(mu_logps) & (mu_logps <= LOGP_ROUNDING)
    return torch.where(valid, mu_logps.clamp(max=0.0), torch.zeros_like(mu_logps)), valid
