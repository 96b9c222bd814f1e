"""CPU paths for TRL's experimental `AsyncGRPOTrainer`, chosen at run time where TRL's own path is GPU-only.

Three parts of TRL 1.16's asynchronous trainer need CUDA:

1. **Tree attention.** The model is built with `attn_implementation="tree_fa3"`, which TRL registers in transformers'
   `AttentionInterface` as a FlashAttention-3 varlen kernel downloaded from the Hub (`kernels.get_kernel`).
   `cpu_tree_attention()` registers the float32 reference of the same contract in plain PyTorch
   (`dppo_trl.kernels.tree_attention.tree_attention_cpu`) under TRL's name only while its `with` block runs and then
   puts back whatever was registered before, so no global state is left behind. (`AsyncDPPOTrainer` chooses through
   `dppo_trl.backends.tree_attention`: SDPA wherever FA3 cannot run, CPU included.)
2. **Peak-FLOPs lookup.** `AsyncGRPOTrainer.__init__` asks `torch.cuda.get_device_name` for the device's peak FLOPs
   (for its MFU metric), which raises on a CPU-only torch. `cpu_peak_flops()` answers `None` (MFU off, as TRL does for
   an unknown device) while its block runs; TRL's function is put back on exit.
3. **NCCL weight transfer.** `FileWeightTransfer` implements TRL's `WeightTransferProtocol` with the file-based
   reload CPU server mode already uses (`dppo_trl.backends.cpu.weight_sync.reload_server_weights_from_file`: a safetensors file in a
   private temporary directory, reloaded by the server's `WeightReloadExtension` over `/collective_rpc`). The server
   is `python -m dppo_trl.backends.cpu.vllm_server` (processed log-probs, development endpoints, the worker extension).

A plain `AsyncGRPOTrainer` runs on CPU when it is constructed inside `cpu_peak_flops()` and trained inside
`cpu_tree_attention()` or `dppo_trl.backends.tree_attention.registered_tree_attention(tree_attention_sdpa)` (TRL's
constructor registers its FA3 function, so the other one goes in afterwards), with
`weight_transfer=FileWeightTransfer(...)`; `dppo_trl.AsyncDPPOTrainer` does all three itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import requests

from dppo_trl.backends.cpu.construction import swapped_attribute
from dppo_trl.backends.cpu.weight_sync import reload_server_weights_from_file
from dppo_trl.backends.server_auth import API_KEY_ENV
from dppo_trl.backends.tree_attention import registered_tree_attention
from dppo_trl.kernels.tree_attention import tree_attention_cpu

__all__ = [
    "FileWeightTransfer",
    "cpu_peak_flops",
    "cpu_tree_attention",
    "tree_attention_name",
]


def tree_attention_name() -> str:
    """TRL's attention-implementation name for packed tree rows (`trl.experimental.async_grpo.packing`)."""
    from trl.experimental.async_grpo.packing import TREE_ATTENTION

    return TREE_ATTENTION


@contextlib.contextmanager
def cpu_tree_attention() -> Iterator[None]:
    """Register `tree_attention_cpu` (and TRL's no-op mask) under TRL's tree-attention name for the `with` block only,
    then restore the previous registrations (TRL's FA3 kernel, or nothing)."""
    with registered_tree_attention(tree_attention_cpu):
        yield


@contextlib.contextmanager
def cpu_peak_flops() -> Iterator[None]:
    """While the block runs, the async trainer's peak-FLOPs lookup returns `None` (MFU metrics off) instead of asking
    CUDA for a device name."""
    from trl.experimental.async_grpo import async_grpo_trainer

    # TRL's constructor looks the function up in its module's namespace and offers no argument to skip it, so the
    # module symbol is swapped for the block (docs/upstream.md, "CPU runtime"; pinned in tests/trl_contract.py).
    with swapped_attribute(async_grpo_trainer, "get_peak_flops_per_device", lambda _: _no_peak_flops):
        yield


def _no_peak_flops(accelerator: Any, dtype: str) -> None:
    # TRL's own answer for a device whose peak FLOPs it does not know: MFU metrics off.
    return None


class _ReloadPoster:
    """The two attributes `reload_server_weights_from_file` uses of a client (`base_url`, `_post`), for a server URL."""

    def __init__(self, base_url: str, timeout: float):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _post(self, url: str, json: dict) -> dict:
        headers = {"Authorization": f"Bearer {os.environ[API_KEY_ENV]}"} if os.environ.get(API_KEY_ENV) else {}
        response = requests.post(url, json=json, headers=headers, timeout=self.timeout)
        if response.status_code != 200:
            raise RuntimeError(f"vLLM server {url} answered {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else {}


class FileWeightTransfer:
    """TRL's `WeightTransferProtocol` over a file instead of NCCL, for a CPU trainer and a
    `python -m dppo_trl.backends.cpu.vllm_server` server on the same machine (or sharing `$TMPDIR`).

    `pause`/`resume` are the server's own `/pause?mode=keep` and `/resume` (in-flight requests are frozen, not
    dropped); `send_weights` writes the streamed parameters to a safetensors file the server reloads in place.
    """

    def __init__(self, vllm_client, weight_sync_timeout: float = 1800.0):
        self.vllm = vllm_client
        self.poster = _ReloadPoster(vllm_client.server_url, weight_sync_timeout)
        self.weight_sync_timeout = weight_sync_timeout
        self.tensors_sent = 0

    def init_weight_transfer(self) -> None:
        self.vllm.wait_for_server_ready()
        info = self.vllm.get_server_info()
        worker_ext = info.get("parallel_config", {}).get("worker_extension_cls", "")
        if "WeightReloadExtension" not in str(worker_ext):
            raise RuntimeError(
                f"The vLLM server at {self.vllm.server_url} has no `WeightReloadExtension` worker extension, so a CPU "
                "trainer cannot sync weights to it. Start it with `python -m dppo_trl.backends.cpu.vllm_server --model ...`."
            )

    def pause(self) -> None:
        self.vllm.pause(timeout=int(self.weight_sync_timeout))

    def send_weights(self, iterator) -> None:
        self.tensors_sent = reload_server_weights_from_file(self.poster, iterator)

    def resume(self) -> None:
        self.vllm.resume(timeout=int(self.weight_sync_timeout))

    def destroy(self) -> None:
        pass
