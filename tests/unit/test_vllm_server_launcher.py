"""The CPU server's launcher, `python -m dppo_trl.backends.cpu.vllm_server` (`build_server_command`), without starting
a server: localhost and the flags DPPO needs, the API key through the environment, refusals of what would change μ,
and the worker extension it names. The server itself runs in tests/system/test_vllm_server.py."""

import logging

import pytest

from dppo_trl.backends.cpu.vllm_server import WORKER_EXTENSION, build_server_command


def test_launcher_binds_localhost_with_trl_flags(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    command, env = build_server_command(["--model", "m", "--port", "9001", "--max-model-len", "128"])
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command)
    for part in (
        "--host 127.0.0.1",
        "--port 9001",
        "--logprobs-mode processed_logprobs",
        "--max-logprobs -1",
        "--dtype float32",
        "--enforce-eager",
        "--kv-cache-memory-bytes 67108864",
        "--max-model-len 128",  # unknown options reach vLLM unchanged
    ):
        assert part in joined, part
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_API_KEY" not in env


def test_launcher_key_goes_through_the_environment_and_wide_bind_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="dppo_trl.backends.cpu.vllm_server"):
        command, env = build_server_command(["--model", "m", "--api-key", "s3cret", "--host", "0.0.0.0"])
    assert env["VLLM_API_KEY"] == "s3cret" and "s3cret" not in command
    assert "--host 0.0.0.0" in " ".join(command)
    assert "development endpoints" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dppo_trl.backends.cpu.vllm_server"):
        build_server_command(["--model", "m", "--host", "::1"])
    assert not caplog.text


def test_launcher_refuses_to_change_what_dppo_needs():
    # Raw log-probs are not the distribution the server samples from, so they cannot be μ.
    with pytest.raises(SystemExit, match="--logprobs-mode"):
        build_server_command(["--model", "m", "--max-model-len", "64", "--logprobs-mode=raw_logprobs"])
    with pytest.raises(SystemExit, match="kv-cache-memory-bytes"):
        build_server_command(["--model", "m", "--kv-cache-memory-bytes", "0"])


def test_worker_extension_is_what_the_launcher_names():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.cpu_worker import CPUWorker

    from dppo_trl.backends.cpu.weight_sync import SERVER_RELOAD_METHOD, WeightReloadExtension

    assert resolve_obj_by_qualname(WORKER_EXTENSION) is WeightReloadExtension
    assert callable(getattr(WeightReloadExtension, SERVER_RELOAD_METHOD))
    # vLLM refuses extensions that shadow worker attributes. An in-process engine started earlier in the session has
    # already appended the extension to CPUWorker's bases, so look past it rather than at hasattr.
    owners = [cls for cls in CPUWorker.__mro__ if SERVER_RELOAD_METHOD in vars(cls)]
    assert owners in ([], [WeightReloadExtension])
