"""`TrustRegionSpec`: the frozen, validated settings of one trust region, built from either trainer's config."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from dppo_trl.core.functional import DIVERGENCES, default_delta
from dppo_trl.core.registry import TRUST_REGIONS, TrustRegion
from dppo_trl.core.types import TrustRegionSettings


@dataclass(frozen=True)
class TrustRegionSpec(TrustRegionSettings):
    """Everything a loss call needs to know about the trust region (the coefficient's `TrustRegionSettings` and the
    rest); `None` δs resolve to the authors' values.

    The field names are the configs' (`DPPOConfig`, `AsyncDPPOConfig`; docs/api.md documents each), so
    `TrustRegionSpec.from_config(args)` reads them by name. Construction validates, with the message a user of
    either config sees.
    """

    trust_region: str = "dppo"
    divergence_top_k: int = 20
    mu_kl_coef: float = 0.0
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence={self.divergence!r} is not supported; choose one of {list(DIVERGENCES)}.")
        for name in ("delta_low", "delta_high"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0 (got {value}); `None` picks the authors' value.")
            if value is None:
                object.__setattr__(self, name, default_delta(self.divergence))
        if not (math.isfinite(self.ratio_cap) and self.ratio_cap >= 1.0):
            raise ValueError(
                f"ratio_cap must be finite and ≥ 1 (got {self.ratio_cap}). To run with the cap effectively off as "
                "the authors did, use a large finite value such as 1e4."
            )
        if not (math.isfinite(self.mu_kl_coef) and self.mu_kl_coef >= 0.0):
            raise ValueError(
                f"mu_kl_coef must be finite and ≥ 0 (got {self.mu_kl_coef}); 0.0 turns the μ-KL term off."
            )
        if self.trust_region not in TRUST_REGIONS:
            raise ValueError(
                f"trust_region={self.trust_region!r} is not supported; choose one of {list(TRUST_REGIONS)}."
            )
        if not self.region.uses_top_k and self.uses_top_k:
            raise ValueError(
                f"trust_region={self.trust_region!r} is a sampled-token baseline; it does not use μ's top-K. Use "
                "divergence='binary_tv' or 'binary_kl' with it."
            )
        if not 0.0 < self.relax_alpha <= 1.0:
            raise ValueError(f"relax_alpha must be in (0, 1], got {self.relax_alpha}.")
        if self.uses_top_k and self.divergence_top_k < 1:
            raise ValueError(f"divergence_top_k must be ≥ 1 for divergence={self.divergence!r}.")

    @classmethod
    def from_config(cls, config: Any) -> TrustRegionSpec:
        """The spec of a `DPPOConfig` or `AsyncDPPOConfig` (fields read by name; those a config lacks keep their
        default, e.g. `max_staleness` of the synchronous trainer)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(config, name) for name in names if hasattr(config, name)})

    @property
    def region(self) -> TrustRegion:
        """The registry entry of `trust_region`."""
        return TRUST_REGIONS[self.trust_region]

    @property
    def uses_top_k(self) -> bool:
        """Whether the divergence needs μ's top-K log-probs (eqs. 15-16)."""
        return self.divergence.startswith("topk_")

    def effective_divergence(self, has_topk: bool) -> str:
        """The divergence a loss call computes: `divergence`, or its binary form when a top-K divergence has no top-K
        lists (on-policy, μ ≡ π: both forms give D = 0 exactly)."""
        if self.uses_top_k and not has_topk:
            return self.divergence.replace("topk_", "binary_")
        return self.divergence
