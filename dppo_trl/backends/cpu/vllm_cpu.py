"""Make TRL 1.16's vLLM colocate mode work on the CPU build of vLLM (`vllm-cpu` 0.31/0.32).

Four things break there without help:

1. **Weight sync crashes.** vLLM's CPU linear layers prepack their weight after loading and leave `layer.weight`
   empty, so TRL's per-tensor `model.load_weights(...)` fails (`'Parameter' object has no attribute
   'weight_loader'`). The fix routes the sync through vLLM's supported in-place reload (`Worker.reload_weights`),
   which restores checkpoint-format layers, loads and repacks them.
2. **Tied LM heads go stale.** With tied embeddings the reload never loads `ParallelLMHead` itself, so its prepacked
   copy keeps the old weights; its `process_weights_after_loading` is re-run after every reload.
3. **dtype downcast.** TRL passes no `dtype`, and `"auto"` turns fp32 checkpoints into bf16 on x86 CPUs, so trainer
   and engine logprobs drift apart by ~1e-3. The engine is built with `dtype="float32"` instead (plus a fixed KV
   cache size and eager mode, which make start-up much faster on CPU).

4. **MoE experts come back unpacked.** The CPU MoE kernel prepacks each layer's expert weights (`w13`/`w2`) into
   its grouped-gemm layout once, at load time; on an in-place reload vLLM (0.32) treats the layer as a weight update
   and skips that prepack, so the kernel reads plain checkpoint-layout values as if they were packed (logprobs off by
   several nats after the first sync). The sync re-packs the reloaded expert layers in place.

`patch_trl_vllm_for_cpu()` applies both patches (engine defaults and colocate weight sync); it is idempotent and a
no-op off the CPU platform unless forced. `PATCH_STATE` records what was patched.

Server mode (`vllm_mode="server"`, a server started with `python -m dppo_trl.backends.cpu.vllm_server`) has a fifth problem: TRL
pushes weights over an NCCL group (`VLLMClient.init_communicator` raises on a CPU trainer) and vLLM has no CPU
weight-transfer backend. `patch_trl_vllm_server_for_cpu()` swaps in a `VLLMClient` subclass that, when the trainer's
device is the CPU, skips the communicator and receives TRL's own weight stream (`sync_weights` is untouched, so every
rank still iterates the parameters and PEFT merge/unmerge and ZeRO-3 gathers apply): rank 0 writes it to one
safetensors file in a fresh private temporary directory, asks the server over `/collective_rpc` to reload from it
(`WeightReloadExtension`: vLLM's `reload_weights`, then the same MoE re-pack and tied-head refresh as colocate), and removes the directory; TRL then
resets the prefix cache. On CUDA it is TRL's client unchanged.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dppo_trl.backends.cpu.vllm_server import WORKER_EXTENSION

logger = logging.getLogger(__name__)

__all__ = [
    "PATCH_STATE",
    "PatchState",
    "is_vllm_cpu_platform",
    "patch_trl_vllm_for_cpu",
    "patch_trl_vllm_server_for_cpu",
    "trainer_construction_patches",
    "trainer_cpu_threads",
    "unpatch_trl_vllm_for_cpu",
    "unpatch_trl_vllm_server_for_cpu",
]


@dataclass
class PatchState:
    """What `patch_trl_vllm_for_cpu` changed in this process (read by contract tests)."""

    llm_patched: bool = False
    sync_weights_patched: bool = False
    forced: bool = False
    llm_defaults: dict[str, Any] = field(default_factory=dict)
    # Originals, kept so the patches can be undone and server mode can keep TRL's sync.
    original_llm: Any = None
    original_sync_weights: Any = None

    @property
    def applied(self) -> bool:
        return self.llm_patched or self.sync_weights_patched


PATCH_STATE = PatchState()


def is_vllm_cpu_platform() -> bool:
    """True when vLLM is importable and its current platform is the CPU one; never raises."""
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # a broken or partial vLLM install must not break callers
        return False


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


def _reload_weights_on_worker(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Runs inside the vLLM worker: in-place reload of `weights`, then refresh the prepacked LM heads and MoE experts.

    Returns the number of tensors received.
    """
    received = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal received
        for name, tensor in weights:
            received += 1
            yield name, tensor

    reload_in_place(worker, weights_iterator=counted())
    return received


