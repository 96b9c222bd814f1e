"""Smoke test of `benchmarks/sanity/sweep.py --quick`: two mismatch levels x two methods x one seed, two steps each.

It checks the outputs and that the knob really widens the engine–trainer gap; accuracy and timings are never asserted.
"""

import csv
import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = os.path.join(REPO_ROOT, "benchmarks", "sanity", "sweep.py")
MODEL = os.path.join(REPO_ROOT, "examples", "tiny_math_model")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.no_lane]


@pytest.fixture(scope="module")
def quick_sweep(tmp_path_factory):
    if not os.path.isdir(MODEL):
        pytest.skip("examples/tiny_math_model is not built (scripts/make_tiny_math_model.py)")
    out = tmp_path_factory.mktemp("sweep")
    proc = subprocess.run(
        # Ports 29990+ stay clear of a full sweep (29950+) and of run.py's quick test (29890+).
        [sys.executable, SWEEP, "--quick", "--output-dir", str(out), "--port-base", "29990"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "examples")])},
    )
    logs = "".join((out / "logs" / n).read_text() for n in os.listdir(out / "logs")) if (out / "logs").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs[-3000:]
    with open(out / "sweep.json") as f:
        result = json.load(f)
    errors = [r for r in result["runs"] if "error" in r]
    assert not errors, (errors, logs[-3000:])
    # stdout is one JSON object (the table and progress go to stderr and sweep.md).
    summary = json.loads(proc.stdout)
    assert summary["benchmark"] == "mismatch_sweep" and summary["status"] == "complete"
    assert summary["failed_runs"] == [] and summary["files"]["table"] == "sweep.md"
    return out, result


def test_quick_sweep_json(quick_sweep):
    _, result = quick_sweep
    assert result["status"] == "complete" and not result["missing"]
    assert result["command"].startswith("python benchmarks/sanity/sweep.py --quick")
    settings = result["settings"]
    assert settings["levels"] == ["none", "noise=0.5"] and settings["methods"] == ["dppo_tv", "pg_is"]
    assert len(settings["model_sha256"]) == 64 and settings["engine_dtype"] == "bfloat16"
    assert {"torch", "trl", "vllm", "transformers"} <= set(result["versions"])
    assert set(result["cells"]) == {f"{lvl}|{m}" for lvl in ("none", "noise=0.5") for m in ("dppo_tv", "pg_is")}
    assert len(result["runs"]) == 4
    for run in result["runs"]:
        assert "error" not in run, run
        for key in ("final_accuracy", "collapsed", "fresh_mismatch_first", "fresh_mismatch_median", "mean_mask_ratio"):
            assert key in run
    # The knob reaches the engine: noise 0.5 widens the fresh gap far beyond the bf16 rounding (measured ~100x).
    none = result["levels"]["none"]["fresh_mismatch_first"]["mean"]
    noisy = result["levels"]["noise=0.5"]["fresh_mismatch_first"]["mean"]
    assert 0 < none < 5e-3 and noisy > 5 * none


def test_quick_sweep_table_csv_and_plot(quick_sweep):
    out, _ = quick_sweep
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {"level", "method", "seed", "final_accuracy", "collapsed"} <= set(rows[0])
    table = (out / "sweep.md").read_text()
    assert table.startswith("Status: complete") and table.count("| noise=0.5 |") == 2
    png = out / "sweep.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_from_the_committed_record(tmp_path):
    """A fresh clone has only the committed `runs.jsonl`: `--resume` runs just the missing seed and pools the rest."""
    if not os.path.isdir(MODEL):
        pytest.skip("examples/tiny_math_model is not built (scripts/make_tiny_math_model.py)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "examples")])}
    base = [
        sys.executable,
        SWEEP,
        "--quick",
        "--levels",
        "none",
        "--methods",
        "dppo_tv",
        "--output-dir",
        str(tmp_path),
    ]
    port = ["--port-base", str(int(os.environ.get("DPPO_TEST_PORT_BASE", "29980")) + 7)]

    def sweep(*extra):
        proc = subprocess.run([*base, *port, *extra], capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    first = sweep("--seeds", "0")
    assert "1 of 1 runs to do" in first.stderr
    record = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert len(record) == 1 and json.loads(record[0])["seed"] == 0
    # What a fresh clone holds: the committed record and header, no per-run files, no logs.
    for name in ("runs", "logs"):
        for path in (tmp_path / name).iterdir():
            path.unlink()
    second = sweep("--seeds", "0-1", "--resume")
    assert "1 of 2 runs to do" in second.stderr
    with open(tmp_path / "sweep.json") as f:
        result = json.load(f)
    assert result["status"] == "complete" and [r["seed"] for r in result["runs"]] == [0, 1]
    seed0 = {k: v for k, v in json.loads(record[0]).items() if k != "settings_id"}
    assert result["runs"][0] == seed0  # the committed row, not a rerun
    lines = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in lines] == [0, 1] and len({r["settings_id"] for r in lines}) == 1
    assert len(result["resumed_with"]) == 1  # the header travelled with the record
    assert all(r["platform"] for r in lines)
    # --reaggregate (what the lead runs before committing) writes the partial state without running anything.
    proc = subprocess.run([*base, "--seeds", "0-2", "--reaggregate"], capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and json.loads(proc.stdout)["missing"] == [
        {"level": "none", "method": "dppo_tv", "seed": 2}
    ]
    assert (tmp_path / "runs.jsonl").read_text().splitlines() == [json.dumps(r, separators=(",", ":")) for r in lines]
    # A header rebuilt by --reaggregate (a stopped sweep's) has no wall time; resuming from it still finishes.
    (tmp_path / "header.json").unlink()
    subprocess.run([*base, "--seeds", "0-1", "--reaggregate"], capture_output=True, text=True, env=env, check=True)
    assert json.loads((tmp_path / "header.json").read_text())["wall_seconds"] is None
    third = sweep("--seeds", "0-1", "--resume")
    assert "0 of 2 runs to do" in third.stderr
    assert json.loads((tmp_path / "sweep.json").read_text())["wall_seconds"] is None
