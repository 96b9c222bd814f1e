"""Preemption: a SIGTERM'd run saves a complete checkpoint and then says it was preempted, instead of finishing.

transformers' `enable_jit_checkpoint=True` installs a SIGTERM handler (`trainer_jit_checkpoint.CheckpointManager`):
3 s after the signal it asks for a checkpoint, which its callback writes at the next step boundary (through the
Trainer's `_save_checkpoint`, so the trainers' staged-then-renamed save applies) and then stops training. `train()`
then returns as if the run had finished, and a script goes on to save a "final" model, card and curves.

Both trainers (`DPPOTrainer`, `AsyncDPPOTrainer`) train inside `exit_on_preemption`: while `train()` runs,
`JITCheckpointRecord` notes each checkpoint transformers' handler writes; when it returns, `raise_if_preempted` turns
a recorded one into `TrainingPreempted`, a `SystemExit` with code 143 (128 + SIGTERM, what the signal's default
action would have given): the process exits non-zero unless the caller catches it, after logging the checkpoint and
the resume command. Time from SIGTERM to exit: transformers' 3 s grace period, plus the rest of the current optimizer
step (a generation, when the step starts one; for the asynchronous trainer, the wait for its samples), plus the
checkpoint save, plus what the trainer stops on its way out (the asynchronous trainer's rollout worker: TRL waits up
to 15 s, then terminates it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM


class TrainingPreempted(SystemExit):
    """Training stopped on SIGTERM after writing `checkpoint`; exits the process with code 143 unless caught."""

    def __init__(self, checkpoint: str | None, message: str):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.checkpoint = checkpoint
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass
class JITCheckpointRecord:
    """The checkpoints transformers' SIGTERM handler wrote during one `train()` call (newest last), and the handler's
    manager whose `execute_jit_checkpoint` records them."""

    checkpoints: list[str]
    manager: Any = None


def record_jit_checkpoints(trainer) -> JITCheckpointRecord | None:
    """Wrap the trainer's JIT checkpoint manager so every checkpoint it writes is recorded; None without one."""
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    manager = next(
        (cb.jit_manager for cb in trainer.callback_handler.callbacks if isinstance(cb, JITCheckpointCallback)), None
    )
    if manager is None:
        return None
    record = JITCheckpointRecord(checkpoints=[], manager=manager)
    execute = manager.execute_jit_checkpoint

    def execute_and_record():
        execute()
        record.checkpoints.append(
            os.path.join(trainer._get_output_dir(trial=None), f"checkpoint-{trainer.state.global_step}")
        )

    manager.execute_jit_checkpoint = execute_and_record  # instance attribute: shadows the method of this manager only
    return record


def resume_command(checkpoint: str) -> str:
    """This process's command line with `--resume_from_checkpoint <checkpoint>` (for scripts parsing DPPOConfig)."""
    argv = list(sys.argv)
    for i, arg in enumerate(argv):
        if arg == "--resume_from_checkpoint" and i + 1 < len(argv):
            del argv[i : i + 2]
            break
        if arg.startswith("--resume_from_checkpoint="):
            del argv[i]
            break
    launcher = [] if argv and not argv[0].endswith(".py") else [os.path.basename(sys.executable)]
    return shlex.join(launcher + argv + ["--resume_from_checkpoint", checkpoint])


def raise_if_preempted(record: JITCheckpointRecord | None, is_main_process: bool = True) -> None:
    """After `train()`: raise `TrainingPreempted` if a SIGTERM checkpoint was written (the run did not finish)."""
    if record is None or not record.checkpoints:
        return
    checkpoint = record.checkpoints[-1]
    message = (
        f"Training was preempted (SIGTERM): stopped after saving the complete checkpoint {checkpoint}. No final "
        f"model was saved. Resume with `{resume_command(checkpoint)}` (or `--resume_from_checkpoint latest` with "
        f"the examples' training scripts), or `trainer.train(resume_from_checkpoint={checkpoint!r})`."
    )
    record.checkpoints.clear()
    if is_main_process:
        logger.error(message)
        print(message, file=sys.stderr, flush=True)
    raise TrainingPreempted(checkpoint, message)


@contextlib.contextmanager
def exit_on_preemption(trainer) -> Iterator[None]:
    """Run `trainer`'s `train()` inside: a SIGTERM checkpoint written meanwhile raises `TrainingPreempted` (exit 143)
    when the block ends, instead of letting the caller go on as if training had finished.

    The record lives for this block only: the JIT manager's method is shadowed on its instance while the block runs
    and put back afterwards. Without `enable_jit_checkpoint` nothing is recorded and nothing is raised.
    """
    record = record_jit_checkpoints(trainer)
    try:
        yield
    finally:
        if record is not None:
            del record.manager.execute_jit_checkpoint  # the instance attribute; the class's method shows again
    raise_if_preempted(record, trainer.accelerator.is_main_process)
