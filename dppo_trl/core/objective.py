"""DPPO's trust-region core: every line of DPPO logic a trainer runs per loss call, as pure functions.

Both `DPPOTrainer` (on `GRPOTrainer`) and the asynchronous trainer (on TRL's `AsyncGRPOTrainer`) call exactly these
functions with explicit per-call inputs and differ only in how they reach their parent's loss (TRL glue):

1. build a `TokenView` of the loss call (π, μ, A, which tokens count, μ's validity, and the optional extras);
2. `trust_region_coefficient(args, view)` → `(coef, divergence)`: the detached coefficient `w` of eq. 11 (or of the
   selected ablation of `dppo_trl.core.registry.TRUST_REGIONS`) and D(π, μ) of eqs. 13-16, computed once;
3. turn `coef` into whatever the parent multiplies (`DPPOTrainer`: `parent_weight`);
4. optionally add the μ-KL term (`mu_kl_per_token`, aggregated by `aggregate_per_token_loss` exactly as the
   parent aggregates its policy term);
5. after the parent's loss: `trust_region_stats` (local sums and maxima), reduced across processes by
   `trust_region_metrics`, and `observer_record` for `trust_region_observers`.

The math itself lives in `dppo_trl.core.divergence` (eqs. 11-16 and the μ-KL penalty) and `dppo_trl.core.baselines`.

Relative to the API first agreed for this module: `trust_region_stats` takes a keyword `max_staleness` (every process
must use the same staleness buckets); added are `TokenView.counted`, `effective_divergence`, `mu_kl_per_token`,
`aggregate_per_token_loss`, `observer_record` and `COEF_MAX`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dppo_trl.core.divergence import binary_kl, compute_divergence, mu_kl_penalty
from dppo_trl.core.registry import TRUST_REGIONS

# Coefficients are capped here: an uncapped π/μ (pg_is, minirl) can overflow the loss to inf/NaN. DPPO's own
# coefficient is already capped at `ratio_cap`.
COEF_MAX = 1e6
# Guard for exp(log π − log μ) in the metrics only (the coefficient itself is computed overflow-free).
_LOG_RATIO_METRIC_MAX = 80.0


@dataclass(frozen=True)
class TokenView:
    """One loss call's per-token tensors, all `(B, T)` unless noted, detached, any float dtype.

    Every function here is element-wise over tokens, so any common shape works, e.g. the packed `(N,)` token lists
    of TRL's asynchronous trainer (then `advantages` and `staleness` are `(N,)` too); only
    `aggregate_per_token_loss` needs `(B, T)`.

    Attributes:
        pi_logps: log π(y_t) of the current policy.
        mu_logps: log μ(y_t), already sanitised (`dppo_trl.trainers.vllm_topk.sanitize_behavior_logps`: finite where valid).
        advantages: A, `(B, T)`, `(B, 1)` or `(B,)` (one value per sequence).
        tokens: bool, the completion tokens the loss counts (`completion_mask * tool_mask`).
        valid: bool, μ is valid at that token (the engine reported a finite log-prob).
        old_logps: π_old (the trainer's recompute), only for registry entries with `needs_old_logps`.
        pi_topk_logps, mu_topk_logps: `(B, T, K+1)` log-probs over TopK(μ) ∪ {y_t} for the top-K divergences; when
            absent under a top-K divergence, μ ≡ π is assumed and the binary form (which gives the same D = 0) is used.
        entropies: the policy's entropy per token (for `dppo/masked_entropy_mean`).
        staleness: `(B, T)` or `(B,)` ints, policy versions between sampling and this step (asynchronous training).
    """

    pi_logps: Tensor
    mu_logps: Tensor
    advantages: Tensor
    tokens: Tensor
    valid: Tensor
    old_logps: Tensor | None = None
    pi_topk_logps: Tensor | None = None
    mu_topk_logps: Tensor | None = None
    entropies: Tensor | None = None
    staleness: Tensor | None = None

    @property
    def counted(self) -> Tensor:
        """Tokens that enter the trust region and its metrics: counted by the loss and with a valid μ."""
        return self.tokens.bool() & self.valid.bool()


def _per_token_advantages(view: TokenView, like: Tensor) -> Tensor:
    """A in the tokens' shape, float32: `(B,)` sequence advantages of `(B, T)` tokens are one value per row."""
    adv = view.advantages.detach().float()
    return (adv.unsqueeze(-1) if adv.dim() == 1 and like.dim() == 2 else adv).expand_as(like)


def effective_divergence(args: Any, view: TokenView) -> str:
    """The divergence a loss call computes: `args.divergence`, or its binary form when a top-K divergence has no
    top-K tensors (on-policy, μ ≡ π: both forms give D = 0 exactly)."""
    if args.divergence.startswith("topk_") and (view.pi_topk_logps is None or view.mu_topk_logps is None):
        return args.divergence.replace("topk_", "binary_")
    return args.divergence


@torch.no_grad()
def trust_region_coefficient(args: Any, view: TokenView) -> tuple[Tensor, Tensor]:
    """`(coef, divergence)`: eq. 11's detached per-token coefficient and D(π, μ) of eqs. 13-16, both float32.

    `coef` is the coefficient `w` of `−A · w · ∇log π` of the trust region `args.trust_region` (DPPO:
    `min(π/μ, C) · M`), capped at `max(COEF_MAX, args.ratio_cap)` and exactly 0 where the token is not counted or μ
    is invalid. `divergence` is D of `args.divergence` between π and μ, computed once here and handed to the
    coefficient (registry entries with `takes_divergence`), the metrics and the observers.
    """
    region = TRUST_REGIONS[args.trust_region]
    pi = view.pi_logps.detach().float()
    mu = view.mu_logps.detach().float()
    adv = _per_token_advantages(view, pi)
    name = effective_divergence(args, view)
    topk = (view.pi_topk_logps.float(), view.mu_topk_logps.float()) if name.startswith("topk_") else ()
    divergence = compute_divergence(name, pi, mu, *topk).float()

    kwargs = region.kwargs(args)
    if "divergence" in kwargs:
        kwargs["divergence"] = name
    if region.needs_old_logps:
        # Without a recompute (on-policy transformers generation) the generating weights are the current ones.
        kwargs["old_logps"] = pi if view.old_logps is None else view.old_logps.detach().float()
    if region.takes_divergence:
        kwargs["div"] = divergence
    coef = region.coefficient(pi, mu, adv, **kwargs).float()
    coef = torch.where(view.counted, coef.clamp(max=max(COEF_MAX, args.ratio_cap)), torch.zeros_like(coef))
    return coef, divergence


def mu_kl_per_token(args: Any, pi_logps: Tensor, mu_logps: Tensor, counted: Tensor) -> Tensor:
    """`mu_kl_coef · (log π − log μ)²` (`dppo_trl.core.divergence.mu_kl_penalty`) on counted tokens with a valid μ, 0
    elsewhere (also where μ is NaN). Keeps `pi_logps`' graph: aggregate it with `aggregate_per_token_loss`."""
    counted = counted.bool()
    # μ := π outside `counted` first: a NaN there would otherwise reach the gradient (0 · NaN) through `where`.
    mu = torch.where(counted, mu_logps.detach().to(pi_logps.dtype), pi_logps.detach())
    penalty = mu_kl_penalty(pi_logps, mu, args.mu_kl_coef)
    return torch.where(counted, penalty, torch.zeros_like(penalty))


def aggregate_per_token_loss(
    per_token: Tensor,
    mask: Tensor,
    loss_type: str,
    *,
    max_completion_length: int,
    num_items_in_batch: Tensor | float | None = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    training: bool = True,
) -> Tensor:
    """Aggregate a `(B, T)` per-token loss exactly as `GRPOTrainer._compute_loss` aggregates its policy term.

    The normalisers of TRL 1.16, gradient-accumulation scaling included (`training=False`: none, as in eval):

    - `grpo`: per-sequence token mean, then the batch mean, / accumulation steps;
    - `bnpo`: token mean over the micro-batch, / accumulation steps;
    - `dr_grpo`: sum / (B · max_completion_length), / accumulation steps;
    - `dapo`: sum / (num_items_in_batch / num_processes), × steps_per_generation / accumulation steps (training);
    - `luspo`: per-sequence sum, then the batch mean, / accumulation steps.

    `tests/test_mu_kl.py` pins this against GRPOTrainer's real `_compute_loss` for every supported `loss_type`.
    """
    mask = mask.to(per_token.dtype)
    accumulation = gradient_accumulation_steps if training else 1.0
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_completion_length) / accumulation
    if loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError("loss_type='dapo' needs `num_items_in_batch` (the generation batch's token count).")
        items = torch.as_tensor(num_items_in_batch, dtype=per_token.dtype, device=per_token.device)
        normalizer = items.clamp(min=1.0) / num_processes
        if training:
            normalizer = normalizer * gradient_accumulation_steps / steps_per_generation
        return (per_token * mask).sum() / normalizer
    if loss_type == "luspo":
        return (per_token * mask).sum(-1).mean() / accumulation
    raise ValueError(f"aggregate_per_token_loss does not know loss_type={loss_type!r}.")