def reload_in_place(worker: Any, **reload_kwargs: Any) -> None:
    """vLLM's in-place `Worker.reload_weights(**reload_kwargs, is_checkpoint_format=True)`, then the CPU re-processing
    it skips. Shared by the colocate sync (`weights_iterator=`) and the server's `WeightReloadExtension`
    (`weights_path=`).

    Two things a reload leaves stale on CPU: MoE expert weights (module docstring, problem 4) and a tied LM head's
    prepacked copy (problem 2).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    model = worker.model_runner.get_model()
    # Only MoE layers the reload actually processed hold plain values; packing any other layer twice would corrupt
    # it. The reload calls each processed layer's `quant_method.process_weights_after_loading`, so that call is
    # recorded (an instance attribute shadowing the method, removed afterwards).
    reloaded: list[tuple[torch.nn.Module, Any]] = []
    moe_layers = _cpu_moe_experts(model)
    for layer, experts in moe_layers:
        method = layer.quant_method
        process = method.process_weights_after_loading

        def recording(module, _process=process, _experts=experts):
            _process(module)
            reloaded.append((module, _experts))

        method.process_weights_after_loading = recording
    try:
        worker.reload_weights(**reload_kwargs, is_checkpoint_format=True)
    finally:
        for layer, _ in moe_layers:
            del layer.quant_method.process_weights_after_loading
    for layer, experts in reloaded:
        _repack_cpu_moe_experts(layer, experts)
    # A tied head shares the embedding's weight but is never loaded itself, so the reload skips its processing and
    # its CPU-prepacked copy would keep serving the old weights. Re-processing is cheap and harmless for untied heads.
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            module.quant_method.process_weights_after_loading(module)


def _detached_copies(named_params: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    # vLLM's layerwise reload buffers tensors until a whole layer has arrived, but TRL's iterator only guarantees a
    # tensor while it is suspended at its yield: PEFT unmerges adapters in place after the last one and ZeRO-3
    # re-partitions gathered params. Copies keep the buffered values valid; peak extra memory is about one layer.
    for name, tensor in named_params:
        yield name, tensor.detach().clone()


def _colocate_sync_weights_via_reload(self) -> None:
    """`VLLMGeneration.sync_weights` for colocate mode on vLLM CPU; server mode keeps TRL's implementation."""
    if self.mode != "colocate":
        return PATCH_STATE.original_sync_weights(self)

    if self.enable_sleep_mode:
        # Same contract as TRL: weights must be mapped before they are written.
        self.llm.wake_up(tags=["weights"])
        self._llm_weights_sleeping = False

    # `external_launcher` keeps the engine in this process, so the callable and the lazy iterator are passed by
    # reference (nothing is pickled) and TRL's gather/merge logic runs while the worker consumes it.
    received = self.llm.collective_rpc(_reload_weights_on_worker, args=(_detached_copies(self._iter_named_params()),))
    if not any(received):
        # An empty push would leave the engine silently sampling from stale weights.
        raise RuntimeError("vLLM weight sync received no tensors from the trainer model.")
    self.llm.reset_prefix_cache()


def _make_cpu_llm_factory(original_llm: Any, defaults: dict[str, Any]) -> Any:
    def cpu_llm(*args, **kwargs):
        """`vllm.LLM` with CPU-friendly defaults for the arguments TRL does not pass."""
        if kwargs.get("enable_sleep_mode") and is_vllm_cpu_platform():
            raise ValueError(
                "vLLM's CPU backend does not support sleep mode; set `vllm_enable_sleep_mode=False` in the config."
            )
        for key, value in defaults.items():
            kwargs.setdefault(key, value)
        return original_llm(*args, **kwargs)

    cpu_llm.__wrapped__ = original_llm
    return cpu_llm


