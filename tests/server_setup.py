"""The CPU vLLM server as the server-mode tests start it: `python -m dppo_trl.backends.cpu.vllm_server`, by default on
the bundled tiny model with an API key and `--max-logprobs 8`, in its own session (the module server of
tests/system/test_vllm_server.py, the server tests/system/test_faults.py kills, and the agent server of
tests/system/test_agents_server.py)."""

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import requests
from conftest import get_free_port

from dppo_trl.cli.server import stop_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = os.path.join(ROOT, "examples", "tiny_math_model")
API_KEY = "dppo-test-key"
SERVER_MAX_LOGPROBS = 8
SERVER_START_TIMEOUT = 900  # seconds; ~1 min alone, several under a loaded shared machine


def subprocess_env(**extra) -> dict:
    # The repository (this checkout's library) and tests/ (`trainer_setup`, which the training script imports).
    paths = [ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), **extra)


class Server:
    def __init__(self, port: int, proc: subprocess.Popen, log_path: str):
        self.port, self.proc, self.log_path = port, proc, log_path
        self.base_url = f"http://127.0.0.1:{port}"

    def log_tail(self, lines: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def post(self, path: str, **kwargs) -> dict:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        response = requests.post(self.base_url + path, headers=headers, timeout=120, **kwargs)
        assert response.status_code == 200, response.text
        return response.json()


def start_server(
    log_path: str, model: str = TINY_MODEL, max_logprobs: int = SERVER_MAX_LOGPROBS, api_key: str | None = API_KEY
) -> Server:
    """Start the server (`api_key=None`: one that asks for no key, as TRL's rollout worker and agents send none)."""
    port = get_free_port()
    command = [sys.executable, "-m", "dppo_trl.backends.cpu.vllm_server", "--model", model, "--port", str(port)]
    command += ["--max-logprobs", str(max_logprobs), "--max-model-len", "256"]
    env = subprocess_env(**({} if api_key is None else {"VLLM_API_KEY": api_key}))
    if api_key is None:
        env.pop("VLLM_API_KEY", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
        )  # fmt: skip
    return Server(port, proc, log_path)


def wait_healthy(server: Server) -> bool:
    """True once `/health` answers; False if the server exited because its port was taken meanwhile."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while True:
        if server.proc.poll() is not None:
            if "Address already in use" in server.log_tail():
                return False
            pytest.fail(f"vLLM server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(server.base_url + "/health", timeout=5).status_code == 200:
                return True
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"vLLM server not healthy after {SERVER_START_TIMEOUT} s:\n{server.log_tail()}")
        time.sleep(2)


@contextlib.contextmanager
def running_server(log_dir: str, **start_kwargs) -> Iterator[Server]:
    """A healthy server (`start_server`'s arguments), stopped on the way out. The port is checked free, but another
    process on a shared machine can take it before vLLM binds: up to three attempts then."""
    for attempt in range(3):
        server = start_server(os.path.join(log_dir, f"server{attempt}.log"), **start_kwargs)
        try:
            if wait_healthy(server):
                break
        except BaseException:
            stop_server(server.proc)
            raise
    else:
        pytest.fail("vLLM server could not bind a free port in 3 attempts")
    try:
        yield server
    finally:
        stop_server(server.proc)
