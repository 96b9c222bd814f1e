"""The trust regions `DPPOConfig.trust_region` can select: DPPO (the default) and the paper's ablation baselines.

This table is the only list of them. Config validation, the trainer's dispatch, the table in docs/api.md and the
sanity benchmark's method list all read it. Adding a baseline is one coefficient function (same form as
`dppo_coefficient`: `−A · w · ∇log π`) plus one entry here, plus its test.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import Tensor

from dppo_trl.core.baselines import (
    cispo_coefficient,
    dppo_decoupled_coefficient,
    grpo_clip_coefficient,
    minirl_coefficient,
    pg_is_coefficient,
    relaxed_clip_coefficient,
)
from dppo_trl.core.divergence import dppo_coefficient

_DPPO_FIELDS = {"divergence": "divergence", "delta_low": "delta_low", "delta_high": "delta_high"}
_CLIP_FIELDS = {"eps_low": "epsilon", "eps_high": "epsilon"}


@dataclass(frozen=True)
class TrustRegion:
    """One selectable trust region.

    Attributes:
        coefficient: `(pi_logps, mu_logps, advantages, [old_logps], [div], **kwargs) -> w`, the detached
            per-token coefficient of `−A · w · ∇log π`.
        summary: one line for the docs and the config's help.
        config_fields: coefficient keyword → `DPPOConfig` field it is read from.
        fixed: coefficient keywords that are constants of this entry.
        needs_old_logps: takes π_old (the trainer's recompute of the generating weights) as `old_logps`.
        uses_top_k: accepts `pi_topk_logps`/`mu_topk_logps` (the top-K divergences); the others are sampled-token
            methods and reject `divergence='topk_*'`.
        takes_divergence: accepts `div`, the divergence D(π, μ) of `DPPOConfig.divergence` precomputed by
            `dppo_trl.core.objective.trust_region_coefficient` (computed once per loss call, also used by the metrics).
    """

    coefficient: Callable[..., Tensor]
    summary: str
    config_fields: Mapping[str, str] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    needs_old_logps: bool = False
    uses_top_k: bool = False
    takes_divergence: bool = False

    def kwargs(self, config: Any) -> dict[str, Any]:
        """Keyword arguments of `coefficient` for this config."""
        return {**self.fixed, **{name: getattr(config, source) for name, source in self.config_fields.items()}}


TRUST_REGIONS: Mapping[str, TrustRegion] = MappingProxyType(
    {
        "dppo": TrustRegion(
            dppo_coefficient,
            "DPPO (eqs. 11-12): min(π/μ, C) · M, M masks moves away from μ with D > δ",
            {**_DPPO_FIELDS, "ratio_cap": "ratio_cap"},
            uses_top_k=True,
            takes_divergence=True,
        ),
        "grpo_clip": TrustRegion(grpo_clip_coefficient, "GRPO/PPO ratio clip on r = π/μ, ε = `epsilon`", _CLIP_FIELDS),
        "clip_higher": TrustRegion(
            grpo_clip_coefficient,
            "Clip-Higher (DAPO): GRPO clip with ε_high = 0.28",
            {"eps_low": "epsilon"},
            {"eps_high": 0.28},
        ),
        "cispo": TrustRegion(cispo_coefficient, "CISPO: truncated IS min(π/μ, 5), no mask"),
        "pg_is": TrustRegion(pg_is_coefficient, "importance-weighted policy gradient π/μ, no trust region"),
        "minirl": TrustRegion(
            minirl_coefficient,
            "MiniRL: clip on π/π_old, IS weight π_old/μ",
            _CLIP_FIELDS,
            needs_old_logps=True,
        ),
        "dppo_decoupled": TrustRegion(
            dppo_decoupled_coefficient,
            "DPPO with the mask taken against π_old instead of μ",
            {**_DPPO_FIELDS, "ratio_cap": "ratio_cap"},
            needs_old_logps=True,
        ),
        **{
            f"relax_{side}": TrustRegion(
                relaxed_clip_coefficient,
                f"GRPO clip with the {label} removed for tokens with μ < `relax_alpha` (our reading of §6)",
                {**_CLIP_FIELDS, "alpha": "relax_alpha"},
                {"relax": side},
            )
            for side, label in (("low", "A<0 clip"), ("high", "A>0 clip"), ("both", "clips"))
        },
    }
)


def trust_region_table() -> str:
    """Markdown table of `TRUST_REGIONS` (docs/api.md embeds it; a test keeps the two equal)."""
    rows = ["| `trust_region` | coefficient w | needs π_old | top-K |", "|---|---|---|---|"]
    for name, entry in TRUST_REGIONS.items():
        needs_old = "yes" if entry.needs_old_logps else "no"
        rows.append(f"| `{name}` | {entry.summary} | {needs_old} | {'yes' if entry.uses_top_k else 'no'} |")
    return "\n".join(rows)
