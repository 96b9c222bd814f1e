"""Every weight sync checked (`DPPOConfig.sync_mismatch_*`), on the real CPU engine in TRL's colocate mode.

A sabotaged sync is made inside the engine, at its reload (`EngineReloadSabotage` of benchmarks/sync_mismatch.py,
which measures the same sabotages over more steps): from the second reload of a `train()` call on, the worker hands
vLLM's reload none of the pushed tensors (the engine keeps stale weights) or all but decoder layer 0's (one layer not
loaded). The first reload, before step 1's generation, is clean, so step 1 gives the clean reading; step 2 trains on
the first rollout sampled after the sabotaged sync, and the check must trip there. The sabotage sits at the engine's
end of the transport, so it does not depend on how the trainer streams its weights.

One trainer (one engine) serves the module; each test sets the options it needs on `trainer.args` for its `train()`
call. The asynchronous trainer's sabotage runs against the vLLM server of tests/integration/test_async_server.py.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import pytest
import torch
from safetensors.torch import load_file
from sync_mismatch import EngineReloadSabotage, build_trainer, config_values  # benchmarks/sync_mismatch.py
from trainer_setup import logged

from dppo_trl.core.sync_check import DEFAULT_SYNC_MISMATCH_THRESHOLD, SyncMismatchError, SyncMismatchWarning

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# fp32 engine and trainer: the clean reading is rounding (measured 2e-7).
CLEAN = 1e-4


@pytest.fixture(scope="module")
def trainer():
    from conftest import get_free_port

    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as tmp:
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(get_free_port()))
        # One step at this rate moves the tiny model's probabilities by ~0.4 on average (measured): the weights a
        # failed sync leaves behind are far from the trainer's.
        values = config_values("fp32", tmp, steps=2, learning_rate=1e-2)
        values.update(per_device_train_batch_size=8)
        yield build_trainer(values, n_prompts=8)


@pytest.fixture(scope="module")
def checkpoint_weights(trainer):
    return {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}


@pytest.fixture
def sabotage(trainer, checkpoint_weights):
    """Installs a sabotage on the module's engine for one test (removed afterwards); the test starts from the
    checkpoint's weights, so that what it measures does not depend on the tests before it."""
    trainer.model.load_state_dict(checkpoint_weights)
    installed = []

    def install(mode: str) -> EngineReloadSabotage:
        installed.append(EngineReloadSabotage(trainer, mode))
        return installed[-1]

    yield install
    for each in installed:
        each.remove()


def test_stale_engine_stops_training_before_the_update_of_the_first_step_after_the_sync(
    trainer, sabotage, tmp_path, monkeypatch
):
    monkeypatch.setattr(trainer.args, "sync_mismatch_action", "raise")
    monkeypatch.setattr(trainer.args, "output_dir", str(tmp_path))
    monkeypatch.setattr(trainer.args, "save_strategy", "steps")
    monkeypatch.setattr(trainer.args, "save_steps", 1)
    monkeypatch.setattr(trainer.args, "max_steps", 3)
    engine = sabotage("stale")
    with pytest.raises(SyncMismatchError) as caught:
        trainer.train()
    error = caught.value
    clean = logged(trainer, "dppo/sync_mismatch")
    print(f"stale engine: dppo/sync_mismatch step 1 (clean) {clean}, step 2 (stale) {error.value:.4g}")
    assert engine.reloads == 2 and len(clean) == 1 and clean[0] < CLEAN
    assert error.step == 2 and error.value > error.threshold == DEFAULT_SYNC_MISMATCH_THRESHOLD and error.tokens > 0
    assert "optimizer step 2" in str(error) and "stale weights" in str(error)
    # Nothing lost, nothing of the bad rollout kept: step 1's checkpoint is complete and named, no step-2 save was
    # started, and the trainer holds exactly the weights of step 1 (step 2's update was never applied).
    assert trainer.state.global_step == 1
    assert error.checkpoint == str(tmp_path / "checkpoint-1")
    assert [name for name in os.listdir(tmp_path) if "checkpoint" in name] == ["checkpoint-1"]
    assert f"resume_from_checkpoint={error.checkpoint!r}" in str(error)
    with open(os.path.join(error.checkpoint, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 1
    saved = load_file(os.path.join(error.checkpoint, "model.safetensors"))
    for name, param in trainer.model.state_dict().items():
        if name in saved:
            assert torch.equal(param, saved[name]), name


def test_missing_layer_warns_on_the_first_step_after_the_sync_and_training_goes_on(trainer, sabotage):
    engine = sabotage("missing_layer")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    values = logged(trainer, "dppo/sync_mismatch")
    print(f"one layer not loaded: dppo/sync_mismatch per step {values}")
    assert engine.reloads == 2 and trainer.state.global_step == 2
    assert len(values) == 2 and values[0] < CLEAN and values[1] > DEFAULT_SYNC_MISMATCH_THRESHOLD
    (warning,) = [w for w in caught if issubclass(w.category, SyncMismatchWarning)]
    assert "optimizer step 2" in str(warning.message) and "sync_mismatch_action='raise'" in str(warning.message)
