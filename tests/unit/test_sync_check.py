"""The weight-sync check: the fresh rollout's statistic, the decision, the message, and `SyncCheck`'s step logic.

The statistic is read from `trust_region_stats` (the sums behind `dppo/mismatch_abs_mean`), so it is checked here
against |exp(log π) − exp(log μ)| written out by hand, over the tokens the loss counts. `SyncCheck` runs against a
stand-in trainer with the four things it reads (state, accelerator, the metric sink, `args.output_dir`); the trainers'
wiring runs against the real engine and server in tests/integration/test_vllm_cpu.py and test_async_server.py.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from dppo_trl.core.loss import LossInputs, policy_loss
from dppo_trl.core.spec import TrustRegionSpec
from dppo_trl.core.sync_check import (
    DEFAULT_SYNC_MISMATCH_THRESHOLD,
    SYNC_MISMATCH_ACTIONS,
    SYNC_MISMATCH_METRIC,
    SyncMismatch,
    SyncMismatchError,
    SyncMismatchWarning,
    check_sync_mismatch_settings,
    fresh_rollout_sums,
    sync_mismatch,
    sync_mismatch_message,
    verdict,
)
from dppo_trl.trainers.sync_check import SyncCheck


def _inputs(seed: int = 0, staleness: bool = False, kept: bool = False) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    shape = (3, 5)
    pi = torch.log_softmax(torch.randn(3, 5, 7, generator=g), -1)[..., 0]
    mu = pi + 0.3 * torch.randn(shape, generator=g)
    mu = mu.clamp(max=-1e-3)
    tokens = torch.ones(shape, dtype=torch.bool)
    tokens[2, 3:] = False  # padding
    valid = torch.ones(shape, dtype=torch.bool)
    valid[0, 1] = False  # an invalid μ: not counted
    return LossInputs(
        pi_logps=pi,
        mu_logps=torch.where(valid, mu, torch.zeros_like(mu)),
        advantages=torch.tensor([1.0, -1.0, 0.5]),
        tokens=tokens,
        valid=valid,
        staleness=torch.tensor([0, 1, 0]) if staleness else None,
        kept_log_mass=torch.full(shape, -0.2) if kept else None,
        kept_overflow=torch.zeros(shape, dtype=torch.bool) if kept else None,
    )


def _by_hand(inputs: LossInputs, rows=None) -> float:
    counted = inputs.counted.clone()
    if rows is not None:
        keep = torch.zeros_like(counted)
        keep[rows] = True
        counted &= keep
    diff = (inputs.compared_logps.exp() - inputs.mu_logps.exp()).abs()
    return (diff[counted].sum() / counted.sum()).item()


@pytest.mark.parametrize("kept", [False, True], ids=["full", "pi_kept"])
def test_statistic_is_mean_abs_probability_difference_over_counted_tokens(kept):
    inputs = _inputs(kept=kept)
    value, tokens = sync_mismatch(fresh_rollout_sums(inputs))
    assert tokens == int(inputs.counted.sum())
    assert value == pytest.approx(_by_hand(inputs), rel=1e-6)
    # The same |π − μ| as `dppo/mismatch_abs_mean` over the same tokens.
    stats = policy_loss(TrustRegionSpec(), inputs).stats
    assert value == pytest.approx((stats["sum/mismatch"] / stats["sum/tokens"]).item(), rel=1e-6)


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_asynchronous_statistic_is_exactly_the_staleness_zero_tokens(max_staleness):
    """Only tokens sampled by the version being trained: not the metrics' last staleness bucket, which with
    `max_staleness=0` would also hold the staleness-1 tokens a one-step-late batch brings."""
    inputs = _inputs(staleness=True)
    fresh = (inputs.staleness == 0).unsqueeze(-1).expand_as(inputs.tokens)
    value, tokens = sync_mismatch(fresh_rollout_sums(inputs, fresh))
    assert value == pytest.approx(_by_hand(inputs, rows=[0, 2]), rel=1e-6)
    assert tokens == int(inputs.counted[[0, 2]].sum())
    stats = policy_loss(TrustRegionSpec(max_staleness=max_staleness), inputs).stats
    assert (stats["sum/staleness_0/tokens"].item() == tokens) == (max_staleness > 0)


def test_no_fresh_token_means_no_value():
    assert sync_mismatch(torch.zeros(2)) is None


@pytest.mark.parametrize("action", SYNC_MISMATCH_ACTIONS)
def test_verdict(action):
    below = SyncMismatch(0.01, 10, 0.05, step=2, fresh="x")
    at = SyncMismatch(0.05, 10, 0.05, step=2, fresh="x")
    above = SyncMismatch(0.06, 10, 0.05, step=2, fresh="x")
    assert verdict(below, action) == verdict(at, action) == "ok"  # strictly above trips
    assert verdict(above, action) == ("ok" if action == "off" else action)


@pytest.mark.parametrize(
    ("threshold", "action", "message"),
    [
        (0.05, "ignore", "sync_mismatch_action='ignore' is not supported"),
        (0.0, "warn", "must be a number in \\(0, 1\\)"),
        (1.0, "warn", "must be a number in \\(0, 1\\)"),
        (math.nan, "raise", "must be a number in \\(0, 1\\)"),
        (math.inf, "warn", "sync_mismatch_action='off'"),
    ],
)
def test_bad_settings_are_refused(threshold, action, message):
    with pytest.raises(ValueError, match=message):
        check_sync_mismatch_settings(threshold, action)


def test_both_configs_carry_and_validate_the_fields(tmp_path):
    from dppo_trl import AsyncDPPOConfig, DPPOConfig

    for config_class in (DPPOConfig, AsyncDPPOConfig):
        config = config_class(output_dir=str(tmp_path), use_cpu=True, report_to="none")
        assert (config.sync_mismatch_threshold, config.sync_mismatch_action) == (
            DEFAULT_SYNC_MISMATCH_THRESHOLD,
            "warn",
        )
        with pytest.raises(ValueError, match="sync_mismatch_threshold"):
            config_class(output_dir=str(tmp_path), use_cpu=True, report_to="none", sync_mismatch_threshold=2.0)
    assert (
        AsyncDPPOConfig.__dataclass_fields__["sync_mismatch_threshold"].metadata["help"]
        == (DPPOConfig.__dataclass_fields__["sync_mismatch_threshold"].metadata["help"])
    )


def test_message_says_what_was_compared_the_numbers_the_causes_and_the_options():
    check = SyncMismatch(0.3125, 212, 0.05, step=2, fresh="vLLM sampled right after the sync")
    message = sync_mismatch_message(check, "warn")
    for part in (
        "dppo/sync_mismatch = 0.312",
        "sync_mismatch_threshold = 0.05",
        "optimizer step 2",
        "212 loss tokens that vLLM sampled right after the sync",
        "π is the trainer's probability",
        "μ the probability the engine reported",
        "stale weights",
        "layer",
        "dtype or quantisation",
        "sleep mode",
        "LoRA adapter",
        "sync_mismatch_action='raise'",
        "sync_mismatch_action='off'",
    ):
        assert part in message, part
    stopped = sync_mismatch_message(check, "raise", "Training stopped.")
    assert stopped.endswith("Training stopped.") and "sync_mismatch_action='warn'" in stopped


class _Trainer:
    """What `SyncCheck` reads of a trainer: its step, accelerator, metric sink (`_metric_sink`) and output folder."""

    def __init__(self, output_dir: str, processes: int = 1):
        self.state = SimpleNamespace(global_step=0)
        self.accelerator = SimpleNamespace(
            sync_gradients=True,
            is_main_process=True,
            device=torch.device("cpu"),
            # `processes` identical processes: a sum over them.
            reduce=lambda tensor, reduction: tensor * processes,
        )
        self._metrics = {"train": defaultdict(list)}
        self.args = SimpleNamespace(output_dir=output_dir)

    def _metric_sink(self, mode):
        return self._metrics[mode]


def _args(action: str, threshold: float = 0.05) -> SimpleNamespace:
    return SimpleNamespace(sync_mismatch_threshold=threshold, sync_mismatch_action=action)


def _stats(mismatch: float, tokens: float) -> torch.Tensor:
    """What `fresh_rollout_sums` returns: `[Σ |π − μ|, tokens]`."""
    return torch.tensor([mismatch, tokens])


def test_one_value_per_fresh_step_over_its_loss_calls_and_processes(tmp_path):
    trainer = _Trainer(str(tmp_path), processes=2)
    check = SyncCheck(_args("warn"))
    trainer.accelerator.sync_gradients = False  # a micro-batch before the step's last one
    check.loss_call(trainer, _stats(0.2, 100.0), fresh=True, fresh_tokens="x")
    assert SYNC_MISMATCH_METRIC not in trainer._metrics["train"]
    trainer.accelerator.sync_gradients = True
    check.loss_call(trainer, _stats(0.1, 300.0), fresh=True, fresh_tokens="x")
    assert trainer._metrics["train"][SYNC_MISMATCH_METRIC] == [pytest.approx(0.3 / 400.0)]
    # A later step of the same rollout (π has moved) is not fresh: nothing more is logged.
    trainer.state.global_step = 1
    check.loss_call(trainer, _stats(9.0, 10.0), fresh=False, fresh_tokens="x")
    assert len(trainer._metrics["train"][SYNC_MISMATCH_METRIC]) == 1


def test_unfinished_step_is_not_mixed_into_the_next(tmp_path):
    trainer = _Trainer(str(tmp_path))
    check = SyncCheck(_args("warn"))
    trainer.accelerator.sync_gradients = False
    check.loss_call(trainer, _stats(50.0, 100.0), fresh=True, fresh_tokens="x")  # then an error ended the step
    trainer.state.global_step = 3
    trainer.accelerator.sync_gradients = True
    check.loss_call(trainer, _stats(0.1, 100.0), fresh=True, fresh_tokens="x")
    assert trainer._metrics["train"][SYNC_MISMATCH_METRIC] == [pytest.approx(0.001)]


def test_warn_off_and_clean(tmp_path):
    trainer = _Trainer(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing below the threshold, nothing with "off"
        SyncCheck(_args("warn")).loss_call(trainer, _stats(1.0, 100.0), fresh=True, fresh_tokens="x")
        SyncCheck(_args("off")).loss_call(trainer, _stats(90.0, 100.0), fresh=True, fresh_tokens="x")
        SyncCheck(_args("raise"), engine_mu=False).loss_call(
            trainer, _stats(90.0, 100.0), fresh=True, fresh_tokens="x"
        )
    assert trainer._metrics["train"][SYNC_MISMATCH_METRIC] == [pytest.approx(0.01)]  # "off" logs nothing
    with pytest.warns(SyncMismatchWarning, match="dppo/sync_mismatch = 0.9 exceeds"):
        SyncCheck(_args("warn")).loss_call(trainer, _stats(90.0, 100.0), fresh=True, fresh_tokens="x")
    assert trainer._metrics["train"][SYNC_MISMATCH_METRIC][-1] == pytest.approx(0.9)


def test_raise_is_typed_and_says_what_became_of_the_run(tmp_path):
    trainer = _Trainer(str(tmp_path))
    trainer.state.global_step = 4
    with pytest.raises(SyncMismatchError) as caught:
        SyncCheck(_args("raise")).loss_call(trainer, _stats(30.0, 100.0), fresh=True, fresh_tokens="x")
    error = caught.value
    assert (error.value, error.threshold, error.step, error.tokens, error.checkpoint) == (0.3, 0.05, 5, 100, None)
    assert not trainer._metrics["train"]  # the failed step's metrics are not left for a later train() to log
    assert "before the update of optimizer step 5" in str(error) and "No checkpoint was saved" in str(error)
    # With a complete checkpoint on disk, the error names it and how to resume from it.
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    with pytest.raises(SyncMismatchError) as caught:
        SyncCheck(_args("raise")).loss_call(trainer, _stats(30.0, 100.0), fresh=True, fresh_tokens="x")
    assert caught.value.checkpoint == os.path.join(str(tmp_path), "checkpoint-4")
    assert f"resume_from_checkpoint={caught.value.checkpoint!r}" in str(caught.value)
