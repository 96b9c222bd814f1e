"""The `dppo-trl` console script as users run it: real processes, a real vLLM server, trackio's local store.

One server, started by `dppo-trl vllm-serve` with `trl vllm-serve`'s flags, serves the module: an asynchronous run
from the shipped GPU recipe (shrunk) and one from flags only, then a synchronous server-mode run from the CPU
recipe. The two recipe runs report to trackio with no network (`TRACKIO_DIR` in the test's folder), and the DPPO
metrics, the per-staleness slices included, are read back from trackio's SQLite store. A 2-process run through
`--accelerate_config multi_gpu` (transformers generation: no engine) checks the launch. Every run is 1-2 steps of
the bundled tiny model.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from conftest import get_free_port

ROOT = Path(__file__).resolve().parents[2]
DPPO_TRL = str(Path(sys.executable).parent / "dppo-trl")  # the console script the set-up installed
TINY_MODEL = "examples/tiny_math_model"
TINY_TRAIN = "examples/data/tiny_math/train.jsonl"
ASYNC_RECIPE = "examples/recipes/async/qwen3_1.7b_base_dapo_math_async.yaml"
SERVER_START_TIMEOUT = 900
RUN_TIMEOUT = 900
# The GPU recipe's sizes, swapped for the tiny model's (the CPU run's shape); everything else is the recipe's.
ASYNC_SHRINK = ["--model_name_or_path", TINY_MODEL, "--dataset_name", TINY_TRAIN, "--dtype", "float32", "--bf16",
                "false", "--use_cpu", "true", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps",
                "1", "--num_generations", "4", "--max_completion_length", "16", "--gradient_checkpointing", "false",
                "--save_strategy", "no", "--learning_rate", "3e-4"]  # fmt: skip

pytestmark = pytest.mark.slow


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_API_KEY")}
    # The launcher hands out rank variables; stale ones from this process must not leak in.
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    env["TRACKIO_DIR"] = str(tmp_path / "trackio")
    return env


def _run(tmp_path: Path, *argv: str) -> str:
    cmd = [DPPO_TRL, *argv]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out:\n{output[-6000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{output[-6000:]}"
    return output


def _trackio_metrics(tmp_path: Path, project: str) -> list[dict]:
    """Every metrics row trackio stored for `project`, read from its SQLite file (one per project)."""
    path = tmp_path / "trackio" / f"{project}.db"
    assert path.exists(), sorted(p.name for p in (tmp_path / "trackio").iterdir())
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT step, metrics FROM metrics ORDER BY id").fetchall()
    return [{"step": step, **json.loads(metrics)} for step, metrics in rows]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`dppo-trl vllm-serve` on CPU: the project's CPU server, started with TRL's flags."""
    log_path = tmp_path_factory.mktemp("cli_server") / "server.log"
    port = get_free_port()
    # TRL's options, then the CPU launcher's: seeded requests (TRL's async worker) need unchunked prefills on CPU.
    cmd = [DPPO_TRL, "vllm-serve", "--model", TINY_MODEL, "--port", str(port), "--max_model_len", "512",
           "--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}  # TRL's rollout worker sends no key
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"dppo-trl vllm-serve exited:\n{log_path.read_text()[-3000:]}")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"dppo-trl vllm-serve not healthy:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        yield port
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
                proc.wait(wait)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                continue


@pytest.mark.vllm
def test_train_async_recipe_reports_dppo_metrics_to_trackio(server, tmp_path):
    """The async GPU recipe, shrunk, against the served model; trackio holds dppo/* and the per-staleness slices."""
    output = _run(
        tmp_path, "train-async", "--config", ASYNC_RECIPE, *ASYNC_SHRINK,
        "--vllm_server_base_url", f"http://127.0.0.1:{server}", "--max_steps", "2", "--max_staleness", "2",
        "--report_to", "trackio", "--project", "cli-async", "--run_name", "recipe",
        "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert "Model saved to" in output and "Starting a CPU vLLM server" not in output
    rows = [r for r in _trackio_metrics(tmp_path, "cli-async") if "train/dppo/mask_ratio" in r]
    assert len(rows) == 2, rows
    for key in ("train/dppo/divergence_mean", "train/dppo/mismatch_abs_max", "train/sample/staleness_mean"):
        assert all(key in r for r in rows), key
    assert any(k.startswith("train/dppo/staleness_") and k.endswith("/mask_ratio") for r in rows for k in r), rows
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.vllm
def test_train_async_flags_only(server, tmp_path):
    output = _run(
        tmp_path, "train-async", "--model_name_or_path", TINY_MODEL, "--dataset_name", TINY_TRAIN,
        "--reward_funcs", "dapo_math.rewards.accuracy_reward", "--vllm_server_base_url", f"http://127.0.0.1:{server}",
        "--max_steps", "1", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "8", "--gradient_checkpointing", "false", "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert "Training completed on 1 process." in output and (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.vllm
def test_train_cpu_recipe_in_server_mode_reports_to_trackio(server, tmp_path):
    """`dppo-trl train --config examples/recipes/tiny_math_cpu.yaml` (the demo) against the served model."""
    output = _run(
        tmp_path, "train", "--config", "examples/recipes/tiny_math_cpu.yaml", "--vllm_mode", "server",
        "--vllm_server_host", "127.0.0.1", "--vllm_server_port", str(server), "--max_steps", "2",
        "--per_device_train_batch_size", "16", "--steps_per_generation", "2", "--math_eval_datasets", "none",
        "--report_to", "trackio", "--project", "cli-sync", "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert "Mean reward over training" in output  # the DAPO-Math recipe's summary line
    rows = [r for r in _trackio_metrics(tmp_path, "cli-sync") if "train/dppo/mask_ratio" in r]
    assert len(rows) == 2, rows
    assert all("train/dppo/mismatch_abs_max" in r for r in rows), rows
    # Rewards are logged at the step that generated (the first of the 2 per generation).
    assert "train/rewards/format_reward/mean" in rows[0], sorted(rows[0])
    assert (tmp_path / "out" / "training_curves.png").exists()


def test_two_processes_through_an_accelerate_preset(tmp_path):
    """`--accelerate_config multi_gpu --num_processes 2` on CPU: two gloo ranks, flags only, reward by path."""
    output = _run(
        tmp_path, "train", "--accelerate_config", "multi_gpu", "--num_processes", "2",
        "--main_process_port", str(get_free_port()),
        "--model_name_or_path", TINY_MODEL, "--dataset_name", TINY_TRAIN,
        "--reward_funcs", "dapo_math.rewards.accuracy_reward", "--use_vllm", "false", "--max_steps", "1",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
        "--logging_steps", "1", "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert "Training completed on 2 processes." in output and (tmp_path / "out" / "model.safetensors").exists()
