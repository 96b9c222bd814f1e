"""The TRL module symbols a trainer swaps while its parent constructor builds the vLLM engine or client.

TRL's `VLLMGeneration._init_vllm` builds the colocated engine with the module symbol `LLM` and the server client
with `VLLMClient`, inside `GRPOTrainer.__init__`, and takes no argument that could carry the CPU engine settings or a
client class (docs/upstream.md, "CPU runtime", proposes the argument that would). So those two symbols are swapped
for the constructor's block only (`trainer_construction_patches`), with TRL's originals held in the context
manager's own frame, never in module state, and restored on exit. Pinned in tests/trl_contract.py.

Where each swap applies:

- `LLM`: colocate mode on vLLM's CPU platform only (the CPU engine's settings).
- `VLLMClient`, server mode: `server_client_class` decides from the trainer's device and `$VLLM_API_KEY`. A CPU
  trainer gets the file-based weight sync (`server_client.cpu_sync_client_class`), CPU only. Any trainer, CUDA
  included, gets the API-key header when the variable is set (`dppo_trl/backends/server_auth.py`; not a CPU patch).
  A CUDA trainer without the variable gets TRL's client unchanged: nothing is swapped.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dppo_trl.backends.cpu.engine import EngineOptions, cpu_llm_factory
from dppo_trl.backends.cpu.platform import is_vllm_cpu_platform
from dppo_trl.backends.cpu.server_client import cpu_sync_client_class
from dppo_trl.backends.server_auth import API_KEY_ENV, api_key_client_class

__all__ = ["server_client_class", "swapped_attribute", "trainer_construction_patches"]


@contextlib.contextmanager
def swapped_attribute(owner: Any, name: str, make_replacement: Callable[[Any], Any]) -> Iterator[Any]:
    """`owner.name = make_replacement(owner.name)` for the block, then back to what it was; yields the replacement.

    Nested blocks unwind in order. If the attribute was replaced again by someone else meanwhile (another
    construction that has not finished yet), it is left to them: their exit restores what they found.
    """
    current = getattr(owner, name)
    replacement = make_replacement(current)
    setattr(owner, name, replacement)
    try:
        yield replacement
    finally:
        if getattr(owner, name) is replacement:
            setattr(owner, name, current)


def server_client_class(base: type, device: torch.device | str, api_key: str | None) -> type:
    """The server client a trainer on `device` builds in place of TRL's `VLLMClient` (`base`).

    `base` itself when nothing applies (a CUDA trainer without an API key); otherwise a subclass that adds, in this
    order, the API-key header (any device, when `api_key`) and the file-based weight sync (CPU trainers only).
    """
    client = base
    if api_key:
        client = api_key_client_class(client, api_key)
    if torch.device(device).type == "cpu":
        client = cpu_sync_client_class(client)
    return client


@contextlib.contextmanager
def trainer_construction_patches(
    use_vllm: bool,
    vllm_mode: str,
    engine: EngineOptions | None = None,
    *,
    device: torch.device | str | None = None,
    api_key: str | None = None,
) -> Iterator[None]:
    """The TRL swaps a trainer needs while its parent constructor builds the vLLM engine or client.

    Colocate on vLLM's CPU platform: `LLM` builds the engine with `engine`'s settings (default `EngineOptions()`:
    float32, a 64 MiB KV cache, eager). Server mode: `VLLMClient` is `server_client_class(VLLMClient, device,
    api_key)`, swapped only when that differs from TRL's class. `device` is the trainer's (`args.device`),
    required in server mode; `api_key` defaults to `$VLLM_API_KEY`. Everything is restored on exit, and so is `torch.set_num_threads`,
    which vLLM's CPU worker replaces with a no-op when the colocated engine starts.
    """
    with contextlib.ExitStack() as stack:
        if use_vllm and vllm_mode == "colocate" and is_vllm_cpu_platform():
            import trl.generation.vllm_generation as vllm_generation

            options = engine or EngineOptions()
            stack.callback(setattr, torch, "set_num_threads", torch.set_num_threads)
            stack.enter_context(
                swapped_attribute(vllm_generation, "LLM", lambda original: cpu_llm_factory(original, options))
            )
        if use_vllm and vllm_mode == "server":
            import trl.generation.vllm_generation as vllm_generation

            if device is None:
                raise ValueError("Server mode: pass the trainer's device (`args.device`); the client depends on it.")
            key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
            client = server_client_class(vllm_generation.VLLMClient, device, key)
            if client is not vllm_generation.VLLMClient:
                stack.enter_context(swapped_attribute(vllm_generation, "VLLMClient", lambda _: client))
        yield
