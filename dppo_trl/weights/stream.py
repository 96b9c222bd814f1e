"""A PEFT model's weights as a vLLM engine loads them, merged out of place and gathered one decoder layer at a time.

`merged_named_weights(model)` yields `(name, tensor)` for exactly the tensors, names, dtypes and shapes, in the same
order, that TRL 1.16's merged-weight syncs send for a `PeftModel` (`VLLMGeneration._iter_named_params` in the
synchronous trainer, `_iter_vllm_named_params` behind the asynchronous trainer's manifest and stream), but:

- a LoRA-adapted base tensor is sent as `dppo_trl.weights.lora_merge.merged_tensor` (a new tensor, W + ΔW formed in
  float32 and rounded once), so the frozen base is only read: no `merge_adapter()` / `unmerge_adapter()`, whose
  bf16 round trip moves the base at every sync;
- under DeepSpeed ZeRO-3 the parameters are gathered one unit at a time, a unit being one element of the model's
  outermost `nn.ModuleList`s (a decoder layer, with its attention, experts and their adapters) or, outside them,
  one LoRA layer or one parameter (embeddings, final norm, LM head). TRL gathers every parameter of a PEFT model at
  once ("we must gather the full model at once before merging"); here the peak is the largest unit;
- under FSDP2 each `DTensor` is materialised with `full_tensor()` when it is read (base, A, B), one at a time.

A tensor that is not merged (a norm, the router, a `modules_to_save` copy) is the parameter's own data, valid while
the generator is suspended at its `yield` (what TRL's iterators promise too: a consumer that buffers must copy it);
a merged tensor is new and stays valid.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from dppo_trl.weights.lora_merge import lora_targets, merged_tensor

__all__ = [
    "gathered",
    "in_place_fallback_message",
    "merged_named_weights",
    "out_of_place_problems",
    "sync_units",
    "vllm_weight_name",
]


def vllm_weight_name(name: str, adapter_prefix: str) -> str | None:
    """The name TRL 1.16 sends a `PeftModel` parameter under (`named_parameters()` name in, vLLM checkpoint name out),
    or `None` for a parameter TRL does not send (an adapter tensor, a `modules_to_save` original)."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if adapter_prefix in name or "original_module" in name:
        return None
    for wrapper in ("_checkpoint_wrapped_module.", "modules_to_save.default."):
        name = name.replace(wrapper, "")
    return name


@dataclass(frozen=True)
class _Entry:
    name: str  # vLLM's
    param: torch.nn.Parameter
    unit: str  # the module name of the gather unit (or the parameter's own name)


def _layer_units(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Each element of the model's outermost `nn.ModuleList`s (decoder layers), by module name."""
    units: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and not any(name.startswith(unit + ".") for unit in units):
            for index, child in module.named_children():
                units[f"{name}.{index}" if name else index] = child
    return units


def _owner(name: str, units: dict[str, torch.nn.Module]) -> str | None:
    parts = name.split(".")
    for depth in range(1, len(parts)):
        prefix = ".".join(parts[:depth])
        if prefix in units:
            return prefix
    return None


def sync_units(model: torch.nn.Module) -> list[tuple[list[tuple[str, torch.nn.Parameter]], list[torch.nn.Parameter]]]:
    """The sync in gather units, in `named_parameters()` order: each unit's `(vLLM name, parameter)` pairs to send
    and the parameters to gather while they are read (the unit's whole module: base weights and adapters)."""
    adapter_prefix = getattr(model, "prefix", "lora_")
    targets = lora_targets(model)
    layers = _layer_units(model)
    lora_modules = {id(target.layer): target.layer for target in targets.values()}
    entries = []
    for raw_name, param in model.named_parameters():
        name = vllm_weight_name(raw_name, adapter_prefix)
        if name is None:
            continue
        unit = _owner(raw_name, layers)
        if unit is None:
            target = targets.get(id(param))
            unit = f"lora:{id(target.layer)}" if target is not None else raw_name
        entries.append(_Entry(name, param, unit))
    units = []
    for unit, group in itertools.groupby(entries, key=lambda entry: entry.unit):
        pairs = [(entry.name, entry.param) for entry in group]
        if unit in layers:
            gather = list(layers[unit].parameters())
        elif unit.startswith("lora:"):
            gather = list(lora_modules[int(unit.removeprefix("lora:"))].parameters())
        else:
            gather = [param for _, param in pairs]
        units.append((pairs, gather))
    return units


@contextlib.contextmanager
def gathered(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """DeepSpeed ZeRO-3 partitions of `params` gathered for reading (re-partitioned on exit); a no-op for
    parameters that are not ZeRO-3 partitions."""
    partitioned = [param for param in params if hasattr(param, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def _materializer(device: torch.device | None):
    def materialize(tensor: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor

        tensor = tensor.detach()
        if isinstance(tensor, DTensor):
            # An offloaded FSDP2 shard goes to the device first: the all-gather runs there.
            shard = tensor if device is None or tensor.device == device else tensor.to(device)
            tensor = cast(DTensor, shard).full_tensor()
        return tensor if device is None else tensor.to(device)

    return materialize


def merged_named_weights(
    model: torch.nn.Module, device: torch.device | None = None, compute_dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, Tensor]]:
    """`(vLLM name, tensor)` for every tensor TRL sends of the `PeftModel` `model`, LoRA-adapted ones merged out of
    place in `compute_dtype` (see the module docstring). Collective under ZeRO-3 and FSDP2: every rank iterates.
    `device`: where the tensors are materialised (an offloaded shard is moved there first); `None` leaves them."""
    targets = lora_targets(model)
    materialize = _materializer(device)
    for pairs, gather in sync_units(model):
        with gathered(gather):
            for name, param in pairs:
                tensor = materialize(param)
                target = targets.get(id(param))
                yield name, tensor if target is None else merged_tensor(tensor, target, materialize, compute_dtype)


def out_of_place_problems(model: torch.nn.Module, fsdp_version: int | None = None) -> list[str]:
    """Why `merged_named_weights` cannot stream `model` (empty: it can): PEFT pieces it does not merge
    (`lora_merge.unsupported_layers`) or FSDP1, whose flat parameters it does not gather."""
    from dppo_trl.weights.lora_merge import unsupported_layers

    problems = unsupported_layers(model)
    if fsdp_version == 1:
        problems.append("FSDP1 (fsdp_version=1): use FSDP2 (fsdp_version=2) or DeepSpeed ZeRO-3")
    return problems


def in_place_fallback_message(problems: list[str]) -> str:
    """The warning a trainer logs when it leaves a LoRA model's sync to TRL's in-place merge."""
    listed = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    return (
        "LoRA weights reach vLLM through TRL's in-place merge (merge_adapter, then unmerge_adapter) because dppo-trl's "
        f"out-of-place merge does not cover: {listed}. In bf16 every such sync moves the frozen base weights by a "
        "rounding error, and the moves add up over training (docs/api.md, 'LoRA weight sync')."
    )
