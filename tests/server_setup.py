"""The CPU vLLM server as the server-mode tests start it: `python -m dppo_trl.backends.cpu.vllm_server` on the bundled
tiny model, with an API key and `--max-logprobs 8`, in its own session (the module server of
tests/system/test_vllm_server.py, the server tests/system/test_faults.py kills)."""

import os
import signal
import subprocess
import sys
import time

import pytest
import requests
from conftest import get_free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = os.path.join(ROOT, "examples", "tiny_math_model")
API_KEY = "dppo-test-key"
SERVER_MAX_LOGPROBS = 8
SERVER_START_TIMEOUT = 900  # seconds; ~1 min alone, several under a loaded shared machine


def subprocess_env(**extra) -> dict:
    # The repository (this checkout's library) and tests/ (`trainer_setup`, which the training script imports).
    paths = [ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), **extra)


def stop_server(proc: subprocess.Popen) -> None:
    """Stop the server and the engine processes it spawned (they share its session)."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


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


def start_server(log_path: str) -> Server:
    port = get_free_port()
    command = [sys.executable, "-m", "dppo_trl.backends.cpu.vllm_server", "--model", TINY_MODEL, "--port", str(port)]
    command += ["--max-logprobs", str(SERVER_MAX_LOGPROBS), "--max-model-len", "256"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command,
            env=subprocess_env(VLLM_API_KEY=API_KEY),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
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
