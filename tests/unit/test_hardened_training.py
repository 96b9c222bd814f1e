"""`dppo_trl.hardening.training.hardened_training`, the block both trainers' `train()` runs in, on a plain transformers
`Trainer` training a two-parameter model: a JIT checkpoint taken on SIGTERM's request ends the block in
`TrainingPreempted` naming it, a failed request to the server ends it in `VLLMServerError` naming the trainer's last
complete checkpoint, and neither leaves the JIT manager's recording or a signal handler behind. The trainers' own
SIGTERM and killed-server runs are tests/system/test_faults.py's."""

import signal
import socket

import pytest
import requests
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_jit_checkpoint import JITCheckpointCallback

from dppo_trl.hardening.preemption import PREEMPTED_EXIT_CODE, TrainingPreempted
from dppo_trl.hardening.server_failure import VLLMServerError
from dppo_trl.hardening.training import hardened_training


class _Line(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))

    def forward(self, x, labels):
        return {"loss": ((x @ self.w - labels) ** 2).mean()}


def _trainer(tmp_path, **args) -> Trainer:
    data = [{"x": torch.tensor([1.0, float(i)]), "labels": torch.tensor(float(i))} for i in range(8)]
    training_args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, save_strategy="no", report_to="none",
        use_cpu=True, logging_strategy="no", **args,
    )  # fmt: skip
    return Trainer(model=_Line(), args=training_args, train_dataset=data)


def _jit_manager(trainer):
    return next(cb.jit_manager for cb in trainer.callback_handler.callbacks if isinstance(cb, JITCheckpointCallback))


class _RequestCheckpointAtStep2(TrainerCallback):
    """What transformers' SIGTERM handler does once its grace period is over: ask for a checkpoint."""

    def __init__(self, manager):
        self.manager = manager

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.manager._enable_checkpoint()


def test_a_sigterm_checkpoint_ends_training_in_training_preempted(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    trainer = _trainer(tmp_path, enable_jit_checkpoint=True)
    manager = _jit_manager(trainer)
    trainer.add_callback(_RequestCheckpointAtStep2(manager))
    with pytest.raises(TrainingPreempted) as caught, hardened_training(trainer, server_url=None):
        assert "execute_jit_checkpoint" in vars(manager)  # recording while training runs
        trainer.train()
    assert caught.value.code == PREEMPTED_EXIT_CODE and caught.value.checkpoint == str(tmp_path / "checkpoint-2")
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").exists()
    assert "--resume_from_checkpoint" in str(caught.value)
    assert "execute_jit_checkpoint" not in vars(manager)  # the class's method again
    assert signal.getsignal(signal.SIGTERM) == before  # transformers restored it at the end of training


def test_a_failed_server_request_names_the_trainers_last_checkpoint(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens there once the socket closes
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text("{}")
    trainer = _trainer(tmp_path)
    with pytest.raises(VLLMServerError) as caught, hardened_training(trainer, url, "Bound: one request."):
        trainer.train()
        requests.get(url + "/v1/completions", timeout=5)
    error = caught.value
    assert error.url == url and error.checkpoint == str(tmp_path / "checkpoint-1")
    assert str(error).startswith(f"The vLLM server at {url} stopped answering (ConnectionError")
    assert str(error).endswith("Bound: one request.")


def test_without_a_server_or_a_signal_training_returns_and_errors_pass_through(tmp_path):
    trainer = _trainer(tmp_path)
    with hardened_training(trainer, server_url=None):
        output = trainer.train()
    assert output.global_step == 3
    with pytest.raises(ValueError, match="a reward function's bug"), hardened_training(trainer, server_url=None):
        raise ValueError("a reward function's bug")
