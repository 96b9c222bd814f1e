"""Smoke test of `benchmarks/sanity/run.py --quick`: it runs end to end and writes the JSON schema and PNGs.

Accuracy and timings are never asserted: the quick run is two optimizer steps.
"""

import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(REPO_ROOT, "benchmarks", "sanity", "run.py")
MODEL = os.path.join(REPO_ROOT, "examples", "tiny_math_model")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.no_lane]

CURVES = {"accuracy", "reward", "mismatch_abs_mean", "mismatch_kl_mean", "mask_ratio", "entropy"}
FIG6 = {"mu_prob_masked", "mu_prob_kept", "entropy_masked", "entropy_kept", "most_masked_tokens", "n_masked"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    if not os.path.isdir(MODEL):
        pytest.skip("examples/tiny_math_model is not built (scripts/make_tiny_math_model.py)")
    out = tmp_path_factory.mktemp("sanity")
    proc = subprocess.run(
        # Ports 29890+ stay clear of a full benchmark run (29800+) on the same machine.
        [sys.executable, RUN, "--quick", "--output-dir", str(out), "--port-base", "29890"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )
    logs = "".join((out / name).read_text() for name in os.listdir(out) if name.endswith(".log"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs[-3000:]
    # stdout is one JSON object (the tables go to stderr and tables.md).
    summary = json.loads(proc.stdout)
    assert summary["benchmark"] == "sanity" and summary["failed_runs"] == []
    assert set(summary["methods"]) == {"dppo_tv", "grpo_clip"} and summary["files"]["tables"] == "tables.md"
    return out


def test_quick_run_writes_results_json(quick_run):
    with open(quick_run / "results.json") as f:
        results = json.load(f)
    assert {"settings", "criteria", "machine", "wall_seconds", "methods", "plots"} <= set(results)
    assert set(results["methods"]) == {"dppo_tv", "grpo_clip"}
    for name, entry in results["methods"].items():
        assert {"runs", "stats", "fig6"} <= set(entry), name
        assert FIG6 <= set(entry["fig6"])
        (run,) = entry["runs"]
        assert "error" not in run, run.get("error")
        assert run["seed"] == 0
        # The paper's mismatch setting: bf16 engine, fp32 trainer.
        assert run["engine_dtype"] == "torch.bfloat16" and run["trainer_dtype"] == "torch.float32"
        assert CURVES <= set(run["curves"])
        assert len(run["curves"]["mismatch_abs_mean"]) == 2  # one point per optimizer step
        for key in ("final_accuracy", "steps_to_reach", "collapsed", "peak_mismatch_abs_mean"):
            assert key in run["summary"]
        assert {"final_accuracy", "collapsed_runs", "n_seeds"} <= set(entry["stats"])


def test_quick_run_writes_pngs(quick_run):
    with open(quick_run / "results.json") as f:
        plots = json.load(f)["plots"]
    assert set(plots) == {"curves_headline", "curves_all", "fig6"}
    for name in plots.values():
        path = quick_run / name
        assert path.exists() and path.stat().st_size > 1000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