def _bucket(staleness: Tensor, shape: torch.Size) -> Tensor:
    staleness = staleness.long()
    if staleness.dim() == 1 and len(shape) == 2:
        staleness = staleness.unsqueeze(-1)  # one value per sequence
    return staleness.expand(shape)


@torch.no_grad()
def trust_region_stats(
    args: Any, view: TokenView, coef: Tensor, divergence: Tensor, *, max_staleness: int | None = None
) -> dict[str, Tensor]:
    """This process's 0-dim sums (`sum/…` keys) and maxima (`max/…` keys) behind the `dppo/*` metrics.

    Token sums run over counted tokens with a valid μ (`view.counted`); `sum/tokens_all` and `sum/invalid` count
    every loss token and those with an invalid μ. With `args.mu_kl_coef > 0`, `sum/mu_kl` is Σ (log π − log μ)².

    When `view.staleness` is set, each staleness value s in `0..max_staleness` gets three sums:
    `sum/staleness_{s}/tokens`, `sum/staleness_{s}/masked` (tokens with coef = 0) and `sum/staleness_{s}/mismatch`
    (Σ |π − μ|); larger values land in the last bucket. Every process must use the same `max_staleness` (the keys are
    reduced in order), so pass the trainer's bound (`AsyncGRPOConfig.max_staleness`); `None` uses
    `args.max_staleness` when the config has one, else this call's own maximum (one process only).
    """
    pi = view.pi_logps.detach().float()
    mu = view.mu_logps.detach().float()
    adv = _per_token_advantages(view, pi)
    counted = view.counted
    tokens = counted.float()
    zero = torch.zeros_like(pi)
    masked = (~(coef > 0)).float() * tokens
    pos, neg = tokens * (adv > 0), tokens * (adv < 0)
    pi_p, mu_p = pi.exp(), mu.exp()
    mismatch = (pi_p - mu_p).abs()
    log_ratio = pi - mu
    ratio = torch.exp(log_ratio.clamp(max=_LOG_RATIO_METRIC_MAX))
    # binary KL is D itself when it is the configured divergence: no second computation.
    kl = divergence if effective_divergence(args, view) == "binary_kl" else binary_kl(pi, mu)
    stats = {
        "sum/tokens": tokens.sum(),
        "sum/tokens_all": view.tokens.bool().float().sum(),
        "sum/invalid": (view.tokens.bool() & ~view.valid.bool()).float().sum(),
        "sum/masked": masked.sum(),
        "sum/pos": pos.sum(),
        "sum/masked_pos": (masked * pos).sum(),
        "sum/neg": neg.sum(),
        "sum/masked_neg": (masked * neg).sum(),
        "sum/divergence": torch.where(counted, divergence, zero).sum(),
        "sum/mismatch": (mismatch * tokens).sum(),
        "sum/mismatch_kl": torch.where(counted, kl.float(), zero).sum(),
        "sum/ratio": (ratio * tokens).sum(),
        "sum/capped": ((log_ratio > math.log(args.ratio_cap)).float() * tokens).sum(),
        "sum/masked_mu_prob": (mu_p * masked).sum(),
        "max/divergence": torch.where(counted, divergence, zero).max(),
        "max/mismatch": torch.where(counted, mismatch, zero).max(),
        "max/ratio": torch.where(counted, ratio, zero).max(),
    }
    if view.entropies is not None:
        stats["sum/masked_entropy"] = (view.entropies.detach().float() * masked).sum()
    if getattr(args, "mu_kl_coef", 0.0) > 0:
        stats["sum/mu_kl"] = torch.where(counted, log_ratio.square(), zero).sum()
    if view.staleness is not None:
        staleness = _bucket(view.staleness, pi.shape)
        if max_staleness is None:
            max_staleness = getattr(args, "max_staleness", None)
        if max_staleness is None:
            max_staleness = int(torch.where(counted, staleness, 0).max().item()) if counted.any() else 0
        staleness = staleness.clamp(min=0, max=max_staleness)
        for s in range(max_staleness + 1):
            in_bucket = tokens * (staleness == s)
            stats[f"sum/staleness_{s}/tokens"] = in_bucket.sum()
            stats[f"sum/staleness_{s}/masked"] = (masked * in_bucket).sum()
            stats[f"sum/staleness_{s}/mismatch"] = (mismatch * in_bucket).sum()
    return stats


