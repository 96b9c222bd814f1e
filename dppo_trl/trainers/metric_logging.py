"""How both trainers log the `dppo/*` metrics of a loss call: one sum and one max collective over processes."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dppo_trl.core.metrics import trust_region_metrics


def log_trust_region_metrics(trainer: Any, stats: dict[str, Tensor], mode: str) -> None:
    """Reduce a loss call's `stats` across `trainer.accelerator`'s processes into the trainer's metrics of `mode`
    (`_metric_sink`, which its TRL room provides)."""
    accelerator = trainer.accelerator
    metrics = trust_region_metrics(
        stats,
        reduce_sum=lambda t: accelerator.reduce(t, reduction="sum"),
        reduce_max=lambda t: accelerator.gather(t).view(-1, t.numel()).max(dim=0).values,
    )
    sink = trainer._metric_sink(mode)
    for key, value in metrics.items():
        sink[key].append(value)
