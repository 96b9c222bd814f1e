"""Moving the trainer's weights into a vLLM CPU engine: in the engine's worker, in colocate mode, and over a file
to a server.

vLLM's CPU linear layers prepack their weight after loading and leave `layer.weight` empty, so TRL's per-tensor
`model.load_weights(...)` fails (`'Parameter' object has no attribute 'weight_loader'`). Every sync here goes
through vLLM's supported in-place reload (`Worker.reload_weights`), which restores checkpoint-format layers, loads
and repacks them, and then redoes the two CPU steps that reload skips:

- **Tied LM heads.** With tied embeddings the reload never loads `ParallelLMHead` itself, so its prepacked copy
  keeps the old weights; its `process_weights_after_loading` is re-run after every reload.
- **MoE experts.** The CPU MoE kernel prepacks each layer's expert weights (`w13`/`w2`) into its grouped-gemm layout
  once, at load time; on an in-place reload vLLM (0.32) treats the layer as a weight update and skips that prepack,
  so the kernel would read plain checkpoint-layout values as if they were packed (logprobs off by several nats
  after the first sync). The reloaded expert layers are re-packed in place.

Colocate: `bind_colocate_weight_sync` gives one trainer's `VLLMGeneration` a `sync_weights` that pushes the
generation's `_iter_named_params()` (the trainer's walk: for a LoRA model DPPO's out-of-place merge, gathered one
layer at a time under ZeRO-3, `dppo_trl.weights.stream`) through `llm.collective_rpc` into the reload. Server: `reload_server_weights_from_file` writes the stream to one safetensors file in a fresh private
temporary directory and asks the server (`python -m dppo_trl.backends.cpu.vllm_server`, whose workers carry
`WeightReloadExtension`) to reload from it over `/collective_rpc`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from dppo_trl.backends.cpu.platform import is_vllm_cpu_platform

__all__ = [
    "SERVER_RELOAD_METHOD",
    "WEIGHTS_FILE",
    "WeightReloadExtension",
    "bind_colocate_weight_sync",
    "colocate_sync_weights",
    "reload_in_place",
    "reload_server_weights_from_file",
]

# Worker method the server runs over `/collective_rpc`; its only argument is a path, so it travels as JSON.
SERVER_RELOAD_METHOD = "dppo_reload_weights"
WEIGHTS_FILE = "model.safetensors"


def _cpu_moe_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """`(layer, experts)` for every MoE layer run by vLLM's CPU grouped-gemm kernel (the one that prepacks weights)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without this kernel has nothing to re-pack
        return []
    layers = []
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        # zentorch's kernel reads the plain layout, so only the grouped-gemm path needs packing.
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            layers.append((module, experts))
    return layers


def _repack_cpu_moe_experts(layer: torch.nn.Module, experts: Any) -> None:
    """Prepack a reloaded MoE layer's expert weights in place (the step vLLM skips on weight updates)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    for name in ("w13_weight", "w2_weight"):
        param = getattr(layer, name)
        # In place: the reload just copied the plain values into this storage, which is what the kernel reads.
        param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))


def reload_in_place(worker: Any, **reload_kwargs: Any) -> None:
    """vLLM's in-place `Worker.reload_weights(**reload_kwargs, is_checkpoint_format=True)`, then the CPU re-processing
    it skips (module docstring). Shared by the colocate sync (`weights_iterator=`) and the server's
    `WeightReloadExtension` (`weights_path=`).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    model = worker.model_runner.get_model()
    # Only MoE layers the reload actually processed hold plain values; packing any other layer twice would corrupt
    # it. The reload calls each processed layer's `quant_method.process_weights_after_loading`, so that call is
    # recorded (an instance attribute shadowing the method, removed afterwards).
    reloaded: list[tuple[torch.nn.Module, Any]] = []
    moe_layers = _cpu_moe_experts(model)
    for layer, experts in moe_layers:
        method: Any = layer.quant_method
        process = method.process_weights_after_loading

        def recording(module: torch.nn.Module, _process: Any = process, _experts: Any = experts) -> None:
            _process(module)
            reloaded.append((module, _experts))

        method.process_weights_after_loading = recording
    try:
        worker.reload_weights(**reload_kwargs, is_checkpoint_format=True)
    finally:
        for layer, _ in moe_layers:
            restored: Any = layer.quant_method
            del restored.process_weights_after_loading
    for layer, experts in reloaded:
        _repack_cpu_moe_experts(layer, experts)
    # A tied head shares the embedding's weight but is never loaded itself, so the reload skips its processing and
    # its CPU-prepacked copy would keep serving the old weights. Re-processing is cheap and harmless for untied heads.
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            module.quant_method.process_weights_after_loading(module)


