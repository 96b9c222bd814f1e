"""The check of every weight sync: the fresh rollout's mean |π − μ|, compared with a threshold.

Right after a weight sync the engine should hold the trainer's weights, so on the tokens it then samples, trained
before any further optimizer update (the *fresh rollout*), μ and π differ by the engine's rounding only: ~1e-6 in
fp32, ~1e-3 with a bf16 engine (docs/api.md, "Weight-sync check", lists the measured floors). A sync that left the
engine with other weights shows up there as a larger mismatch, by as much as those weights differ from the trainer's.

    sums = fresh_rollout_sums(loss_inputs, fresh)          # per loss call, this process
    value = sync_mismatch(reduce_sum(total of sums))       # per optimizer step, all processes
    verdict(SyncMismatch(value, ...), action)              # "ok", "warn" or "raise"

|π − μ| is the one the `dppo/*` metrics use (`dppo_trl.core.metrics.sampled_token_mismatch`); the trainers say which
loss calls and tokens are fresh and adapt the rest (`dppo_trl.trainers.sync_check`). Imports torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dppo_trl.core.metrics import sampled_token_mismatch
from dppo_trl.core.types import LossInputs

__all__ = [
    "DEFAULT_SYNC_MISMATCH_THRESHOLD",
    "SYNC_MISMATCH_ACTIONS",
    "SYNC_MISMATCH_METRIC",
    "SyncMismatch",
    "SyncMismatchError",
    "SyncMismatchWarning",
    "check_sync_mismatch_settings",
    "fresh_rollout_sums",
    "sync_mismatch",
    "sync_mismatch_message",
    "verdict",
]

SYNC_MISMATCH_ACTIONS = ("warn", "raise", "off")
SYNC_MISMATCH_METRIC = "dppo/sync_mismatch"
# Mean |π − μ| (probability of the sampled token) of a fresh rollout above which a sync is reported. Clean runs
# measured 1e-6 (fp32 engine and trainer) to 3.3e-3 (bf16 engine; up to 0.025 for a bf16 LoRA run at lr 3e-2); a
# sync that did not reach the engine measured 0.06 to 0.8 (docs/api.md, "Weight-sync check").
DEFAULT_SYNC_MISMATCH_THRESHOLD = 0.05

_LIKELY_CAUSES = (
    "the engine kept stale weights (the sync did not reach it, or it reloaded from its checkpoint)",
    "a layer or tensor was not loaded (a name the engine does not map, a tied or fused weight it skips)",
    "a dtype or quantisation mismatch (the engine's dtype, weight or fp8 KV-cache quantisation)",
    "sleep mode dropped the weights (vllm_enable_sleep_mode)",
    "a LoRA adapter the engine did not apply (merged weights not pushed, or the adapter not loaded)",
)


class SyncMismatchWarning(UserWarning):
    """A weight sync failed the check under `sync_mismatch_action="warn"` (filter it with `warnings` like any
    warning, e.g. `warnings.simplefilter("error", SyncMismatchWarning)`)."""


class SyncMismatchError(RuntimeError):
    """Training stopped because the engine's μ on the first step after a weight sync was too far from π.

    Attributes:
        value: the fresh rollout's mean |π − μ|.
        threshold: `sync_mismatch_threshold`.
        step: the optimizer step that was not taken (the trainer holds the weights of step `step − 1`).
        tokens: the fresh loss tokens the mean ran over (all processes).
        checkpoint: the last complete checkpoint of the run, `None` when none was saved.
    """

    def __init__(
        self, message: str, *, value: float, threshold: float, step: int, tokens: int, checkpoint: str | None
    ):
        super().__init__(message)
        self.value = value
        self.threshold = threshold
        self.step = step
        self.tokens = tokens
        self.checkpoint = checkpoint


@dataclass(frozen=True)
class SyncMismatch:
    """One sync's check.

    Attributes:
        value: mean |π − μ| over the fresh rollout's loss tokens (all processes).
        tokens: how many tokens that mean ran over.
        threshold: the threshold it is compared with.
        step: the optimizer step being taken on the fresh rollout (1-based, as logged).
        fresh: which tokens form the fresh rollout, in words, completing "the mean |π − μ| over N loss tokens that
            ..." (e.g. "vLLM sampled right after the weight sync that opened this step, ...").
    """

    value: float
    tokens: int
    threshold: float
    step: int
    fresh: str

    @property
    def exceeded(self) -> bool:
        return self.value > self.threshold


def check_sync_mismatch_settings(threshold: float, action: str) -> None:
    """Refuse a threshold outside (0, 1) (a mean of probability differences lies in [0, 1]) or an unknown action."""
    if action not in SYNC_MISMATCH_ACTIONS:
        raise ValueError(
            f"sync_mismatch_action={action!r} is not supported; choose one of {list(SYNC_MISMATCH_ACTIONS)} "
            "('off' turns the check of each weight sync off)."
        )
    if not (isinstance(threshold, int | float) and math.isfinite(threshold) and 0.0 < threshold < 1.0):
        raise ValueError(
            f"sync_mismatch_threshold must be a number in (0, 1), got {threshold!r}: it bounds a mean of "
            "probability differences |π − μ|. To stop checking weight syncs, set sync_mismatch_action='off'."
        )


def fresh_rollout_sums(view: LossInputs, fresh: Tensor | None = None) -> Tensor:
    """`[Σ |π − μ|, tokens]` (float32, this process) over one loss call's counted tokens (`view.counted`), or over
    those of them where `fresh` (bool, the tokens' shape; e.g. `staleness == 0`) is set. |π − μ| is the `dppo/*`
    metrics' own (`metrics.sampled_token_mismatch`: π_kept under truncated sampling)."""
    counted = view.counted if fresh is None else view.counted & fresh.bool()
    mismatch = sampled_token_mismatch(view)
    return torch.stack([torch.where(counted, mismatch, torch.zeros_like(mismatch)).sum(), counted.float().sum()])


def sync_mismatch(total: Tensor) -> tuple[float, int] | None:
    """`(mean |π − μ|, tokens)` from summed `fresh_rollout_sums`; `None` when no fresh token was counted."""
    mismatch, tokens = (float(x) for x in total.tolist())
    if tokens <= 0:
        return None
    return mismatch / tokens, int(round(tokens))


def verdict(check: SyncMismatch, action: str) -> str:
    """`"ok"`, `"warn"` or `"raise"`: what `action` does with `check`."""
    if action == "off" or not check.exceeded:
        return "ok"
    return action


def sync_mismatch_message(check: SyncMismatch, action: str, stopped: str = "") -> str:
    """The warning or error for a failed check: what was compared, the value, the threshold, the likely causes, and
    the options to change. `stopped` (raise): what became of the run, appended."""
    causes = "; ".join(f"({i}) {cause}" for i, cause in enumerate(_LIKELY_CAUSES, start=1))
    then = (
        "Set sync_mismatch_action='raise' to stop training on it"
        if action == "warn"
        else "Set sync_mismatch_action='warn' to keep training with a warning"
    )
    return (
        f"{SYNC_MISMATCH_METRIC} = {check.value:.3g} exceeds sync_mismatch_threshold = {check.threshold:g} at "
        f"optimizer step {check.step}: the mean |π − μ| over the {check.tokens} loss tokens that {check.fresh}. π is "
        "the trainer's probability of each sampled token, μ the probability the engine reported when it sampled it; "
        "right after a weight sync both come from the same weights and differ by the engine's rounding only (about "
        "1e-6 in fp32, 1e-3 with a bf16 engine), so the engine is most likely not computing with the trainer's "
        f"weights. Likely causes: {causes}. {then}, raise sync_mismatch_threshold if this mismatch is expected (e.g. "
        "a deliberately quantised engine), or set sync_mismatch_action='off'." + (f" {stopped}" if stopped else "")
    )
