"""The no-argument run of `examples/train_dapo_math.py` shows DPPO at work: vLLM colocate with a bf16 (or fp32) engine
and an fp32 trainer, several optimizer steps per rollout, a trust-region panel in the curves, and a comparison plot."""

import json
import math
import os

import pytest

from dppo_trl.backends.cpu.platform import is_vllm_cpu_platform

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MODEL = os.path.join(ROOT, "examples", "tiny_math_model")


@pytest.fixture(scope="module")
def example():
    import train_dapo_math

    return train_dapo_math


# --- the default settings -----------------------------------------------------------------------------------------
def test_default_run_is_off_policy_vllm_colocate(example):
    import torch

    script_args, args, _ = example.parse_args([])
    assert args.use_vllm and args.vllm_mode == "colocate"
    assert args.vllm_cpu_dtype == "auto"
    assert args.trust_region == "dppo" and args.anchor == "behavior"
    # Several optimizer steps per rollout, each a whole number of accumulation rounds: π drifts from μ in a rollout.
    assert args.steps_per_generation % args.gradient_accumulation_steps == 0
    assert args.steps_per_generation // args.gradient_accumulation_steps > 1
    assert args.generation_batch_size == args.per_device_train_batch_size * args.steps_per_generation
    assert args.logging_steps == 1  # one log per optimizer step: the curves can tell fresh from drifted steps
    if not torch.cuda.is_available():
        assert args.use_cpu and not args.bf16  # the trainer in fp32


def test_user_settings_win_over_the_default_run(example, tmp_path):
    script_args, args, _ = example.parse_args(["--use_vllm", "false", "--vllm_cpu_dtype", "float32"])
    assert not args.use_vllm and args.vllm_cpu_dtype == "float32"
    assert args.steps_per_generation == example.TINY_RUN_DEFAULTS["steps_per_generation"]
    config = tmp_path / "c.yaml"
    config.write_text("use_vllm: false\nsteps_per_generation: 1\n")
    _, args, _ = example.parse_args(["--config", str(config), "--trust_region", "grpo_clip"])
    assert not args.use_vllm and args.steps_per_generation == 1 and args.trust_region == "grpo_clip"
    with pytest.raises(SystemExit):  # the parser names the valid choices
        example.parse_args(["--vllm_cpu_dtype", "fp8"])


def test_engine_dtype_is_bf16_where_the_cpu_has_it():
    from dppo_trl.backends.cpu.engine import resolve_engine_dtype
    from dppo_trl.backends.cpu.platform import cpu_has_native_bf16

    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert resolve_engine_dtype("auto")[0] == expected
    dtype, reason = resolve_engine_dtype("auto", native_bf16=False)
    assert dtype == "float32" and "fallback" in reason
    assert resolve_engine_dtype("auto", native_bf16=True)[0] == "bfloat16"
    assert resolve_engine_dtype("float32", native_bf16=True)[0] == "float32"
    with pytest.raises(ValueError, match="vllm_cpu_dtype"):
        resolve_engine_dtype("fp8")


def test_engine_dtype_reaches_the_engine_through_the_config(example):
    from dppo_trl.backends.cpu.engine import EngineOptions, resolve_engine_dtype

    _, args, _ = example.parse_args([])
    assert EngineOptions.from_config(args).dtype == resolve_engine_dtype("auto")[0]
    _, args, _ = example.parse_args(["--vllm_cpu_dtype", "bfloat16"])
    assert EngineOptions.from_config(args).dtype == "bfloat16"


# --- curves and summary -------------------------------------------------------------------------------------------
def _history(every_step: bool = True) -> list[dict]:
    """A log history shaped like the default run's: a rollout every 4 steps, evaluations at 0 and 8."""
    history = [{"step": 0, "eval/t/avg@4": 0.1}]
    steps = range(1, 9) if every_step else (4, 8)
    for step in steps:
        fresh = (step - 1) % 4 == 0 or not every_step
        entry = {
            "step": step,
            "dppo/mask_ratio": 0.0 if fresh else 0.01 * step,
            "dppo/mask_ratio_pos_adv": 0.0 if fresh else 0.02,
            "dppo/mask_ratio_neg_adv": 0.0 if fresh else 0.005,
            "dppo/ratio_capped_frac": 0.0,
            "dppo/mismatch_abs_mean": 0.001 if fresh else 0.002 * step,
        }
        if fresh:
            entry |= {"reward": 0.3 + 0.05 * step, "rewards/accuracy_reward/mean": 0.1 + 0.02 * step}
        history.append(entry)
    history.append({"step": 8, "eval/t/avg@4": 0.2})
    return history


def _panels(fig) -> list:
    # twinx axes share the panel's position; count distinct positions.
    return sorted({tuple(ax.get_position().bounds) for ax in fig.axes})


