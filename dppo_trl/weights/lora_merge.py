"""A LoRA layer's merged weight, computed out of place: `W + Σ_adapters scale · B·A` in float32 (or wider), rounded
once to W's dtype, with W itself never written.

PEFT's `merge_adapter()` adds ΔW into W in place and `unmerge_adapter()` subtracts it again; in bf16 `(W + ΔW) − ΔW`
is not W, so every sync that merges and unmerges moves the frozen base by a rounding error, and ΔW changes at every
step, so the error random-walks. PEFT's own out-of-place `get_delta_weight` is not used either: on CPU it rounds ΔW to
the adapter's dtype before the add, and for `target_parameters` experts it casts ΔW to the parameter's dtype, so
`W + ΔW` would be rounded twice.

Supported (checked against PEFT's merge in float64 by tests/unit/test_lora_merge.py): `lora.Linear` (an `nn.Linear`
or, with `fan_in_fan_out`, a transformers `Conv1D` base; `lora_bias` included), `lora.Embedding`, `lora.ParamWrapper`
(`target_parameters`, 2-D or 3-D expert stacks), any number of active adapters, and `modules_to_save` copies (sent as
they are). `unsupported_layers` names whatever else a model holds (LoRA variants such as DoRA, quantized or
convolutional LoRA layers, other PEFT methods, trainable tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from peft.tuners.lora.layer import Embedding, Linear, LoraLayer, ParamWrapper
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from torch import Tensor

__all__ = ["LoraTarget", "lora_targets", "merged_tensor", "unsupported_layers"]

# Tensors of one expert-stack chunk computed at a time in the wide dtype (elements), so a 3-D expert weight never needs
# a full-size float32 copy next to its merged result.
_CHUNK_ELEMENTS = 1 << 24

Materialize = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class LoraTarget:
    """A frozen base tensor that active LoRA adapters adapt.

    Attributes:
        layer: the PEFT LoRA layer (`lora.Linear`, `lora.Embedding` or `lora.ParamWrapper`).
        adapters: its active adapters not already merged into the base, in PEFT's order.
        part: `"weight"` (the weight, or the parameter a `ParamWrapper` targets) or `"bias"` (`lora_bias`).
    """

    layer: LoraLayer
    adapters: tuple[str, ...]
    part: str = "weight"


def _adapters(layer: LoraLayer) -> tuple[str, ...]:
    """The adapters PEFT's `merge()` would add to this layer now: active, present in the layer, not merged yet."""
    present = layer.lora_embedding_A if isinstance(layer, Embedding) else layer.lora_A
    merged = set(layer.merged_adapters)
    return tuple(a for a in layer.active_adapters if a in present and a not in merged)


def unsupported_layers(model: torch.nn.Module) -> list[str]:
    """`"<module name>: <what>"` for every PEFT piece of `model` that `merged_tensor` cannot merge out of place."""
    problems = []
    configs = getattr(model, "peft_config", {})
    for adapter in getattr(model, "active_adapters", ()):
        config = configs.get(adapter)
        if config is not None and getattr(config, "is_prompt_learning", False):
            problems.append(f"adapter {adapter!r}: {type(config).__name__} (prompt learning, not LoRA)")
    for name, module in model.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper) and not isinstance(module, ModulesToSaveWrapper):
            problems.append(f"{name}: {type(module).__name__}")
        if not isinstance(module, BaseTunerLayer):
            continue
        if type(module) not in (Linear, Embedding, ParamWrapper):
            problems.append(f"{name}: {type(module).__module__}.{type(module).__name__}")
            continue
        for adapter in _adapters(module):
            if adapter in module.lora_variant:
                variant = type(module.lora_variant[adapter]).__name__
                problems.append(f"{name}: adapter {adapter!r} uses a LoRA variant ({variant}, e.g. use_dora=True)")
            if module.lora_bias.get(adapter) and not isinstance(module, Linear):
                problems.append(f"{name}: adapter {adapter!r} has lora_bias on a {type(module).__name__}")
    return problems


def _base_tensor(layer: LoraLayer, part: str) -> Tensor:
    base = layer.get_base_layer()
    if part == "bias":
        return base.bias
    if isinstance(layer, ParamWrapper):
        return layer.get_param()
    return base.weight


