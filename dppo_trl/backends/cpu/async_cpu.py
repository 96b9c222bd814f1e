"""CPU paths for TRL's experimental `AsyncGRPOTrainer`, chosen at run time where TRL's own path is GPU-only.

Two parts of TRL 1.16's asynchronous trainer need CUDA:

1. **Tree attention.** The model is built with `attn_implementation="tree_fa3"`, which TRL registers in transformers'
   `AttentionInterface` as a FlashAttention-3 varlen kernel downloaded from the Hub (`kernels.get_kernel`).
   `tree_attention_cpu` is the same contract in plain PyTorch: each packed segment's queries attend, causally and
   bottom-right aligned (FlashAttention's convention when there are more keys than queries), to the K/V rows of its
   root-to-segment path, with float32 score matrices per segment (O(L²) memory). It is the reference that
   `dppo_trl.kernels.tree_attention.tree_attention_sdpa` (the trainer's default wherever FA3 cannot run, CPU
   included: `AsyncDPPOConfig.tree_attention`) is checked against, and `tree_attention="eager"` runs it.
   `cpu_tree_attention()` registers it under TRL's name only while its `with` block runs and then puts back whatever
   was registered before, so no global state is left behind.
2. **Peak-FLOPs lookup.** `AsyncGRPOTrainer.__init__` asks `torch.cuda.get_device_name` for the device's peak FLOPs
   (for its MFU metric), which raises on a CPU-only torch. `cpu_peak_flops()` answers `None` (MFU off, as TRL does for
   an unknown device) while its block runs; TRL's function is put back on exit.

A plain `AsyncGRPOTrainer` runs on CPU when it is constructed inside `cpu_peak_flops()` and trained inside
`cpu_tree_attention()` or `registered_tree_attention(tree_attention_sdpa)` (TRL's constructor registers its FA3
function, so the other one goes in afterwards), with `weight_transfer=FileWeightTransfer(...)`;
`dppo_trl.AsyncDPPOTrainer` does all three itself.
3. **NCCL weight transfer.** `FileWeightTransfer` implements TRL's `WeightTransferProtocol` with the file-based
   reload CPU server mode already uses (`dppo_trl.backends.cpu.weight_sync.reload_server_weights_from_file`: a safetensors file in a
   private temporary directory, reloaded by the server's `WeightReloadExtension` over `/collective_rpc`). The server
   is `python -m dppo_trl.backends.cpu.vllm_server` (processed log-probs, development endpoints, the worker extension).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import requests
import torch

from dppo_trl.backends.cpu.construction import swapped_attribute
from dppo_trl.backends.cpu.weight_sync import reload_server_weights_from_file
from dppo_trl.backends.server_auth import API_KEY_ENV

__all__ = [
    "FileWeightTransfer",
    "cpu_peak_flops",
    "cpu_tree_attention",
    "tree_attention_cpu",
    "tree_attention_name",
]


def tree_attention_name() -> str:
    """TRL's attention-implementation name for packed tree rows (`trl.experimental.async_grpo.packing`)."""
    from trl.experimental.async_grpo.packing import TREE_ATTENTION

    return TREE_ATTENTION


def tree_attention_cpu(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q=None,
    tree_max_seqlen_k=None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Variable-length causal attention over a packed tree row, in plain PyTorch (any device).

    `query`/`key`/`value` are `(1, heads, N, head_dim)` (key/value may have fewer heads: grouped-query attention).
    Segment s owns queries `cu_q[s]:cu_q[s+1]` and attends to the K/V rows `tree_kv_index[cu_k[s]:cu_k[s+1]]`, the
    last `L_q` of which are its own tokens: query i sees key j iff `j ≤ i + L_k − L_q` (and, with a sliding window w,
    `j > i + L_k − L_q − w`). Softmax in float32. Returns `((1, N, heads, head_dim), None)` like transformers'
    attention functions. `dropout` is accepted and ignored: the trainer's forward is not a dropout forward.
    """
    _, heads, n_tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    q_all = query[0].transpose(0, 1)  # (N, H, D)
    k_all = key[0].transpose(0, 1).index_select(0, tree_kv_index.long())
    v_all = value[0].transpose(0, 1).index_select(0, tree_kv_index.long())
    cu_q = tree_cu_seqlens_q.tolist()
    cu_k = tree_cu_seqlens_k.tolist()
    out = query.new_zeros(n_tokens, heads, head_dim)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        len_q, len_k = q1 - q0, k1 - k0
        if len_q == 0:
            continue
        q = q_all[q0:q1].transpose(0, 1).float()  # (H, Lq, D)
        k = k_all[k0:k1].transpose(0, 1).float()  # (Hkv, Lk, D)
        v = v_all[k0:k1].transpose(0, 1).float()
        if kv_heads != heads:
            k = k.repeat_interleave(heads // kv_heads, dim=0)
            v = v.repeat_interleave(heads // kv_heads, dim=0)
        scores = (q @ k.transpose(-1, -2)) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        rows = torch.arange(len_q, device=q.device).unsqueeze(1) + (len_k - len_q)
        cols = torch.arange(len_k, device=q.device).unsqueeze(0)
        allowed = cols <= rows
        if sliding_window:
            allowed = allowed & (cols > rows - sliding_window)
        scores = scores.masked_fill(~allowed, -math.inf)
        out[q0:q1] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(out.dtype)
    return out.unsqueeze(0), None


@contextlib.contextmanager
def cpu_tree_attention() -> Iterator[None]:
    """Register `tree_attention_cpu` (and TRL's no-op mask) under TRL's tree-attention name for the `with` block only,
    then restore the previous registrations (TRL's FA3 kernel, or nothing)."""
    from dppo_trl.kernels.tree_attention import registered_tree_attention

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
