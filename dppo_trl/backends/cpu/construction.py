"""The TRL module symbols a trainer swaps while its parent constructor builds the vLLM engine or client.

TRL's `VLLMGeneration._init_vllm` builds the colocated engine with the module symbol `LLM` and the server client
with `VLLMClient`, inside `GRPOTrainer.__init__`, and takes no argument that could carry the CPU engine settings or a
client class (docs/upstream.md, "CPU runtime", proposes the argument that would). So those two symbols are swapped
for the constructor's block only (`trainer_construction_patches`), with TRL's originals held in the context
manager's own frame, never in module state, and restored on exit. Pinned in tests/trl_contract.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dppo_trl.backends.cpu.engine import EngineOptions, cpu_llm_factory
from dppo_trl.backends.cpu.platform import is_vllm_cpu_platform
from dppo_trl.backends.cpu.server_client import cpu_sync_client_class

__all__ = ["swapped_attribute", "trainer_construction_patches"]


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


@contextlib.contextmanager
def trainer_construction_patches(
    use_vllm: bool, vllm_mode: str, engine: EngineOptions | None = None
) -> Iterator[None]:
    """The TRL swaps a trainer needs while its parent constructor builds the vLLM engine or client.

    Colocate on vLLM's CPU platform: `LLM` builds the engine with `engine`'s settings (default `EngineOptions()`:
    float32, a 64 MiB KV cache, eager). Server mode: `VLLMClient` is the CPU-sync subclass
    (`server_client.cpu_sync_client_class`). Everything is restored on exit, and so is `torch.set_num_threads`,
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

            stack.enter_context(swapped_attribute(vllm_generation, "VLLMClient", cpu_sync_client_class))
        yield
