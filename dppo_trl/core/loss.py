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

Every baseline of the registry is another `w_t` on the same path. The trainers aggregate `loss_t` (and `kl_t`) the
way their parent aggregates its policy term:

- `AsyncDPPOTrainer` adds `outputs.policy_loss` to its parent's loss as written;
- `DPPOTrainer` hands `opened_clip_weight(outputs.coef, ...)` to GRPOTrainer, whose opened-clip term `−r·A·m`
  then equals `loss_t` in value and gradient, so TRL's entropy mask, β-KL, aggregations and aux loss apply unchanged.

Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dppo_trl.core.functional import compute_divergence, mu_kl_penalty, restrict_topk_to_kept
from dppo_trl.core.metrics import trust_region_stats
from dppo_trl.core.registry import CoefficientInputs
from dppo_trl.core.spec import TrustRegionSpec

# Coefficients are capped here: an uncapped π/μ (pg_is, minirl) can overflow the loss to inf/NaN. DPPO's own
# coefficient is already capped at `ratio_cap`.
COEF_MAX = 1e6


@dataclass(frozen=True)
class LossInputs:
    """One loss call's per-token tensors, all of one token shape unless noted: `(B, T)` for `DPPOTrainer`, the packed
    `(N,)` list of `AsyncDPPOTrainer`, anything element-wise.

    Attributes:
        pi_logps: log π(y_t) of the current policy, with its graph (the loss's gradient flows through it).
        mu_logps: log μ(y_t), sanitised (`functional.sanitize_behavior_logps`: finite where valid).
        advantages: A, in the tokens' shape or one value per sequence (`(B,)`/`(B, 1)` for `(B, T)` tokens).
        tokens: bool, the completion tokens the loss counts (`completion_mask * tool_mask`).
        valid: bool, μ is valid at that token (the engine reported a finite log-prob).
        old_logps: π_old (the trainer's recompute), only for registry entries with `needs_old_logps`.
        pi_topk_logps, mu_topk_logps: `(..., K+1)` log-probs over TopK(μ) ∪ {y_t} for the top-K divergences; when
            absent under a top-K divergence, μ ≡ π is assumed and the binary form (which gives the same D = 0) is used.
        entropies: the policy's entropy per token (for `dppo/masked_entropy_mean`).
        staleness: ints in the tokens' shape (or one per sequence), policy versions between sampling and this step.
        kept_log_mass: truncated sampling only: log π(kept), the log of the probability π gives the tokens the engine's
            sampler kept at that position (`functional.kept_log_mass`), with its graph; the trust region then compares
            log π_kept = `pi_logps − kept_log_mass` with μ, and the top-K lists are restricted to the kept ids.
            `None` (untruncated sampling): π is the full softmax, bit for bit as without this field.
        kept_overflow: bool, truncated sampling only: the engine's list may not hold the whole kept set, so π_kept is
            unknown there; such tokens are not counted (weight 0, like an invalid μ) and are reported in
            `dppo/kept_set_overflow_ratio`.
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
    kept_log_mass: Tensor | None = None
    kept_overflow: Tensor | None = None

    @property
    def counted(self) -> Tensor:
        """Tokens that enter the trust region and its metrics: counted by the loss, with a valid μ and (truncated
        sampling) a kept set the engine listed in full."""
        counted = self.tokens.bool() & self.valid.bool()
        return counted if self.kept_overflow is None else counted & ~self.kept_overflow.bool()

    @property
    def compared_logps(self) -> Tensor:
        """log π as the trust region compares it with μ, with its graph: log π_kept under truncated sampling,
        `pi_logps` itself (the same tensor) otherwise."""
        if self.kept_log_mass is None:
            return self.pi_logps
        return self.pi_logps.float() - self.kept_log_mass.float()

    @property
    def has_topk(self) -> bool:
        return self.pi_topk_logps is not None and self.mu_topk_logps is not None

    def token_advantages(self) -> Tensor:
        """A in the tokens' shape, float32, detached."""
        adv = self.advantages.detach().float()
        like = self.pi_logps
        return (adv.unsqueeze(-1) if adv.dim() == 1 and like.dim() == 2 else adv).expand_as(like)


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
        kept_correction: truncated sampling only: `A · w · (L − sg L)` with `L = kept_log_mass`, value 0, gradient
            `A·w·∇log π(kept)`. An adapter whose parent already produces `−A·w·∇log π` (`DPPOTrainer`) adds it,
            aggregated like the policy term, to get eq. 11's `−A·w·∇log π_kept`. `None` without a kept set.
    """

    policy_loss: Tensor
    mu_kl: Tensor | None
    coef: Tensor
    divergence: Tensor
    stats: dict[str, Tensor]
    kept_correction: Tensor | None = None


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
    kept_correction = None
    if inputs.kept_log_mass is not None:
        log_mass = inputs.kept_log_mass.float()
        kept_correction = adv * coef * (log_mass - log_mass.detach())
    return LossOutputs(
        policy_loss=per_token,
        mu_kl=mu_kl,
        coef=coef,
        divergence=divergence,
        stats=stats,
        kept_correction=kept_correction,
    )


def opened_clip_weight(coef: Tensor, pi_logps: Tensor, parent_old_logps: Tensor) -> Tensor:
    """The weight `m` that turns GRPO's opened-clip term `−r·A·m`, `r = exp(log π − old)`, into eq. 11: `m = w / r`,
    so `−r·A·m` has value `−A·w` and gradient `−A·w·∇log π`. Detached, computed in log space (r can underflow to 0
    while 1/r overflows); 0 where `w` is 0."""
    log_r = pi_logps.detach().float() - parent_old_logps.float()
    return torch.where(coef > 0, torch.exp(torch.log(coef) - log_r), torch.zeros_like(coef))


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

    Used for the μ-KL term of `DPPOTrainer`, the one term GRPOTrainer has no per-token slot for (it must act on A = 0
    tokens, so it cannot ride on the policy weight). The normalisers of TRL 1.16, gradient-accumulation scaling
    included (`training=False`: none, as in eval):

    - `grpo`: per-sequence token mean, then the batch mean, / accumulation steps;
    - `bnpo`: token mean over the micro-batch, / accumulation steps;
    - `dr_grpo`: sum / (B · max_completion_length), / accumulation steps;
    - `dapo`: sum / (num_items_in_batch / num_processes), × steps_per_generation / accumulation steps (training);
    - `luspo`: per-sequence sum, then the batch mean, / accumulation steps.

    `tests/integration/test_mu_kl.py` pins this against GRPOTrainer's real `_compute_loss` for every supported `loss_type`.
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
