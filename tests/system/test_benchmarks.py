"""The benchmark scripts run end to end with their smallest settings and print the JSON they promise.

Speed is never asserted here: the numbers depend on the machine and its load.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _is_number(value) -> bool:
    # Present and finite, never compared with anything: a fast machine rounds a short time to 0.0.
    return isinstance(value, int | float) and math.isfinite(value)


def user_env() -> dict:
    """The environment a user has after the README's set-up: the venv's python, no PYTHONPATH help."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def parse_one_json_object(stdout: str) -> dict:
    """stdout must be one JSON object and nothing else: no notice before it, nothing after it."""
    report = json.loads(stdout)  # raises on anything around the object
    assert isinstance(report, dict), type(report)
    return report


def _run_script(name: str, *args: str, timeout: int = 600, expect_rc: int = 0) -> dict:
    # As a user runs it: from the repository root, by relative path, with the venv's python.
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{name}", *args],
        cwd=REPO_ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == expect_rc, proc.stderr[-4000:]
    return parse_one_json_object(proc.stdout)


def _no_nulls(value, path="ratios"):
    if isinstance(value, dict):
        for key, item in value.items():
            _no_nulls(item, f"{path}.{key}")
    else:
        assert value is not None, path


def _no_unexplained_nulls(report: dict) -> None:
    """With every variant run, a null ratio can only stand for a measured 0 in its denominator (a peak below RSS
    resolution, a time rounded to 0.0 on a fast machine): the figures themselves are never asserted."""
    if not any(r["peak_extra_mib"] == 0 or r["time_s"] == 0 for r in report["results"].values()):
        _no_nulls(report["ratios"])


def test_topk_memory_runs_every_variant_from_the_repository_root():
    # The default vocabulary (Qwen3's), everything else small but large enough for every peak to register in RSS;
    # --paired adds the interleaved A vs binary worker.
    report = _run_script("topk_memory.py", "--n-tokens", "256", "--hidden", "64", "--paired", "1")
    assert report["failed"] == []
    assert set(report["results"]) == {"naive", "topk_anchor", "topk_fused", "binary_trl", "binary_fused", "kept_set"}
    for name, result in report["results"].items():
        assert "error" not in result, (name, result)
        assert _is_number(result["peak_extra_mib"]) and _is_number(result["time_s"]), name
    assert "error" not in report["paired_timing"], report["paired_timing"]
    assert set(report["ratios"]) == {"anchor_gather_over_binary_trl_time", "topk_anchor", "topk_fused", "kept_set"}
    _no_unexplained_nulls(report)
    assert report["config"]["vocab"] == 151936


def test_topk_memory_subset_reports_only_its_comparisons():
    report = _run_script(
        "topk_memory.py", "--n-tokens", "32", "--hidden", "16", "--vocab", "2048", "--variants", "naive,topk_fused"
    )
    assert report["failed"] == [] and set(report["results"]) == {"naive", "topk_fused"}
    # No comparison with a variant that was not asked for, so no null standing in for it.
    assert set(report["ratios"]) == {"topk_fused"}
    assert set(report["ratios"]["topk_fused"]) == {"naive_over_ours_memory", "naive_over_ours_time"}
    _no_unexplained_nulls(report)


