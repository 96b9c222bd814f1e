"""Which server client a `vllm_mode="server"` trainer builds, decided per device at run time
(`dppo_trl.backends.cpu.construction.server_client_class`): the file-based weight sync only on a CPU trainer, the
API-key header on every device when `$VLLM_API_KEY` is set, TRL's client unchanged on CUDA otherwise."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from dppo_trl.backends.cpu.construction import server_client_class, trainer_construction_patches

vllm_client = pytest.importorskip("trl.generation.vllm_client")
VLLMClient = vllm_client.VLLMClient


def _names(cls: type) -> list[str]:
    return [c.__name__ for c in cls.__mro__[: cls.__mro__.index(VLLMClient)]]


@pytest.mark.parametrize("device", ["cuda", torch.device("cuda", 1)])
def test_cuda_trainer_without_a_key_keeps_trls_client(device):
    assert server_client_class(VLLMClient, device, api_key=None) is VLLMClient


def test_cuda_trainer_with_a_key_gets_only_the_header():
    client = server_client_class(VLLMClient, "cuda", api_key="s3cret")
    assert _names(client) == ["APIKeyVLLMClient"]
    # TRL's NCCL weight sync is untouched on CUDA.
    assert client.init_communicator is VLLMClient.init_communicator
    assert client.update_named_params is VLLMClient.update_named_params


@pytest.mark.parametrize(
    ("api_key", "expected"),
    [(None, ["CPUWeightSyncVLLMClient"]), ("k", ["CPUWeightSyncVLLMClient", "APIKeyVLLMClient"])],
)
def test_cpu_trainer_gets_the_file_sync(api_key, expected):
    client = server_client_class(VLLMClient, torch.device("cpu"), api_key=api_key)
    assert _names(client) == expected
    assert client.init_communicator is not VLLMClient.init_communicator


def test_server_mode_needs_the_trainers_device():
    with pytest.raises(ValueError, match="trainer's device"), trainer_construction_patches(True, "server"):
        pass


def test_construction_swaps_nothing_for_a_cuda_trainer_without_a_key():
    import trl.generation.vllm_generation as vllm_generation

    with trainer_construction_patches(True, "server", device="cuda", api_key=""):
        assert vllm_generation.VLLMClient is VLLMClient
    with trainer_construction_patches(True, "server", device="cpu", api_key=""):
        assert _names(vllm_generation.VLLMClient) == ["CPUWeightSyncVLLMClient"]
    assert vllm_generation.VLLMClient is VLLMClient


class _RecordingServer(ThreadingHTTPServer):
    """Answers what `VLLMClient.__init__` asks (`/health`, `/v1/models`) and records each request's auth header."""

    def __init__(self):
        self.seen: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.seen.append((self.path, self.headers.get("Authorization")))
                body = json.dumps({"data": [{"id": "tiny"}]} if self.path.startswith("/v1/models") else {}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def test_the_key_reaches_the_servers_v1_routes_from_a_cuda_trainers_client():
    """The decision for a CUDA trainer with a key, built for real against an HTTP server: every /v1 request
    carries the bearer token (vLLM's `--api-key` guards /v1)."""
    pytest.importorskip("vllm")
    server = _RecordingServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client_class = server_client_class(VLLMClient, "cuda", api_key="s3cret")
        client = client_class(base_url=f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert client.model == "tiny"
    v1 = [auth for path, auth in server.seen if path.startswith("/v1")]
    assert v1 == ["Bearer s3cret"]
