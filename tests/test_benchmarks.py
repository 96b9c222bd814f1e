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

REPO_ROOT = Path(__file__).resolve().parents[1]


def _is_number(value) -> bool:
    # Present and finite, never compared with anything: a fast machine rounds a short time to 0.0.
    return isinstance(value, int | float) and math.isfinite(value)


def _run_script(name: str, *args: str, timeout: int = 600) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / name), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The report is the last thing printed; libraries may log to stdout before it (DeepSpeed's accelerator notice).
    start = proc.stdout.rfind("\n{\n") + 1 if not proc.stdout.startswith("{") else 0
    return json.loads(proc.stdout[start:])


@pytest.mark.vllm
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


@pytest.mark.vllm
def test_topk_capture_runs():
    report = _run_script("topk_capture.py", "--completions", "8", "--tokens", "16", "--repeats", "1")
    for key in ("extract_logprobs_us_per_token", "conversion_us_per_token", "generation_s", "config", "versions"):
        assert key in report, key
    for key in ("generation_s", "conversion_us_per_token", "extract_logprobs_us_per_token"):
        assert _is_number(report[key]), key
    assert report["conversion_matches_reference"] is True
