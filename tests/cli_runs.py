"""Running the `dppo-trl` console script as a user does, and reading back what trackio stored (tests of the command:
tests/system/test_cli_accelerate.py, and the server-mode runs in tests/integration/test_async_server.py, which share
the server that module starts with `dppo-trl vllm-serve` through `serving`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]
DPPO_TRL = str(Path(sys.executable).parent / "dppo-trl")  # the console script the set-up installed
RUN_TIMEOUT = 900
SERVER_START_TIMEOUT = 900


def cli_env(tmp_path: Path) -> dict[str, str]:
    """The user's environment: no PYTHONPATH, no API key, no stale rank variables; trackio's store in `tmp_path`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_API_KEY")}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    env["TRACKIO_DIR"] = str(tmp_path / "trackio")
    return env


def run_cli(tmp_path: Path, *argv: str) -> str:
    """Run `dppo-trl ARGV` from the repository root; its output, after asserting exit 0."""
    cmd = [DPPO_TRL, *argv]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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


def trackio_metrics(tmp_path: Path, project: str) -> list[dict]:
    """Every metrics row trackio stored for `project`, read from its SQLite file (one per project)."""
    path = tmp_path / "trackio" / f"{project}.db"
    assert path.exists(), sorted(p.name for p in (tmp_path / "trackio").iterdir())
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT step, metrics FROM metrics ORDER BY id").fetchall()
    return [{"step": step, **json.loads(metrics)} for step, metrics in rows]


@contextlib.contextmanager
def serving(log_path: Path, command: list[str], port: int) -> Iterator[str]:
    """A vLLM server started by `command` (listening on `port`) in its own session, with this checkout on PYTHONPATH
    and no API key (TRL's rollout worker sends none): its URL once `/health` answers, the test failed with the log's
    tail if it exits or stays unhealthy; stopped on the way out with the package's `stop_server` (SIGTERM, then
    SIGKILL, to the session)."""
    from dppo_trl.cli.server import stop_server

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("VLLM_API_KEY", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited:\n{log_path.read_text()[-3000:]}")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not healthy:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        stop_server(proc)