def test_figure_has_a_learning_and_a_trust_region_panel():
    import matplotlib.pyplot as plt

    from dapo_math.plots import make_training_figure, split_fresh_drifted

    fig = make_training_figure(_history())
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert len(_panels(fig)) == 2 and titles[0] == "learning" and titles[1].startswith("trust region")
    labels = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    assert {"masked, A > 0", "masked, A < 0", "π/μ at the cap"} <= set(labels)
    assert "mean |π − μ|, fresh rollout" in labels and "mean |π − μ|, drifted (later steps)" in labels
    plt.close(fig)
    fresh, drifted = split_fresh_drifted(_history())
    assert [e["step"] for e in fresh] == [1, 5] and [e["step"] for e in drifted] == [2, 3, 4, 6, 7, 8]

    # Coarse logging averages fresh and drifted steps: one mismatch series, no split.
    assert split_fresh_drifted(_history(every_step=False)) is None
    fig = make_training_figure(_history(every_step=False))
    assert "mean |π − μ|" in [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    plt.close(fig)


def test_figure_without_dppo_metrics_or_data(tmp_path):
    import matplotlib.pyplot as plt

    from dapo_math.plots import make_training_figure, plot_training_curves

    assert plot_training_curves([{"step": 1, "loss": 0.1}], str(tmp_path / "x.png")) is None
    fig = make_training_figure([{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.6}])
    assert len(_panels(fig)) == 1
    plt.close(fig)


def test_summary_line_reports_the_trust_region():
    from dapo_math.plots import summarize_run, summary_line

    summary = summarize_run(_history())
    assert summary["accuracy_first"] == (1, pytest.approx(0.12)) and summary["accuracy_last"][0] == 5
    assert summary["mismatch_peak"] == pytest.approx(0.016)
    assert summary["mismatch_fresh_mean"] == pytest.approx(0.001)
    line = summary_line(summary)
    assert "training accuracy: 0.120 (step 1) -> 0.200 (step 5)" in line
    assert "t/avg@4: 0.100 (step 0) -> 0.200 (step 8)" in line
    assert "mean mask rate" in line and "peak mean |π-μ| 0.0160" in line and "fresh rollouts 0.0010" in line


# --- the default run on the real engine ---------------------------------------------------------------------------
# One rollout of 16 prompts x 4 samples split into 4 optimizer steps, with a step size large enough that the policy
# moves past DPPO's δ = 0.15 on some tokens within the rollout. Seeded: the same tokens are masked on every run.
SHORT_RUN = (
    "--max_steps 4 --per_device_train_batch_size 16 --num_generations 4 --steps_per_generation 4 "
    "--learning_rate 1e-2 --math_eval_datasets none"
).split()


@pytest.fixture(scope="module")
def default_run(example, tmp_path_factory):
    """The default command, shrunk: vLLM colocate, engine dtype `auto`, 4 optimizer steps on one rollout."""
    if not is_vllm_cpu_platform():
        pytest.skip("needs the CPU build of vLLM")
    from conftest import get_free_port

    out = str(tmp_path_factory.mktemp("default_run"))
    with pytest.MonkeyPatch.context() as env:  # TRL's colocate engine reads them; a port of our own, never 29500
        env.setenv("MASTER_ADDR", "127.0.0.1")
        env.setenv("MASTER_PORT", str(get_free_port()))
        trainer = example.main(*example.parse_args(SHORT_RUN + ["--output_dir", out]))
    return trainer, out


@pytest.mark.vllm
@pytest.mark.slow
def test_default_run_masks_tokens_on_the_real_engine(default_run):
    from dppo_trl.backends.cpu.engine import resolve_engine_dtype

    trainer, out = default_run
    engine_dtype = resolve_engine_dtype("auto")[0]
    assert str(trainer.vllm_generation.llm.llm_engine.model_config.dtype) == f"torch.{engine_dtype}"
    # The engine dtype came through the config; the trainer's engine keeps its reload-based weight sync, bound to
    # the instance.
    assert "sync_weights" in vars(trainer.vllm_generation)

    logs = [e for e in trainer.state.log_history if "dppo/mask_ratio" in e]
    assert [e["step"] for e in logs] == [1, 2, 3, 4]
    assert "reward" in logs[0] and all("reward" not in e for e in logs[1:])  # one rollout, logged at its first step
    for entry in logs:
        for key, value in entry.items():
            if key.startswith("dppo/") or key in ("loss", "grad_norm"):
                assert math.isfinite(value), (key, entry["step"])
    assert max(e["dppo/mask_ratio"] for e in logs[1:]) > 0  # the trust region acts on the drifted steps
    fresh, drifted = logs[0]["dppo/mismatch_abs_mean"], max(e["dppo/mismatch_abs_mean"] for e in logs[1:])
    assert drifted > fresh
    # The weight-sync check reads the rollout's first step (the only one after its sync), never the drifted ones.
    assert [e.get("dppo/sync_mismatch") for e in logs] == [pytest.approx(fresh), None, None, None]
    if engine_dtype == "bfloat16":
        assert 0 < fresh < 0.05  # bf16 engine vs fp32 trainer: a small, non-zero mismatch before any update
    else:
        assert fresh < 1e-4

    history = json.load(open(os.path.join(out, "log_history.json")))
    from dapo_math.plots import make_training_figure

    fig = make_training_figure(history)
    assert len(_panels(fig)) == 2
    assert os.path.getsize(os.path.join(out, "training_curves.png")) > 1000


@pytest.mark.vllm
@pytest.mark.slow
def test_compare_runs_draws_two_runs(example, default_run, tmp_path):
    """GRPO's clip on the same settings (transformers generation, to keep it short), then both runs on one plot."""
    import compare_runs

    _, dppo_out = default_run
    clip_out = str(tmp_path / "grpo_clip")
    argv = SHORT_RUN + ["--use_vllm", "false", "--trust_region", "grpo_clip", "--output_dir", clip_out]
    example.main(*example.parse_args(argv))

    output = str(tmp_path / "compare.png")
    summaries = compare_runs.main([dppo_out, clip_out, "--labels", "dppo", "grpo_clip", "--output", output])
    assert os.path.getsize(output) > 1000
    assert set(summaries) == {"dppo", "grpo_clip"}
    assert all("mask_rate_mean" in s and "accuracy_last" in s for s in summaries.values())

    with pytest.raises(ValueError, match="at least two"):
        compare_runs.compare_runs([dppo_out], output)
    with pytest.raises(FileNotFoundError, match="log_history.json"):
        compare_runs.compare_runs([dppo_out, str(tmp_path)], output)