def _reload_weights_on_worker(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Runs inside the vLLM worker: `reload_in_place` from `weights`; returns the number of tensors received."""
    received = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal received
        for name, tensor in weights:
            received += 1
            yield name, tensor

    reload_in_place(worker, weights_iterator=counted())
    return received


def _detached_copies(named_params: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    # vLLM's layerwise reload buffers tensors until a whole layer has arrived, but the walks (TRL's and
    # `dppo_trl.weights.stream`'s) only guarantee a tensor while suspended at its yield: ZeRO-3 re-partitions gathered
    # params, and TRL's walk unmerges adapters in place after the last one. Copies keep the buffered values valid;
    # peak extra memory is about one layer.
    for name, tensor in named_params:
        yield name, tensor.detach().clone()


def colocate_sync_weights(generation: Any) -> None:
    """`VLLMGeneration.sync_weights` for colocate mode on vLLM CPU (bound to an instance by
    `bind_colocate_weight_sync`)."""
    if generation.enable_sleep_mode:
        # Same contract as TRL: weights must be mapped before they are written.
        generation.llm.wake_up(tags=["weights"])
        generation._llm_weights_sleeping = False

    # `external_launcher` keeps the engine in this process, so the callable and the lazy iterator are passed by
    # reference (nothing is pickled) and TRL's gather/merge logic runs while the worker consumes it.
    received = generation.llm.collective_rpc(
        _reload_weights_on_worker, args=(_detached_copies(generation._iter_named_params()),)
    )
    if not any(received):
        # An empty push would leave the engine silently sampling from stale weights.
        raise RuntimeError("vLLM weight sync received no tensors from the trainer model.")
    generation.llm.reset_prefix_cache()


def bind_colocate_weight_sync(vllm_generation: Any) -> bool:
    """Give this `VLLMGeneration` (colocate, vLLM CPU) the reload-based sync, on the instance only; True if bound."""
    if vllm_generation.mode != "colocate" or not is_vllm_cpu_platform():
        return False
    vllm_generation.sync_weights = types.MethodType(colocate_sync_weights, vllm_generation)
    return True


class WeightReloadExtension:
    """vLLM worker extension (`--worker-extension-cls dppo_trl.backends.cpu.weight_sync.WeightReloadExtension`,
    which `python -m dppo_trl.backends.cpu.vllm_server` passes) adding the server-side half of the CPU weight sync.

    vLLM's own `reload_weights` over `/collective_rpc` leaves a tied LM head serving its old CPU-prepacked weights
    (measured: log-prob error ~1 after a sync) and MoE experts unpacked; this method reloads through the same
    `reload_in_place` as colocate, which refreshes both.
    """

    def dppo_reload_weights(self, weights_path: str) -> None:
        reload_in_place(self, weights_path=weights_path)


def reload_server_weights_from_file(client: Any, named_params: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Push `named_params` to a vLLM server through a safetensors file; returns the number of tensors.

    `client` needs `base_url` and `_post(url, json=...)` (TRL's `VLLMClient` has both). The file goes into a fresh
    directory this process creates (mode 0700, under `$TMPDIR`), never a path taken from elsewhere, and is removed
    once the server has reloaded, whether or not the reload succeeded. The server must be able to read it: same
    machine and user, or a `$TMPDIR` both can reach.
    """
    from safetensors.torch import save_file

    tensors = {name: tensor.contiguous() for name, tensor in _detached_copies(named_params)}
    if not tensors:
        # An empty push would leave the server silently sampling from stale weights.
        raise RuntimeError("vLLM weight sync received no tensors from the trainer model.")
    directory = tempfile.mkdtemp(prefix="dppo-vllm-weights-")
    try:
        save_file(tensors, os.path.join(directory, WEIGHTS_FILE))
        count = len(tensors)
        del tensors
        client._post(
            f"{client.base_url}/collective_rpc",
            json={"method": SERVER_RELOAD_METHOD, "kwargs": {"weights_path": directory}},
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return count