def patch_trl_vllm_for_cpu(
    kv_cache_memory_bytes: int | None = 64 * 2**20,
    dtype: str | None = "float32",
    enforce_eager: bool | None = True,
    force: bool = False,
) -> PatchState:
    """Patch TRL's vLLM colocate backend so it trains correctly on vLLM's CPU platform.

    - The `LLM` symbol used by `trl.generation.vllm_generation` gets defaults for `dtype`, `kv_cache_memory_bytes`
      and `enforce_eager` (only where the caller passes none; `None` leaves that argument to vLLM). Sleep mode is
      rejected with a clear error since the CPU backend cannot do it.
    - `VLLMGeneration.sync_weights` in colocate mode pushes TRL's `_iter_named_params()` (so PEFT merge/unmerge and
      gathering still apply) through `llm.collective_rpc` into vLLM's in-place `reload_weights`, re-processes
      `ParallelLMHead`s and resets the prefix cache. Server mode keeps TRL's original.

    Does nothing unless vLLM's platform is CPU or `force=True`. Idempotent: a second call changes nothing (undo with
    `unpatch_trl_vllm_for_cpu` first to change the defaults). Returns `PATCH_STATE`.
    """
    if PATCH_STATE.applied:
        return PATCH_STATE
    if not force and not is_vllm_cpu_platform():
        logger.debug("vLLM CPU platform not detected; TRL's vLLM backend left unpatched.")
        return PATCH_STATE

    import trl.generation.vllm_generation as vllm_generation
    from vllm import LLM

    defaults = {
        key: value
        for key, value in {
            "dtype": dtype,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "enforce_eager": enforce_eager,
        }.items()
        if value is not None
    }
    original_llm = getattr(vllm_generation, "LLM", LLM)
    vllm_generation.LLM = _make_cpu_llm_factory(original_llm, defaults)

    generation_cls = vllm_generation.VLLMGeneration
    PATCH_STATE.original_sync_weights = generation_cls.sync_weights
    generation_cls.sync_weights = _colocate_sync_weights_via_reload

    PATCH_STATE.original_llm = original_llm
    PATCH_STATE.llm_defaults = defaults
    PATCH_STATE.llm_patched = True
    PATCH_STATE.sync_weights_patched = True
    PATCH_STATE.forced = force
    logger.info(
        "Patched TRL's vLLM colocate backend for vLLM's CPU platform%s: engine defaults %s (fp32 parity, small KV "
        "cache, fast start-up); colocate weight sync goes through Worker.reload_weights, because CPU prepacks "
        "linear weights and TRL's per-tensor load_weights cannot write them.",
        " (forced)" if force else "",
        defaults,
    )
    return PATCH_STATE


def unpatch_trl_vllm_for_cpu() -> None:
    """Restore TRL's original `LLM` symbol and `sync_weights` (no-op if nothing was patched)."""
    if not PATCH_STATE.applied:
        return
    import trl.generation.vllm_generation as vllm_generation

    if PATCH_STATE.llm_patched:
        vllm_generation.LLM = PATCH_STATE.original_llm
    if PATCH_STATE.sync_weights_patched:
        vllm_generation.VLLMGeneration.sync_weights = PATCH_STATE.original_sync_weights
    PATCH_STATE.__init__()  # back to the pristine state


# ----------------------------------------------------------------------------------------------------------------
# Server mode
# ----------------------------------------------------------------------------------------------------------------
# Trainers send this key (vLLM's own variable, so one `export` serves the server and the trainer).
API_KEY_ENV = "VLLM_API_KEY"
# Worker method the server runs over `/collective_rpc`; its only argument is a path, so it travels as JSON.
SERVER_RELOAD_METHOD = "dppo_reload_weights"
WEIGHTS_FILE = "model.safetensors"


class WeightReloadExtension:
    """vLLM worker extension (`--worker-extension-cls dppo_trl.backends.cpu.vllm_cpu.WeightReloadExtension`, which
    `python -m dppo_trl.backends.cpu.vllm_server` passes) adding the server-side half of the CPU weight sync.

    vLLM's own `reload_weights` over `/collective_rpc` leaves a tied LM head serving its old CPU-prepacked weights
    (measured: log-prob error ~1 after a sync) and MoE experts unpacked; this method reloads through the same
    `reload_in_place` as colocate, which refreshes both.
    """

    def dppo_reload_weights(self, weights_path: str) -> None:
        reload_in_place(self, weights_path=weights_path)


def _is_cpu_device(device: Any) -> bool:
    # TRL reads a bare int as a CUDA index.
    return not isinstance(device, int) and torch.device(device).type == "cpu"


