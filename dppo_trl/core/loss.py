"""DPPO's loss, written once: one loss call's per-token tensors in, its per-token loss terms and stats out.

    outputs = policy_loss(spec, LossInputs(pi_logps=..., mu_logps=..., advantages=..., tokens=..., valid=...))

For each counted completion token t (a loss token whose μ the engine reported validly):

    D_t    = D(π, μ)                                        eqs. 13-16  (`functional.compute_divergence`)
    M_t    = trust-region mask on D_t, A_t, sign(π − μ)      eq. 12      (inside the registry entry)
    w_t    = sg(min(π/μ, C) · M_t)                           eq. 11      (`TRUST_REGIONS[spec.trust_region]`)
    loss_t = −A_t · w_t · exp(log π − sg(log π))             value −A_t·w_t, gradient −A_t·w_t·∇log π (eq. 11)
    kl_t   = τ · (log π − log μ)²                            the optional μ-KL term (`mu_kl_coef`)

With truncated sampling (top-k / top-p / min-p) μ is the engine's log-prob renormalised over the tokens its sampler
kept, so π is compared as π_kept(y) = π(y) / π(kept) (`LossInputs.kept_log_mass`): every π above is then π_kept, the
gradient flows through log π_kept, and positions whose kept set the engine could not list (`kept_overflow`) are left
out like an invalid μ. Without a kept set nothing here changes.

Every baseline of the registry is another `w_t` on the same path. Both trainers hand `loss_t` (and `kl_t`) to their
TRL room, which aggregates them as the parent aggregates its own policy term (`dppo_trl.trainers.dppo_loss`,
`dppo_trl.trainers.trl116`).

Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dppo_trl.core.functional import compute_divergence, mu_kl_penalty, restrict_topk_to_kept
from dppo_trl.core.metrics import trust_region_stats
from dppo_trl.core.spec import TrustRegionSpec
from dppo_trl.core.types import CoefficientInputs, LossInputs

__all__ = ["COEF_MAX", "LossInputs", "LossOutputs", "policy_loss"]

# Coefficients are capped here: an uncapped π/μ (pg_is, minirl) can overflow the loss to inf/NaN. DPPO's own
# coefficient is already capped at `ratio_cap`.
COEF_MAX = 1e6


@dataclass(frozen=True)
class LossOutputs:
    """What one loss call produces.

    Attributes:
        policy_loss: per-token eq. 11, `−A · w · exp(log π − sg log π)`: value `−A·w`, gradient `−A·w·∇log π`; 0
            outside `counted`. Keeps π's graph.
        mu_kl: per-token `τ · (log π − log μ)²` on counted tokens (0 elsewhere), keeping π's graph; `None` when τ = 0.
        coef: the detached coefficient w (float32), 0 outside `counted`.
        divergence: D(π, μ) (float32, detached), computed once for the coefficient, the stats and the observers.
        stats: this process's 0-dim sums and maxima behind the `dppo/*` metrics (`metrics.trust_region_metrics`
            reduces them across processes).
    """

    policy_loss: Tensor
    mu_kl: Tensor | None
    coef: Tensor
    divergence: Tensor
    stats: dict[str, Tensor]


def policy_loss(spec: TrustRegionSpec, inputs: LossInputs) -> LossOutputs:
    """DPPO's per-token loss (eq. 11 with the trust region `spec.trust_region`) for one loss call."""
    compared = inputs.compared_logps
    with torch.no_grad():
        pi = compared.detach().float()
        counted = inputs.counted
        mu = inputs.mu_logps.detach().float()
        adv = inputs.token_advantages()
        name = spec.effective_divergence(inputs.has_topk)
        pi_topk, mu_topk = (inputs.pi_topk_logps, inputs.mu_topk_logps) if name.startswith("topk_") else (None, None)
        if pi_topk is not None and mu_topk is not None and inputs.kept_log_mass is not None:
            pi_topk = restrict_topk_to_kept(pi_topk, mu_topk, inputs.kept_log_mass.detach())
        divergence = compute_divergence(
            name,
            pi,
            mu,
            pi_topk.float() if pi_topk is not None else None,
            mu_topk.float() if mu_topk is not None else None,
        ).float()
        old = inputs.old_logps if spec.region.needs_old_logps else None
        coefficient_inputs = CoefficientInputs(
            pi, mu, adv, divergence, name, old_logps=old.detach().float() if old is not None else None
        )
        coef = spec.region.coefficient(coefficient_inputs, spec).float()
        coef = torch.where(counted, coef.clamp(max=max(COEF_MAX, spec.ratio_cap)), torch.zeros_like(coef))
        stats = trust_region_stats(spec, inputs, coef, divergence, name)

    pi_grad = compared.float()
    per_token = -adv * coef * torch.exp(pi_grad - pi_grad.detach())
    mu_kl = None
    if spec.mu_kl_coef > 0:
        # μ := π outside `counted` first: a NaN there would otherwise reach the gradient (0 · NaN) through `where`.
        safe_mu = torch.where(counted, mu, pi)
        mu_kl = torch.where(counted, mu_kl_penalty(pi_grad, safe_mu, spec.mu_kl_coef), torch.zeros_like(pi))
    return LossOutputs(policy_loss=per_token, mu_kl=mu_kl, coef=coef, divergence=divergence, stats=stats)
