"""The hardening both trainers' `train()` runs inside (`DPPOTrainer` and `AsyncDPPOTrainer` call this one function).

- SIGTERM under `enable_jit_checkpoint`: the complete checkpoint is written, then `TrainingPreempted` (exit 143)
  is raised instead of returning as if training had finished (`preemption.exit_on_preemption`);
- server mode: a dead or silent vLLM server ends training with `VLLMServerError`, naming the server, the last
  complete checkpoint and the resume command (`server_failure.stop_on_server_failure`).

The other two parts are wired where the Trainer calls them: `checkpoints.staged_checkpoint` around the parent's
`_save_checkpoint`, and `model_card.write_model_card` as `create_model_card`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dppo_trl.hardening.preemption import exit_on_preemption
from dppo_trl.hardening.server_failure import stop_on_server_failure

__all__ = ["hardened_training"]


@contextlib.contextmanager
def hardened_training(trainer, server_url: str | None, server_bound: str = "") -> Iterator[None]:
    """Run `trainer`'s parent `train()` inside. `server_url`: the vLLM server the run depends on (None: none);
    `server_bound`: how soon this trainer notices it has died, quoted in the error."""
    output_dir = trainer._get_output_dir(trial=None)
    with exit_on_preemption(trainer), stop_on_server_failure(server_url, output_dir, server_bound):
        yield