def trust_region_metrics(
    stats: dict[str, Tensor],
    reduce_sum: Callable[[Tensor], Tensor],
    reduce_max: Callable[[Tensor], Tensor],
) -> dict[str, float]:
    """Reduce `trust_region_stats` across processes and return the `dppo/*` metrics (docs/api.md, "Metrics").

    `reduce_sum` / `reduce_max` take a 1-D tensor and return its element-wise sum / maximum over every process (one
    collective each; identity in a single process). Ratios are global (Σ numerator / Σ denominator over processes);
    a conditional metric (masked-token means, a staleness bucket) is returned only when its denominator is non-zero.
    Staleness metrics: `dppo/staleness_{s}/mask_ratio` and `dppo/staleness_{s}/mismatch_abs_mean`.
    """
    sum_keys = [k for k in stats if k.startswith("sum/")]
    max_keys = [k for k in stats if k.startswith("max/")]
    sums = dict(zip(sum_keys, reduce_sum(torch.stack([stats[k].float() for k in sum_keys])).tolist()))
    maxima = dict(zip(max_keys, reduce_max(torch.stack([stats[k].float() for k in max_keys])).tolist()))

    def ratio(num: str, den: str) -> float:
        return sums[f"sum/{num}"] / sums[f"sum/{den}"] if sums[f"sum/{den}"] > 0 else 0.0

    metrics = {
        "dppo/mask_ratio": ratio("masked", "tokens"),
        "dppo/mask_ratio_pos_adv": ratio("masked_pos", "pos"),
        "dppo/mask_ratio_neg_adv": ratio("masked_neg", "neg"),
        "dppo/divergence_mean": ratio("divergence", "tokens"),
        "dppo/divergence_max": maxima["max/divergence"],
        "dppo/mismatch_abs_mean": ratio("mismatch", "tokens"),
        "dppo/mismatch_abs_max": maxima["max/mismatch"],
        "dppo/mismatch_kl_mean": ratio("mismatch_kl", "tokens"),
        "dppo/ratio_mean": ratio("ratio", "tokens"),
        "dppo/ratio_max": maxima["max/ratio"],
        "dppo/ratio_capped_frac": ratio("capped", "tokens"),
        "dppo/invalid_behavior_ratio": ratio("invalid", "tokens_all"),
    }
    if sums["sum/masked"] > 0:
        metrics["dppo/masked_mu_prob_mean"] = ratio("masked_mu_prob", "masked")
        if "sum/masked_entropy" in sums:
            metrics["dppo/masked_entropy_mean"] = ratio("masked_entropy", "masked")
    if "sum/mu_kl" in sums:
        metrics["dppo/mu_kl_mean"] = ratio("mu_kl", "tokens")
    s = 0
    while f"sum/staleness_{s}/tokens" in sums:
        if sums[f"sum/staleness_{s}/tokens"] > 0:
            metrics[f"dppo/staleness_{s}/mask_ratio"] = ratio(f"staleness_{s}/masked", f"staleness_{s}/tokens")
            metrics[f"dppo/staleness_{s}/mismatch_abs_mean"] = ratio(
                f"staleness_{s}/mismatch", f"staleness_{s}/tokens"
            )
        s += 1
    return metrics


def observer_record(view: TokenView, coef: Tensor, divergence: Tensor) -> dict[str, Tensor | None]:
    """The per-token dict `trust_region_observers` receive (trainers add `completion_ids` and `mode`): `valid`
    (counted tokens with a valid μ), `keep` (1 kept / 0 masked), `pi_logps`, `mu_logps`, `advantages` (`(B, T)`),
    `divergence`, `entropies`, `staleness`."""
    pi = view.pi_logps.detach().float()
    return {
        "valid": view.counted,
        "keep": (coef > 0).float(),
        "pi_logps": pi,
        "mu_logps": view.mu_logps.detach().float(),
        "advantages": _per_token_advantages(view, pi),
        "divergence": divergence,
        "entropies": view.entropies.detach() if view.entropies is not None else None,
        "staleness": view.staleness,
    }