def reload_server_weights_from_file(client: Any, named_params: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Push `named_params` to a vLLM server through a safetensors file; returns the number of tensors.

    The file goes into a fresh directory this process creates (mode 0700, under `$TMPDIR`), never a path taken from
    elsewhere, and is removed once the server has reloaded, whether or not the reload succeeded. The server must be
    able to read it: same machine and user, or a `$TMPDIR` both can reach.
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


_SERVER_CLIENT_CLASSES: dict[Any, Any] = {}


def _cpu_sync_client_class(base: Any) -> Any:
    """A subclass of TRL's `VLLMClient` that syncs weights through a file when the trainer runs on the CPU."""
    if base in _SERVER_CLIENT_CLASSES:
        return _SERVER_CLIENT_CLASSES[base]

    class CPUWeightSyncVLLMClient(base):
        """TRL's `VLLMClient`; on a CPU trainer, weights reach the server as a file instead of over NCCL."""

        dppo_original_class = base
        file_sync = False

        def check_server(self, *args, **kwargs):
            # `VLLMClient.__init__` calls this right after creating its session and before its first /v1 request,
            # so the key set here covers every request the client makes.
            api_key = os.environ.get(API_KEY_ENV)
            if api_key:
                self.session.headers["Authorization"] = f"Bearer {api_key}"
            return super().check_server(*args, **kwargs)

        def init_communicator(self, device=0):
            if not _is_cpu_device(device):
                return super().init_communicator(device)
            # Fails with TRL's own message (restart with VLLM_SERVER_DEV_MODE=1) when the sync endpoints are missing.
            info = self.get_server_info()
            extension = info.get("parallel_config", {}).get("worker_extension_cls")
            if extension != WORKER_EXTENSION:
                raise RuntimeError(
                    f"The vLLM server at {self.base_url} cannot take weights from a CPU trainer: it runs without "
                    f"`--worker-extension-cls {WORKER_EXTENSION}` (found {extension!r}). Start it with "
                    "`python -m dppo_trl.backends.cpu.vllm_server --model ...`, which sets it, or add that option to its command."
                )
            self.file_sync = True
            logger.info("CPU trainer: vLLM server weights are synced through a safetensors file and reload_weights.")

        def update_named_params(self, metadata, named_params):
            if not self.file_sync:
                return super().update_named_params(metadata, named_params)
            reload_server_weights_from_file(self, named_params)

    _SERVER_CLIENT_CLASSES[base] = CPUWeightSyncVLLMClient
    return CPUWeightSyncVLLMClient


def patch_trl_vllm_server_for_cpu() -> Any:
    """Make TRL's server mode build `CPUWeightSyncVLLMClient`s; returns the class. Idempotent.

    The client behaves as TRL's unless the trainer's device is the CPU, where it skips the NCCL communicator and
    `update_named_params` reloads the server from a safetensors file (`reload_server_weights_from_file`). It also
    sends `$VLLM_API_KEY` as a bearer token when set, which TRL's client cannot.
    """
    import trl.generation.vllm_generation as vllm_generation

    current = vllm_generation.VLLMClient
    if getattr(current, "dppo_original_class", None) is not None:
        return current
    vllm_generation.VLLMClient = _cpu_sync_client_class(current)
    return vllm_generation.VLLMClient


def unpatch_trl_vllm_server_for_cpu() -> None:
    """Restore TRL's `VLLMClient` in `trl.generation.vllm_generation` (no-op if it was not patched)."""
    import trl.generation.vllm_generation as vllm_generation

    original = getattr(vllm_generation.VLLMClient, "dppo_original_class", None)
    if original is not None:
        vllm_generation.VLLMClient = original


# ----------------------------------------------------------------------------------------------------------------
# Patches scoped to one trainer
# ----------------------------------------------------------------------------------------------------------------
# What DPPOTrainer uses (the `patch_*` functions above stay for callers who want the process-wide patch). TRL reads
# the module symbols `LLM` and `VLLMClient` only while it builds the engine or client, inside the trainer's
# constructor, so they are swapped for that block only, reference-counted across nested or concurrent constructions.
# The colocate weight sync is bound to the trainer's own `VLLMGeneration` instance, so it lives and dies with it.
_SYMBOL_SWAPS: dict[str, list] = {}  # symbol name -> [TRL's original, replacement, users]


@contextlib.contextmanager
def _swapped_trl_symbol(name: str, make_replacement) -> Iterator[None]:
    import trl.generation.vllm_generation as vllm_generation

    entry = _SYMBOL_SWAPS.get(name)
    if entry is None:
        current = getattr(vllm_generation, name)
        replacement = make_replacement(current)
        if replacement is current:  # already patched process-wide by a direct `patch_*` call: leave it to its owner
            yield
            return
        entry = _SYMBOL_SWAPS[name] = [current, replacement, 0]
        setattr(vllm_generation, name, replacement)
    entry[2] += 1
    try:
        yield
    finally:
        entry[2] -= 1
        if entry[2] == 0:
            del _SYMBOL_SWAPS[name]
            if getattr(vllm_generation, name) is entry[1]:
                setattr(vllm_generation, name, entry[0])


def _cpu_llm_replacement(current: Any) -> Any:
    if PATCH_STATE.llm_patched or getattr(current, "__wrapped__", None) is not None:
        return current
    return _make_cpu_llm_factory(
        current, {"dtype": "float32", "kv_cache_memory_bytes": 64 * 2**20, "enforce_eager": True}
    )


def _server_client_replacement(current: Any) -> Any:
    if getattr(current, "dppo_original_class", None) is not None:
        return current
    return _cpu_sync_client_class(current)


@contextlib.contextmanager
def trainer_construction_patches(use_vllm: bool, vllm_mode: str) -> Iterator[None]:
    """The TRL patches a DPPOTrainer needs while its parent constructor builds the vLLM engine or client.

    Colocate on vLLM's CPU platform: `LLM` gets the CPU defaults (`patch_trl_vllm_for_cpu`'s) unless a process-wide
    patch already set them. Server mode: `VLLMClient` is the CPU-sync subclass. Everything is restored on exit, and
    so is `torch.set_num_threads`, which vLLM's CPU worker replaces with a no-op when the colocated engine starts.
    """
    with contextlib.ExitStack() as stack:
        if use_vllm and vllm_mode == "colocate" and is_vllm_cpu_platform():
            set_num_threads = torch.set_num_threads
            stack.callback(setattr, torch, "set_num_threads", set_num_threads)
            stack.enter_context(_swapped_trl_symbol("LLM", _cpu_llm_replacement))
        if use_vllm and vllm_mode == "server":
            stack.enter_context(_swapped_trl_symbol("VLLMClient", _server_client_replacement))
        yield


def bind_colocate_weight_sync(vllm_generation: Any) -> bool:
    """Give this `VLLMGeneration` (colocate, vLLM CPU) the reload-based sync, on the instance only; True if bound."""
    if vllm_generation.mode != "colocate" or not is_vllm_cpu_platform():
        return False
    # Bound even when the class is patched process-wide (`patch_trl_vllm_for_cpu`): whoever applied that patch may undo
    # it while this engine is still training, and the engine needs the reload-based sync for its whole life.
    vllm_generation.sync_weights = types.MethodType(_colocate_sync_weights_via_reload, vllm_generation)
    return True


_THREADS_LOGGED = False


def cpu_colocate_threads(local_world_size: int) -> int | None:
    """torch threads for a CPU trainer sharing its cores with a colocated vLLM engine; None leaves them alone.

    A launcher or user that set `OMP_NUM_THREADS` decides. Otherwise one thread per local process: measured on 2
    cores, torch's default (one thread per core) with the colocated engine runs several times slower per step than
    1 thread, which is what `accelerate launch` sets (docs/faults.md, "Thread counts").
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return 1 if local_world_size >= 1 else None


@contextlib.contextmanager
def trainer_cpu_threads(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` torch intra-op threads, then restore the previous count (None: no change)."""
    global _THREADS_LOGGED
    previous = torch.get_num_threads()
    if threads is None or threads == previous:
        yield
        return
    if not _THREADS_LOGGED:
        logger.warning(
            "CPU trainer with a colocated vLLM engine and no OMP_NUM_THREADS: training with %d torch thread(s) "
            "instead of %d (the engine shares these cores; more threads oversubscribe them). Set OMP_NUM_THREADS "
            "to choose.",
            threads,
            previous,
        )
        _THREADS_LOGGED = True
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def bound_server_requests(client: Any, timeout: float | None) -> None:
    """Bound every request of a TRL `VLLMClient` to `timeout` seconds without an answer, not retried (None: no bound).

    TRL's session sends without a timeout, so a hung server hangs training, and its `Retry(read=5)` would repeat a
    timed-out generation five times. Connection retries (a killed server refuses connections) keep TRL's backoff,
    about 1 min in all.
    """
    if timeout is None:
        return
    from requests.adapters import HTTPAdapter

    class TimeoutAdapter(HTTPAdapter):
        def send(self, request, **kwargs):
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = timeout
            return super().send(request, **kwargs)

    current = client.session.get_adapter(client.base_url)
    retries = current.max_retries.new(read=0)
    adapter = TimeoutAdapter(max_retries=retries, pool_maxsize=getattr(current, "_pool_maxsize", 10))
    for prefix in ("http://", "https://"):
        client.session.mount(prefix, adapter)
