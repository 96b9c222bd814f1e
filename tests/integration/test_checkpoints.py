"""Checkpoints are complete or clearly not, a resume from the last complete one reproduces the uninterrupted run, and a
resume inside a generation batch says so. Real DPPOTrainer runs: transformers generation here, vLLM colocate below."""

import json
import os
import warnings

import pytest
import torch
from trainer_setup import logged, make_trainer
from transformers.trainer_utils import get_last_checkpoint

from dppo_trl import DPPOTrainer
from dppo_trl.hardening.checkpoints import (
    GenerationCycleResumeCheck,
    generation_cycle_offset,
    latest_complete_checkpoint,
    resume_offset_message,
    save_steps_hint,
    scan_checkpoints,
)
from dppo_trl.trainers.config import DPPOConfig

SAVES = dict(save_strategy="steps", save_steps=2, max_steps=4, logging_steps=1)
# What a resume must reproduce: the loss and the reward of every step after the checkpoint.
RESUME_KEYS = ("loss", "reward", "dppo/mask_ratio")
VLLM = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64)


def _after(trainer, step: int) -> dict[str, list[float]]:
    rows = [e for e in trainer.state.log_history if e.get("step", 0) > step and "loss" in e]
    return {key: [e[key] for e in rows] for key in RESUME_KEYS}


def _interrupt_save_at(monkeypatch, step: int) -> None:
    """Raise KeyboardInterrupt (what Ctrl-C raises) inside the Trainer's own save of `checkpoint-<step>`, after the
    model is written and before the optimizer is."""
    original = DPPOTrainer._save_optimizer_and_scheduler

    def save_optimizer_and_scheduler(self, output_dir):
        if self.state.global_step == step:
            raise KeyboardInterrupt
        return original(self, output_dir)

    monkeypatch.setattr(DPPOTrainer, "_save_optimizer_and_scheduler", save_optimizer_and_scheduler)


def _interrupted_then_resumed(model_dir, tmp_path, monkeypatch, **config):
    """Uninterrupted run; the same run interrupted while saving checkpoint-4; a resume from the newest complete one."""
    reference = make_trainer(model_dir, tmp_path / "reference", **SAVES, **config)
    reference.train()

    out = tmp_path / "interrupted"
    with monkeypatch.context() as patch:
        _interrupt_save_at(patch, 4)
        with pytest.raises(KeyboardInterrupt):
            make_trainer(model_dir, out, **SAVES, **config).train()
    return reference, out


def _check_interrupted_folder(out) -> str:
    # The interrupted save left no `checkpoint-4`: only the clearly named staging folder, and it holds a model.
    assert sorted(os.listdir(out)) == ["README.md", "_incomplete-checkpoint-4", "checkpoint-2"]
    assert os.path.exists(out / "_incomplete-checkpoint-4" / "checkpoint-4" / "model.safetensors")
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")  # transformers' own pick is complete
    complete, incomplete = scan_checkpoints(str(out))
    assert complete == [str(out / "checkpoint-2")] and incomplete == [str(out / "_incomplete-checkpoint-4")]
    return latest_complete_checkpoint(str(out))


def test_checkpoints_are_renamed_into_place_when_complete(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, **SAVES, save_total_limit=1)
    trainer.train()
    assert sorted(os.listdir(tmp_path)) == ["README.md", "checkpoint-4"]  # rotation still applies
    files = set(os.listdir(tmp_path / "checkpoint-4"))
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= files


def test_best_checkpoint_points_at_the_final_name(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, **SAVES, save_only_model=True)
    # What `metric_for_best_model` leaves before the save of a new best step.
    trainer.state.global_step = trainer.state.best_global_step = 2
    trainer._save_checkpoint(trainer.model, trial=None)
    final = str(tmp_path / "checkpoint-2")
    assert trainer.state.best_model_checkpoint == final
    assert json.load(open(os.path.join(final, "trainer_state.json")))["best_model_checkpoint"] == final
    assert not any(name.startswith("_incomplete") for name in os.listdir(tmp_path))


