"""How both trainers log the `dppo/*` metrics of a loss call: one sum and one max collective over processes."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dppo_trl.core.metrics import trust_region_metrics
from dppo_trl.trainers.trl116 import PARENT_CLIP_METRICS


def log_trust_region_metrics(trainer: Any, stats: dict[str, Tensor], mode: str) -> None:
    """Reduce a loss call's `stats` across `trainer.accelerator`'s processes into `trainer._metrics[mode]`, and drop the
    parent's ratio-clip metrics (always 0 once the clip is replaced by the trust region)."""
    accelerator = trainer.accelerator
    metrics = trust_region_metrics(
        stats,
        reduce_sum=lambda t: accelerator.reduce(t, reduction="sum"),
        reduce_max=lambda t: accelerator.gather(t).view(-1, t.numel()).max(dim=0).values,
    )
    sink = trainer._metrics[mode]
    for key in PARENT_CLIP_METRICS:
        sink.pop(key, None)
    for key, value in metrics.items():
        sink[key].append(value)
