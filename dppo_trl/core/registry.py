"""The trust regions `trust_region=` can select: DPPO (the default) and the paper's ablation baselines.

Every entry has one signature, `coefficient(tokens: CoefficientInputs, spec: TrustRegionSettings) -> w`: the detached
per-token coefficient of `−A · w · ∇log π`. `dppo_trl.core.loss.policy_loss` calls it with D already computed, so an
entry never recomputes the divergence. Adding a baseline is one decorated function here (its math in
`dppo_trl.core.baselines`) plus its test; config validation, the docs table, the dispatch and the sanity benchmark's
method list all read `TRUST_REGIONS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from torch import Tensor

from dppo_trl.core.baselines import (
    cispo_coefficient,
    dppo_decoupled_coefficient,
    grpo_clip_coefficient,
    minirl_coefficient,
    pg_is_coefficient,
    relaxed_clip_coefficient,
)
from dppo_trl.core.functional import dppo_coefficient
from dppo_trl.core.types import CoefficientInputs, TrustRegionSettings

# DAPO's Clip-Higher upper ε.
CLIP_HIGHER_EPS_HIGH = 0.28


Coefficient = Callable[[CoefficientInputs, TrustRegionSettings], Tensor]


@dataclass(frozen=True)
class TrustRegion:
    """One selectable trust region.

    Attributes:
        coefficient: `(tokens, spec) -> w`.
        summary: one line for the docs and the config's help.
        needs_old_logps: reads `tokens.old_logps` (π_old): the trainer must keep its recompute.
        uses_top_k: its mask reads D of a top-K divergence; the other entries are sampled-token methods and refuse
            `divergence='topk_*'`.
    """

    coefficient: Coefficient
    summary: str
    needs_old_logps: bool = False
    uses_top_k: bool = False


_REGISTRY: dict[str, TrustRegion] = {}


def register_trust_region(
    name: str, summary: str, *, needs_old_logps: bool = False, uses_top_k: bool = False
) -> Callable[[Coefficient], Coefficient]:
    """Register `coefficient` under `name` (import-time only: the table is frozen into `TRUST_REGIONS` below)."""

    def register(coefficient: Coefficient) -> Coefficient:
        if name in _REGISTRY:
            raise ValueError(f"trust region {name!r} is already registered")
        _REGISTRY[name] = TrustRegion(coefficient, summary, needs_old_logps, uses_top_k)
        return coefficient

    return register


@register_trust_region(
    "dppo", "DPPO (eqs. 11-12): min(π/μ, C) · M, M masks moves away from μ with D > δ", uses_top_k=True
)
def _dppo(t: CoefficientInputs, spec: TrustRegionSettings) -> Tensor:
    return dppo_coefficient(
        t.pi_logps,
        t.mu_logps,
        t.advantages,
        t.divergence_name,
        spec.delta_low,
        spec.delta_high,
        spec.ratio_cap,
        div=t.divergence,
    )


@register_trust_region("grpo_clip", "GRPO/PPO ratio clip on r = π/μ, ε = `epsilon`")
def _grpo_clip(t: CoefficientInputs, spec: TrustRegionSettings) -> Tensor:
    return grpo_clip_coefficient(t.pi_logps, t.mu_logps, t.advantages, spec.epsilon, spec.epsilon)


@register_trust_region("clip_higher", "Clip-Higher (DAPO): GRPO clip with ε_high = 0.28")
def _clip_higher(t: CoefficientInputs, spec: TrustRegionSettings) -> Tensor:
    return grpo_clip_coefficient(t.pi_logps, t.mu_logps, t.advantages, spec.epsilon, CLIP_HIGHER_EPS_HIGH)


@register_trust_region("cispo", "CISPO: truncated IS min(π/μ, 5), no mask")
def _cispo(t: CoefficientInputs, spec: TrustRegionSettings) -> Tensor:
    return cispo_coefficient(t.pi_logps, t.mu_logps, t.advantages)


@register_trust_region("pg_is", "importance-weighted policy gradient π/μ, no trust region")
def _pg_is(t: CoefficientInputs, spec: TrustRegionSettings) -> Tensor:
    return pg_is_coefficient(t.pi_logps, t.mu_logps, t.advantages)


@register_trust_region("minirl", "MiniRL: clip on π/π_old, IS weight π_old/μ", needs_old_logps=True)
def _minirl(t: CoefficientInputs, spec: TrustRegionSettings) -> Tensor:
    old = t.pi_logps if t.old_logps is None else t.old_logps
    return minirl_coefficient(t.pi_logps, t.mu_logps, t.advantages, old, spec.epsilon, spec.epsilon)


@register_trust_region("dppo_decoupled", "DPPO with the mask taken against π_old instead of μ", needs_old_logps=True)
def _dppo_decoupled(t: CoefficientInputs, spec: TrustRegionSettings) -> Tensor:
    old = t.pi_logps if t.old_logps is None else t.old_logps
    return dppo_decoupled_coefficient(
        t.pi_logps, t.mu_logps, t.advantages, old, spec.divergence, spec.delta_low, spec.delta_high, spec.ratio_cap
    )


def _register_relaxed(side: str, label: str) -> None:
    def relaxed(t: CoefficientInputs, spec: TrustRegionSettings) -> Tensor:
        return relaxed_clip_coefficient(
            t.pi_logps, t.mu_logps, t.advantages, spec.relax_alpha, side, spec.epsilon, spec.epsilon
        )

    summary = f"GRPO clip with the {label} removed for tokens with μ < `relax_alpha` (our reading of §6)"
    register_trust_region(f"relax_{side}", summary)(relaxed)


for _side, _label in (("low", "A<0 clip"), ("high", "A>0 clip"), ("both", "clips")):
    _register_relaxed(_side, _label)

TRUST_REGIONS: Mapping[str, TrustRegion] = MappingProxyType(_REGISTRY)


def trust_region_table() -> str:
    """Markdown table of `TRUST_REGIONS` (docs/api.md embeds it; a test keeps the two equal)."""
    rows = ["| `trust_region` | coefficient w | needs π_old | top-K |", "|---|---|---|---|"]
    for name, entry in TRUST_REGIONS.items():
        needs_old = "yes" if entry.needs_old_logps else "no"
        rows.append(f"| `{name}` | {entry.summary} | {needs_old} | {'yes' if entry.uses_top_k else 'no'} |")
    return "\n".join(rows)
