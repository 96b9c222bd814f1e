"""How both trainers check each weight sync (`dppo_trl.core.sync_check`; docs/api.md, "Weight-sync check").

Each trainer says, at every training loss call, whether the call belongs to the first optimizer step after a sync
and hands the `fresh_rollout_sums` of its fresh tokens (sampled by the weights last synced, which the trainer still
holds: no optimizer update since the sync). `SyncCheck` adds up those sums over the optimizer step's loss calls and, at the step's last one
(`accelerator.sync_gradients`: before its backward, so before any optimizer update), reduces them over the processes,
logs `dppo/sync_mismatch` and acts on `sync_mismatch_action`: a `SyncMismatchWarning` (main process), or a
`SyncMismatchError` on every process, so that no rank is left waiting in a collective, with the step's unlogged
metrics dropped (the error carries the value).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import Tensor

from dppo_trl.core.sync_check import (
    SYNC_MISMATCH_METRIC,
    SyncMismatch,
    SyncMismatchError,
    SyncMismatchWarning,
    sync_mismatch,
    sync_mismatch_message,
    verdict,
)
from dppo_trl.hardening.checkpoints import latest_complete_checkpoint
from dppo_trl.hardening.preemption import resume_command

logger = logging.getLogger(__name__)


class SyncCheck:
    """One trainer's check of its weight syncs, reading `sync_mismatch_threshold` / `sync_mismatch_action` from the
    trainer's config `args` when it concludes. `engine_mu` False (μ is not the engine's) or the action `"off"` makes
    every call a no-op."""

    def __init__(self, args: Any, engine_mu: bool = True):
        self.args = args
        self.engine_mu = engine_mu
        self._sums_step: int | None = None  # the optimizer step whose fresh sums `_sums` holds
        self._sums: Tensor | None = None

    @property
    def enabled(self) -> bool:
        return self.engine_mu and self.args.sync_mismatch_action != "off"

    def loss_call(self, trainer: Any, sums: Tensor | None, *, fresh: bool, fresh_tokens: str) -> None:
        """One training loss call: `sums` is its `fresh_rollout_sums` (`None`: nothing fresh here). `fresh` says
        whether the call belongs to the first optimizer step after a sync and must be the same on every process (it
        decides who joins the reduction); `fresh_tokens` says in words which tokens are fresh (`SyncMismatch.fresh`,
        for the message)."""
        if not (self.enabled and fresh):
            return
        step = trainer.state.global_step
        if self._sums_step != step:  # a step left unfinished (an error elsewhere) is not mixed into this one
            self._sums_step, self._sums = step, None
        if sums is not None:
            self._sums = sums if self._sums is None else self._sums + sums
        if trainer.accelerator.sync_gradients:
            self._conclude(trainer, fresh_tokens)

    def _conclude(self, trainer: Any, fresh_tokens: str) -> None:
        accelerator = trainer.accelerator
        local = self._sums if self._sums is not None else torch.zeros(2)
        self._sums_step, self._sums = None, None
        result = sync_mismatch(accelerator.reduce(local.to(accelerator.device), reduction="sum"))
        if result is None:  # no fresh token on any process: this sync cannot be checked
            return
        value, tokens = result
        trainer._metric_sink("train")[SYNC_MISMATCH_METRIC].append(value)
        step = trainer.state.global_step + 1
        threshold = self.args.sync_mismatch_threshold
        check = SyncMismatch(value, tokens, threshold, step=step, fresh=fresh_tokens)
        action = verdict(check, self.args.sync_mismatch_action)
        if action == "warn" and accelerator.is_main_process:
            message = sync_mismatch_message(check, action)
            logger.warning(message)
            warnings.warn(message, SyncMismatchWarning, stacklevel=2)
        elif action == "raise":
            # The step ends here, unlogged: its metrics (and any of the window not yet logged) are dropped, so that a
            # later `train()` of this trainer does not average them into its first log.
            trainer._metric_sink("train").clear()
            checkpoint = latest_complete_checkpoint(trainer.args.output_dir)
            stopped = (
                f"Training stopped before the update of optimizer step {step} (computed on this rollout, never "
                f"applied): the trainer holds the weights of step {step - 1}. "
                + (
                    f"The last complete checkpoint is {checkpoint}: once the engine is fixed, resume with "
                    f"`{resume_command(checkpoint)}`, or `trainer.train(resume_from_checkpoint={checkpoint!r})`."
                    if checkpoint
                    else "No checkpoint was saved; once the engine is fixed, train again."
                )
            )
            raise SyncMismatchError(
                sync_mismatch_message(check, action, stopped),
                value=value,
                threshold=threshold,
                step=step,
                tokens=tokens,
                checkpoint=checkpoint,
            )
