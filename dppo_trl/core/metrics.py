"""The `dppo/*` metrics, defined once: per-process sums and maxima of one loss call (`trust_region_stats`, called by
`dppo_trl.core.loss.policy_loss`), reduced across processes with one sum and one max collective
(`trust_region_metrics`), and the per-token record research observers receive (`observer_record`).

docs/api.md ("Metrics") documents each name. Imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from dppo_trl.core.functional import binary_kl
from dppo_trl.core.spec import TrustRegionSpec
from dppo_trl.core.types import LossInputs

# Guard for exp(log π − log μ) in the metrics only (the coefficient itself is computed overflow-free).
_LOG_RATIO_METRIC_MAX = 80.0


def _bucket(staleness: Tensor, shape: torch.Size) -> Tensor:
    staleness = staleness.long()
    if staleness.dim() == 1 and len(shape) == 2:
        staleness = staleness.unsqueeze(-1)  # one value per sequence
    return staleness.expand(shape)


@torch.no_grad()
def sampled_token_mismatch(view: LossInputs) -> Tensor:
    """|π − μ| of each sampled token, in probability (float32, detached): π as compared with μ (π_kept under
    truncated sampling), 0 at tokens that are not counted (`view.counted`)."""
    pi = view.compared_logps.detach().float()
    mu = torch.where(view.counted, view.mu_logps.detach().float(), pi)  # no NaN of an uncounted token anywhere
    return (pi.exp() - mu.exp()).abs()


@torch.no_grad()
def trust_region_stats(
    spec: TrustRegionSpec, view: LossInputs, coef: Tensor, divergence: Tensor, divergence_name: str
) -> dict[str, Tensor]:
    """This process's 0-dim sums (`sum/…` keys) and maxima (`max/…` keys) behind the `dppo/*` metrics.

    Token sums run over counted tokens with a valid μ (`view.counted`); `sum/tokens_all` and `sum/invalid` count
    every loss token and those with an invalid μ. Under truncated sampling π is π_kept (`view.compared_logps`) and
    `sum/kept_overflow` counts the loss tokens whose kept set the engine could not list. With `spec.mu_kl_coef > 0`, `sum/mu_kl` is Σ (log π − log μ)².

    When `view.staleness` is set, each staleness value s in `0..max_staleness` gets three sums:
    `sum/staleness_{s}/tokens`, `sum/staleness_{s}/masked` (tokens with coef = 0) and `sum/staleness_{s}/mismatch`
    (Σ |π − μ|); larger values land in the last bucket. Every process must use the same bound (the keys are reduced
    in order): `spec.max_staleness`, the trainer's (`AsyncGRPOConfig.max_staleness`); `None` uses this call's own
    maximum (one process only).
    """
    pi = view.compared_logps.detach().float()
    counted = view.counted
    mu = torch.where(counted, view.mu_logps.detach().float(), pi)  # no NaN of an uncounted token in any sum
    adv = view.token_advantages()
    tokens = counted.float()
    zero = torch.zeros_like(pi)
    masked = (~(coef > 0)).float() * tokens
    pos, neg = tokens * (adv > 0), tokens * (adv < 0)
    mu_p = mu.exp()
    mismatch = sampled_token_mismatch(view)
    log_ratio = pi - mu
    ratio = torch.exp(log_ratio.clamp(max=_LOG_RATIO_METRIC_MAX))
    # binary KL is D itself when it is the configured divergence: no second computation.
    kl = divergence if divergence_name == "binary_kl" else binary_kl(pi, mu)
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
        "sum/capped": ((log_ratio > math.log(spec.ratio_cap)).float() * tokens).sum(),
        "sum/masked_mu_prob": (mu_p * masked).sum(),
        "max/divergence": torch.where(counted, divergence, zero).max(),
        "max/mismatch": torch.where(counted, mismatch, zero).max(),
        "max/ratio": torch.where(counted, ratio, zero).max(),
    }
    if view.entropies is not None:
        stats["sum/masked_entropy"] = (view.entropies.detach().float() * masked).sum()
    if view.kept_overflow is not None:
        stats["sum/kept_overflow"] = (view.tokens.bool() & view.kept_overflow.bool()).float().sum()
    if spec.mu_kl_coef > 0:
        stats["sum/mu_kl"] = torch.where(counted, log_ratio.square(), zero).sum()
    if view.staleness is not None:
        staleness = _bucket(view.staleness, pi.shape)
        max_staleness = spec.max_staleness
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
    if "sum/kept_overflow" in sums:
        metrics["dppo/kept_set_overflow_ratio"] = ratio("kept_overflow", "tokens_all")
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


def observer_record(view: LossInputs, coef: Tensor, divergence: Tensor) -> dict[str, Tensor | None]:
    """The per-token dict `trust_region_observers` receive (trainers add `completion_ids` and `mode`): `valid`
    (counted tokens with a valid μ), `keep` (1 kept / 0 masked), `pi_logps` (π as compared with μ: π_kept under
    truncated sampling), `pi_full_logps` (the full softmax), `mu_logps`, `advantages` (`(B, T)`), `divergence`,
    `entropies`, `staleness`."""
    return {
        "valid": view.counted,
        "keep": (coef > 0).float(),
        "pi_logps": view.compared_logps.detach().float(),
        "pi_full_logps": view.pi_logps.detach().float(),
        "mu_logps": view.mu_logps.detach().float(),
        "advantages": view.token_advantages(),
        "divergence": divergence,
        "entropies": view.entropies.detach() if view.entropies is not None else None,
        "staleness": view.staleness,
    }