def test_interrupted_save_then_exact_resume_transformers(tiny_model_dir, tmp_path, monkeypatch):
    reference, out = _interrupted_then_resumed(tiny_model_dir, tmp_path, monkeypatch)
    checkpoint = _check_interrupted_folder(out)

    resumed = make_trainer(tiny_model_dir, out, **SAVES)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a resume on a generation boundary is silent
        resumed.train(resume_from_checkpoint=checkpoint)
    assert _after(resumed, 2) == _after(reference, 2)
    assert len(_after(resumed, 2)["loss"]) == 2
    # The re-save of step 4 replaced the staging folder with a complete checkpoint.
    assert sorted(p for p in os.listdir(out) if "checkpoint" in p) == ["checkpoint-2", "checkpoint-4"]


@pytest.mark.vllm
@pytest.mark.slow
def test_interrupted_save_then_exact_resume_vllm_colocate(tiny_model_dir, tmp_path, monkeypatch, master_port):
    reference, out = _interrupted_then_resumed(tiny_model_dir, tmp_path, monkeypatch, **VLLM)
    checkpoint = _check_interrupted_folder(out)
    resumed = make_trainer(tiny_model_dir, out, **SAVES, **VLLM)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert _after(resumed, 2) == _after(reference, 2)
    assert len(_after(resumed, 2)["loss"]) == 2


# --- generation cycles --------------------------------------------------------------------------------------------
def _args(**overrides) -> DPPOConfig:
    values = dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4)
    values.update(num_generations=4, **overrides)
    return DPPOConfig(**values)


def test_generation_cycle_arithmetic():
    # steps_per_generation=4, GA=1: a generation every 4 optimizer steps.
    args = _args(steps_per_generation=4)
    assert [generation_cycle_offset(s, args) for s in range(6)] == [0, 1, 2, 3, 0, 1]
    # GA=2, steps_per_generation=2, num_iterations=2: 4 micro-steps = 2 optimizer steps per generation.
    args = _args(gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=2)
    assert [generation_cycle_offset(s, args) for s in range(4)] == [0, 2, 0, 2]
    assert save_steps_hint(_args(steps_per_generation=4, save_strategy="steps", save_steps=8)) is None
    assert save_steps_hint(_args(save_strategy="steps", save_steps=3)) is None  # default: one step per generation
    hint = save_steps_hint(_args(steps_per_generation=4, save_strategy="steps", save_steps=6))
    assert "save_steps=6 is not a multiple of the generation cycle (4 optimizer steps" in hint
    assert resume_offset_message(4, _args(steps_per_generation=4)) is None
    assert "2 of 4 micro-steps into a generation batch" in resume_offset_message(6, _args(steps_per_generation=4))


def test_resume_inside_a_generation_batch_warns(tiny_model_dir, tmp_path):
    inside = dict(SAVES, steps_per_generation=2, save_steps=1, max_steps=2, per_device_train_batch_size=2)
    with pytest.warns(UserWarning, match="save_steps=1 is not a multiple of the generation cycle"):
        make_trainer(tiny_model_dir, tmp_path, **inside).train()
    resumed = make_trainer(tiny_model_dir, tmp_path, **inside)
    assert any(isinstance(cb, GenerationCycleResumeCheck) for cb in resumed.callback_handler.callbacks)
    with pytest.warns(UserWarning, match="Resuming at step 1, 1 of 2 micro-steps into a generation batch"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert all(torch.isfinite(torch.tensor(logged(resumed, "loss"))))


# --- two ranks (torchrun, DDP on gloo) ----------------------------------------------------------------------------
_DDP_SCRIPT = """
from dppo_dev.offline import set_offline_env
set_offline_env()
from trainer_setup import make_trainer
trainer = make_trainer({model!r}, {out!r}, save_strategy="steps", save_steps=1, max_steps=2, logging_steps=1)
trainer.train()
"""


@pytest.mark.slow
def test_two_ranks_write_into_the_staged_checkpoint_before_it_is_renamed(tiny_model_dir, tmp_path, free_port):
    """Every rank writes its RNG state into the checkpoint; the rename waits for all of them."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "out"
    script = tmp_path / "train.py"
    script.write_text(_DDP_SCRIPT.format(model=tiny_model_dir, out=str(out)))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    # `trainer_setup` lives in tests/: the ranks find it through their environment, as pytest does through its own.
    paths = [os.path.join(root, "tests"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    result = subprocess.run(
        command + [str(free_port), str(script)], capture_output=True, text=True, timeout=600, cwd=root, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p for p in os.listdir(out) if "checkpoint" in p) == ["checkpoint-1", "checkpoint-2"]
    for step in (1, 2):
        files = set(os.listdir(out / f"checkpoint-{step}"))
        assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "model.safetensors"} <= files
