"""The core's plain data types, in one module every other core module may import (no import circles).

`LossInputs` is what a trainer hands `dppo_trl.core.loss.policy_loss`; `CoefficientInputs` and `TrustRegionSettings`
are what a registry entry (`dppo_trl.core.registry`) reads; `TrustRegionSpec` (`dppo_trl.core.spec`) extends the
settings with the rest of the trust region and validates them. Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from dppo_trl.core.functional import DEFAULT_RATIO_CAP


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
class CoefficientInputs:
    """What a coefficient sees of one loss call: detached float32 per-token tensors of one shape.

    Attributes:
        pi_logps: log π(y_t), the current policy.
        mu_logps: log μ(y_t), the behavior policy (sanitised: finite everywhere).
        advantages: A in the tokens' shape.
        divergence: D(π, μ) of `divergence_name` (eqs. 13-16), computed once per loss call.
        divergence_name: the divergence D was computed with (`TrustRegionSpec.divergence`, or its binary form when a
            loss call carries no top-K lists).
        old_logps: π_old, the trainer's recompute of the generating weights; only for `needs_old_logps` entries
            (π itself when there was no recompute: on-policy, the generating weights are the current ones).
    """

    pi_logps: Tensor
    mu_logps: Tensor
    advantages: Tensor
    divergence: Tensor
    divergence_name: str
    old_logps: Tensor | None = None


@dataclass(frozen=True)
class TrustRegionSettings:
    """The settings a coefficient of the registry reads (`TrustRegionSpec` validates them and adds the rest).

    Attributes:
        divergence: the divergence D of eqs. 13-16.
        delta_low, delta_high: the thresholds δ of eq. 12 (`None` until `TrustRegionSpec` resolves them).
        ratio_cap: C of eq. 11.
        epsilon: the clip ε of the GRPO-clip baselines.
        relax_alpha: α of the `relax_*` baselines.
    """

    divergence: str = "binary_tv"
    delta_low: float | None = None
    delta_high: float | None = None
    ratio_cap: float = DEFAULT_RATIO_CAP
    epsilon: float = 0.2
    relax_alpha: float = 0.1
