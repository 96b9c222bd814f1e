"""The out-of-place LoRA merge (`dppo_trl.weights`) against PEFT's own merge, per layer type, in float64.

The reference is PEFT's `merge_and_unload()` on a float64 copy of the same model; the stream is computed in float64
too, so any difference is a wrong formula, not rounding. In bf16 the stream never writes the base (bit-identical after
it ran) and is within one rounding of that float64 reference. The names, dtypes and shapes TRL's own iterators yield
are pinned against TRL in tests/meta/test_trl_contract.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from dppo_dev.tiny_models import build_tiny_model
from dppo_trl.weights.lora_merge import lora_targets, unsupported_layers
from dppo_trl.weights.stream import merged_named_weights, sync_units

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _gpt2(dtype: torch.dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT2LMHeadModel(config).to(dtype)


# Each case: a base model builder and a LoRA config whose adapters start non-zero (`init_lora_weights=False`).
CASES = {
    # lora.Linear on attention, lora.ParamWrapper on the fused 3-D experts (nested: two parameters of one module),
    # a modules_to_save copy of the final norm.
    "moe_experts_modules_to_save": (
        lambda dtype: build_tiny_model("qwen3_moe", dtype=dtype)[0],
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            target_parameters=EXPERTS,
            modules_to_save=["model.norm"],
            init_lora_weights=False,
        ),
    ),
    # lora.Embedding on an embedding the LM head is tied to (the head is not sent: it is the same tensor).
    "tied_embedding": (
        lambda dtype: build_tiny_model("qwen3", dtype=dtype, tie_word_embeddings=True)[0],
        LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False),
    ),
    # lora.ParamWrapper on a 2-D parameter (one "expert"), rsLoRA scaling.
    "param_wrapper_2d_rslora": (
        lambda dtype: build_tiny_model("qwen3", dtype=dtype)[0],
        LoraConfig(
            r=4, lora_alpha=8, target_parameters=["self_attn.o_proj.weight"], use_rslora=True, init_lora_weights=False
        ),
    ),
    # lora.Linear on a transformers Conv1D (fan_in_fan_out) with lora_bias.
    "conv1d_fan_in_fan_out_lora_bias": (
        _gpt2,
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_bias=True, init_lora_weights=False
        ),
    ),
}


def _peft(case: str, dtype: torch.dtype, adapter_dtype: torch.dtype | None = None):
    build, config = CASES[case]
    model = get_peft_model(build(dtype), copy.deepcopy(config))
    if adapter_dtype is not None:
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.data = param.data.to(adapter_dtype)
    return model


def _reference(model) -> dict[str, torch.Tensor]:
    """PEFT's merge of a float64 copy: the checkpoint-named tensors of the merged model."""
    merged = copy.deepcopy(model).to(torch.float64).merge_and_unload()
    return {name: param.detach() for name, param in merged.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_equals_peft_merge_in_float64(case):
    model = _peft(case, torch.float64)
    reference = _reference(model)
    streamed = dict(merged_named_weights(model, compute_dtype=torch.float64))
    assert streamed.keys() == reference.keys()
    for name, tensor in streamed.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-12, msg=name)
    assert any(not torch.equal(streamed[n], p.detach()) for n, p in _unmerged(model).items()), "nothing was merged"


def _unmerged(model) -> dict[str, torch.Tensor]:
    with model.disable_adapter():
        return {name: tensor.clone() for name, tensor in _plain_names(model)}


def _plain_names(model):
    from dppo_trl.weights.stream import vllm_weight_name

    for raw, param in model.named_parameters():
        name = vllm_weight_name(raw, model.prefix)
        if name is not None:
            yield name, param.detach()


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_stream_leaves_the_base_bit_identical_and_rounds_once(case):
    # bf16 weights with float32 adapters (PEFT's default autocast of adapter dtypes).
    model = _peft(case, torch.bfloat16, adapter_dtype=torch.float32)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    for _ in range(3):
        streamed = {name: tensor.clone() for name, tensor in merged_named_weights(model)}
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
    reference = _reference(model)
    for name, tensor in streamed.items():
        assert tensor.dtype == torch.bfloat16, name
        exact = reference[name]
        # One rounding of the float64 sum to bf16 (8 significant bits): within half a unit in the last place.
        bound = exact.abs() * 2.0**-8 + 1e-30
        assert ((tensor.double() - exact).abs() <= bound).all(), name


def test_several_active_adapters_are_summed():
    # (PEFT allows one active modules_to_save copy, so these adapters have none.)
    config = LoraConfig(r=4, target_modules=["q_proj"], target_parameters=EXPERTS, init_lora_weights=False)
    model = get_peft_model(build_tiny_model("qwen3_moe", dtype=torch.float64)[0], copy.deepcopy(config))
    model.add_adapter("second", copy.deepcopy(config))
    model.base_model.set_adapter(["default", "second"])
    assert {target.adapters for target in lora_targets(model).values()} == {("default", "second")}
    reference = _reference(model)
    for name, tensor in merged_named_weights(model, compute_dtype=torch.float64):
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-12, msg=name)


def test_units_are_decoder_layers_and_single_parameters_elsewhere():
    model = _peft("moe_experts_modules_to_save", torch.float32)
    units = sync_units(model)
    names = [[name for name, _ in pairs] for pairs, _ in units]
    assert names[0] == ["model.embed_tokens.weight"]
    assert names[-2:] == [["model.norm.weight"], ["lm_head.weight"]]
    layers = names[1:-2]
    assert len(layers) == model.config.num_hidden_layers
    for index, layer in enumerate(layers):
        assert all(name.startswith(f"model.layers.{index}.") for name in layer)
        # The gather covers the layer's adapters too: what the merge reads.
        gather = units[1 + index][1]
        assert len(gather) == len(list(model.base_model.model.model.layers[index].parameters()))
    assert [name for pairs, _ in units for name, _ in pairs] == [name for name, _ in _plain_names(model)]


def test_unsupported_layers_are_named():
    model = get_peft_model(build_tiny_model("qwen3")[0], LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    problems = unsupported_layers(model)
    assert problems and all("DoraLinearVariant" in p for p in problems)
    assert unsupported_layers(_peft("moe_experts_modules_to_save", torch.float32)) == []
    # Already merged adapters are in the base: they are not added again.
    merged = _peft("tied_embedding", torch.float64)
    merged.merge_adapter()
    assert lora_targets(merged) == {}


def test_names_are_cleaned_as_trl_cleans_them():
    """TRL 1.16's cleanup, wrapper prefixes included (`_checkpoint_wrapped_module.` from activation checkpointing);
    the walks themselves are compared with TRL's in tests/meta/test_trl_contract.py."""
    from dppo_trl.weights.stream import vllm_weight_name

    prefix = "base_model.model.model.layers.0."
    assert vllm_weight_name(prefix + "_checkpoint_wrapped_module.self_attn.q_proj.base_layer.weight", "lora_") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert vllm_weight_name(prefix + "mlp.experts.base_layer.base_layer.gate_up_proj", "lora_") == (
        "model.layers.0.mlp.experts.gate_up_proj"
    )
    assert (
        vllm_weight_name("base_model.model.model.norm.modules_to_save.default.weight", "lora_") == "model.norm.weight"
    )
    assert vllm_weight_name("base_model.model.model.norm.original_module.weight", "lora_") is None
    assert vllm_weight_name(prefix + "self_attn.q_proj.lora_A.default.weight", "lora_") is None