def lora_targets(model: torch.nn.Module) -> dict[int, LoraTarget]:
    """Every frozen base tensor active LoRA adapters adapt, keyed by the tensor's `id` (a `ParamWrapper` adapts the
    parameter it names; nested wrappers adapt different parameters of one module)."""
    targets: dict[int, LoraTarget] = {}
    for module in model.modules():
        if not isinstance(module, LoraLayer) or type(module) not in (Linear, Embedding, ParamWrapper):
            continue
        adapters = _adapters(module)
        if not adapters:
            continue
        targets[id(_base_tensor(module, "weight"))] = LoraTarget(module, adapters)
        with_bias = tuple(a for a in adapters if module.lora_bias.get(a))
        if with_bias and isinstance(module, Linear):
            targets[id(_base_tensor(module, "bias"))] = LoraTarget(module, with_bias, "bias")
    return targets


def _factors(target: LoraTarget, adapter: str, materialize: Materialize, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(A, B) of one adapter in `dtype`, each as PEFT stores it."""
    layer = target.layer
    if isinstance(layer, Embedding):
        a, b = layer.lora_embedding_A[adapter], layer.lora_embedding_B[adapter]
    else:
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    return materialize(a).to(dtype), materialize(b).to(dtype)


def _matrix_factors(target: LoraTarget, adapter: str, materialize: Materialize, dtype: torch.dtype):
    """`(m1, m2)` with ΔW = scale · m1 @ m2 for a 2-D (or one-expert) base: `B @ A`, transposed for lora.Embedding
    (A is `(r, vocab)`, B `(dim, r)`) and for a Conv1D base (`fan_in_fan_out`, stored `(in, out)`)."""
    layer = target.layer
    a, b = _factors(target, adapter, materialize, dtype)
    if isinstance(layer, Embedding) or (isinstance(layer, Linear) and layer.fan_in_fan_out):
        return a.T, b.T
    return b, a


def _expert_factors(target: LoraTarget, adapter: str, materialize: Materialize, dtype: torch.dtype):
    """`(lhs, rhs)` with ΔW[e] = scale · lhs[e] @ rhs[e] for a `ParamWrapper`'s 3-D expert stack. PEFT's layout: A
    `(experts·r, in)` read as `(experts, r, in)`, B `(out, r·experts)` read as `(out, r, experts)`; a stack stored
    `(experts, out, in)` (transformers' fused MoE experts) has in and out swapped."""
    layer = target.layer
    experts = layer.num_experts
    a, b = _factors(target, adapter, materialize, dtype)
    a = a.reshape(experts, -1, a.shape[-1])  # (experts, r, in)
    b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # (experts, out, r)
    if layer._did_swap_in_out_features:
        return b, a
    return a.transpose(-2, -1), b.transpose(-2, -1)


@torch.no_grad()
def merged_tensor(
    base: Tensor,
    target: LoraTarget,
    materialize: Materialize = lambda tensor: tensor.detach(),
    compute_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """`base + Σ ΔW` of `target`'s adapters as a new tensor in `base`'s dtype and on its device: the sum is formed in
    `compute_dtype` (at least float32) and rounded once. `base` and the adapter tensors are only read; `materialize`
    turns an adapter parameter into a full local tensor (a detached view, or `DTensor.full_tensor()` under FSDP2,
    plus a device move).
    """
    if compute_dtype.itemsize < 4:
        raise ValueError(f"compute_dtype must be float32 or wider, got {compute_dtype}")
    layer = target.layer
    adapters = [(adapter, layer.scaling[adapter]) for adapter in target.adapters]
    if target.part == "bias":
        wide = base.to(compute_dtype, copy=True)
        for adapter, scale in adapters:
            wide.add_(materialize(layer.lora_B[adapter].bias).to(compute_dtype), alpha=scale)
        return wide.to(base.dtype)
    if not (isinstance(layer, ParamWrapper) and layer.num_experts > 1):
        wide = base.to(compute_dtype, copy=True)
        for adapter, scale in adapters:
            m1, m2 = _matrix_factors(target, adapter, materialize, compute_dtype)
            # A one-expert `ParamWrapper` may hold a 3-D `(1, out, in)` parameter.
            wide.view(m1.shape[0], m2.shape[1]).addmm_(m1, m2, alpha=scale)
        return wide.to(base.dtype)
    factors = [(_expert_factors(target, adapter, materialize, compute_dtype), scale) for adapter, scale in adapters]
    out = torch.empty_like(base)
    step = max(1, _CHUNK_ELEMENTS // max(1, base[0].numel()))
    for start in range(0, base.shape[0], step):
        stop = min(start + step, base.shape[0])
        wide = base[start:stop].to(compute_dtype, copy=True)
        for (lhs, rhs), scale in factors:
            wide.baddbmm_(lhs[start:stop], rhs[start:stop], alpha=scale)
        out[start:stop] = wide
    return out