def test_topk_memory_rejects_bad_sizes_and_reports_failed_workers():
    proc = subprocess.run(
        [sys.executable, "benchmarks/topk_memory.py", "--vocab-tile", "0"],
        cwd=REPO_ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--vocab-tile must be >= 1" in proc.stderr and proc.stdout == ""
    # A worker that dies is reported as an error entry (the driver then exits 1), never as a silent null.
    import topk_memory  # benchmarks/ (pytest's pythonpath)

    failed = topk_memory._run_worker([sys.executable, "-c", "raise SystemExit('worker died')"], "naive")
    assert failed == {"variant": "naive", "error": "worker died", "returncode": 1}


@pytest.mark.vllm
@pytest.mark.no_lane
@pytest.mark.slow
def test_step_time_runs(tmp_path):
    output = tmp_path / "step_time.json"
    report = _run_script(
        "step_time.py",
        *("--steps", "2", "--warmup", "0", "--model-size", "tiny", "--completion-length", "8"),
        *("--batch-size", "8", "--num-generations", "4", "--output", str(output)),
    )
    assert json.loads(output.read_text()) == report
    for key in ("trainers", "ratio_median_dppo_over_grpo", "config", "versions", "machine", "process_mode"):
        assert key in report, key
    assert set(report["trainers"]) == {"grpo", "dppo"}
    for name, result in report["trainers"].items():
        assert len(result["step_times_s"]) == 2, name
        assert all(_is_number(t) for t in result["step_times_s"]), name
        for key in ("median_s", "mean_s", "min_s", "cpu_median_s"):
            assert _is_number(result[key]), (name, key)
    assert report["trainers"]["grpo"]["recomputes_old_logps"] is True
    assert report["trainers"]["dppo"]["recomputes_old_logps"] is False
    assert _is_number(report["ratio_median_dppo_over_grpo"])
    config = report["config"]
    assert (config["steps"], config["warmup"], config["divergence"]) == (2, 0, "binary_tv")
    assert config["model_size"] == "tiny" and config["max_completion_length"] == 8
    for key in ("torch", "trl", "vllm"):
        assert report["versions"][key], key
    assert report["machine"]["cpu_count"] >= 1
    # TRL defaults, one generation per optimizer step: GRPO recomputes π_old once per generation batch, DPPO never.
    assert report["policy_forwards_per_generation"] == {"grpo": 1, "dppo": 0}
    assert report["launcher"] == {"name": "python", "world_size": 1}
    for threads in (report["threads"], report["trainers"]["dppo"]["threads_at_start"]):
        assert threads["torch_threads"] >= 1 and "OMP_NUM_THREADS" in threads


@pytest.mark.vllm
@pytest.mark.no_lane
@pytest.mark.slow
def test_step_time_counts_forwards_in_the_recipes_shape():
    # The recipes' shape: steps_per_generation a multiple of GA, so one generation feeds several optimizer steps.
    report = _run_script(
        "step_time.py",
        *("--steps", "2", "--warmup", "0", "--model-size", "tiny", "--completion-length", "8"),
        *("--batch-size", "4", "--num-generations", "4"),
        *("--gradient-accumulation-steps", "2", "--steps-per-generation", "8"),
    )
    config = report["config"]
    assert (config["gradient_accumulation_steps"], config["steps_per_generation"]) == (2, 8)
    assert config["optimizer_steps_per_generation"] == 4
    for trainer in ("grpo", "dppo"):
        result = report["trainers"][trainer]
        assert result["generations_per_run"] == [1] and result["steps_per_generation"] == 8, trainer
    # TRL recomputes π_old here even without its importance-sampling correction (GA is not a multiple of
    # steps_per_generation); DPPO's μ comes from the engine, so it never needs that pass.
    assert report["policy_forwards_per_generation"] == {"grpo": 1, "dppo": 0}
    assert report["trainers"]["dppo"]["recomputes_old_logps"] is False


@pytest.mark.vllm
@pytest.mark.no_lane
def test_topk_capture_runs():
    report = _run_script("topk_capture.py", "--completions", "8", "--tokens", "16", "--repeats", "1")
    for key in ("extract_logprobs_us_per_token", "conversion_us_per_token", "generation_s", "config", "versions"):
        assert key in report, key
    for key in ("generation_s", "conversion_us_per_token", "extract_logprobs_us_per_token"):
        assert _is_number(report[key]), key
    assert report["conversion_matches_reference"] is True


@pytest.mark.vllm
@pytest.mark.no_lane
@pytest.mark.slow
def test_async_vs_sync_runs():
    # Both variants against one real server, two optimizer steps each: the report a user gets, no figure compared.
    report = _run_script(
        "async_vs_sync.py", *("--steps", "2", "--samples_per_step", "8", "--num_generations", "4"), timeout=900
    )
    assert set(report["variants"]) == {"sync", "async"}
    for name, result in report["variants"].items():
        assert "error" not in result, (name, result)
        _no_nulls(result, name)
    assert report["launcher"] and report["threads"]


def test_async_topk_cost_runs():
    """Binary against top-K at each stage of the asynchronous data path, smallest sizes: every figure is present and
    finite, and the top-K lists really travel (the batch holds them, the samples are larger). No time is compared."""
    report = _run_script("async_topk_cost.py", "--quick")
    assert set(report["results"]) == {"binary_tv", "topk_tv"}
    for name, result in report["results"].items():
        for stage in ("sample", "collate", "loss_step"):
            assert _is_number(result[stage]["time_s" if stage != "sample" else "pickled_bytes_mean"]), (name, stage)
        assert _is_number(result["server_response"]["bytes_per_token"])
    binary, topk = report["results"]["binary_tv"], report["results"]["topk_tv"]
    assert binary["collate"]["batch_topk_bytes"] == 0 < topk["collate"]["batch_topk_bytes"]
    assert topk["sample"]["array_bytes_per_trained_token"] > binary["sample"]["array_bytes_per_trained_token"]
    assert _is_number(topk["server_response"]["parse_s_per_1k_tokens"])
    assert report["settings"]["k"] == 4 and report["versions"]["trl"]


def test_tree_attention_runs():
    """Smallest rows, both kinds (plain packing and a shared prompt): every implementation that can run here ran, its
    figures are present, its output equals the float32 function's, and FA3 is skipped with the reason, not failed."""
    report = _run_script("tree_attention.py", "--quick", "--device", "cpu")
    assert report["failed"] == [] and set(report["results"]) == {"2x32", "8+2x16"}
    for spec, row in report["results"].items():
        for variant in ("sdpa", "eager"):
            result = row[variant]
            assert _is_number(result["time_s"]) and _is_number(result["peak_extra_mib"]), (spec, variant)
            assert result["max_abs_diff_vs_eager"] < 1e-5, (spec, variant)
        assert row["fa3"] == {"skipped": report["fa3"]} and "CUDA" in report["fa3"]
        assert set(report["ratios"][spec]) == {"eager_over_sdpa_time", "eager_over_sdpa_memory"}
    assert report["config"]["device"] == "cpu" and report["config"]["dtype"] == "float32"


def test_memory_plan_sizes_the_30b_recipe():
    """Meta device, no weights, seconds: the 30B LoRA recipe's per-GPU budget on its own launch (8 GPUs, ZeRO-3), every
    phase and term present and labelled; TRL's whole-model sync is what does not fit an 80 GB card. The counts
    themselves are checked in tests/unit/test_memory_plan.py."""
    report = _run_script("memory_plan.py", "--recipe", "examples/recipes/qwen3_30b_a3b_base_lora_dapo_math.yaml")
    assert report["gpus"] == 8 and report["launch"]["distribution"] == "zero3"
    assert set(report["phases"]) == {"train_step", "sync_trl", "sync_per_layer", "generation"}
    for phase in report["phases"].values():
        assert all(t["kind"] in ("counted", "estimated") and t["formula"] for t in phase["terms"].values())
        assert _is_number(phase["total_gib"]) and isinstance(phase["fits"], bool)
    assert report["model_summary"]["params"] == 30_532_122_624
    assert report["fits"]["sync_trl"] is False and report["fits"]["with_per_layer_sync"] is True
