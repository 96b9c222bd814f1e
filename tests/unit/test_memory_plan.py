"""`benchmarks/memory_plan.py`: what it counts off the meta model is exact, and its phases add up.

The shipped configs (`benchmarks/model_configs/`) give Qwen's published sizes; the recipe's adapter is PEFT's own
count and the closed form of LoRA on fused experts (r × num_experts wide); the launch is read from the recipe's
accelerate config. Meta device only: no weights, no engine.
"""

import json
from pathlib import Path

import memory_plan
import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "examples" / "recipes"
MOE_RECIPE = RECIPES / "qwen3_30b_a3b_base_lora_dapo_math.yaml"

# Qwen's model cards (billions, rounded as published): total and non-embedding parameters; Qwen3-30B-A3B also 3.3B
# activated per token.
PUBLISHED = {
    "Qwen3-1.7B-Base": (1.7, 1.4),
    "Qwen3-8B-Base": (8.2, 6.95),
    "Qwen3-30B-A3B-Base": (30.5, 29.9),
}


def _rounds_to(value: float, published: float) -> bool:
    digits = len(str(published).split(".")[1])
    return round(value, digits) == published


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_meta_model_has_the_published_size(name):
    model = memory_plan.build_meta_model(memory_plan.MODEL_CONFIGS / name, "bfloat16")
    summary = memory_plan.model_summary(model)
    total, non_embedding = PUBLISHED[name]
    assert _rounds_to(summary["params"] / 1e9, total), summary["params"]
    assert _rounds_to(summary["params_non_embedding"] / 1e9, non_embedding), summary["params_non_embedding"]
    assert summary["bytes"] == 2 * summary["params"]  # bf16
    assert memory_plan.engine_shard_bytes(model, tp=1) == summary["bytes"]
    assert sum(summary["layer_bytes_by_part"].values()) == summary["layer_bytes_max"]
    assert summary["bytes"] == summary["num_layers"] * summary["layer_bytes_max"] + summary["embeddings_bytes"] + (
        2 * model.config.hidden_size  # the final norm
    )
    if "A3B" in name:
        # The card's "3.3B activated"; counting both embedding matrices (the model is untied) gives 3.35B.
        assert 3.3e9 <= summary["active_params"] < 3.4e9, summary["active_params"]


@pytest.fixture(scope="module")
def moe_plan() -> dict:
    return memory_plan.plan(MOE_RECIPE, gpus=8, gpu_memory_gib=memory_plan.H100_80GB_GIB)


def test_expert_lora_is_peft_count_and_r_times_experts_wide(moe_plan):
    """LoRA r on q/k/v/o plus the fused experts' gate_up and down projections: each expert stack's A and B are
    r × E wide, so the adapter is L · r · (Σ_attention (in + out) + E · Σ_experts (in + out))."""
    config = memory_plan.build_meta_model(memory_plan.MODEL_CONFIGS / "Qwen3-30B-A3B-Base", "bfloat16").config
    h, e, i = config.hidden_size, config.num_experts, config.moe_intermediate_size
    dq, dkv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    r = moe_plan["settings"]["lora_r"]
    attention = (h + dq) + (h + dkv) + (h + dkv) + (dq + h)
    experts = e * ((h + 2 * i) + (i + h))
    expected = config.num_hidden_layers * r * (attention + experts)
    assert moe_plan["model_summary"]["trainable_params"] == expected
    assert moe_plan["adapter"]["peft_trainable_params"] == expected
    assert moe_plan["adapter"]["by_target"]["mlp.experts"] == config.num_hidden_layers * r * experts


def test_launch_and_lengths_come_from_the_recipe(moe_plan):
    assert moe_plan["launch"]["distribution"] == "zero3" and moe_plan["launch"]["num_processes"] == 8
    settings = moe_plan["settings"]
    assert settings["prompt_length"] + settings["max_completion_length"] == 10240  # vllm_max_model_length
    assert settings["tokens_per_micro_batch"] == 2 * 10240
    assert moe_plan["engine"]["tensor_parallel_size"] == 2
    # K and V of 48 layers, 4 KV heads split over TP 2, head_dim 128, bf16.
    assert moe_plan["engine"]["kv_bytes_per_token"] == 2 * 48 * 2 * 128 * 2


def test_accelerate_configs_are_read():
    accelerate = RECIPES / "accelerate"
    assert memory_plan.read_launch(accelerate / "zero3.yaml")["distribution"] == "zero3"
    assert memory_plan.read_launch(accelerate / "fsdp2.yaml")["distribution"] == "fsdp"
    assert memory_plan.read_launch(accelerate / "zero3_multinode.yaml")["num_processes"] == 16
    assert memory_plan.launch_config_path(MOE_RECIPE) == accelerate / "zero3.yaml"
    assert memory_plan.launch_config_path(RECIPES / "tiny_math_cpu.yaml") is None  # a plain script: one process
    assert memory_plan.read_launch(None)["num_processes"] == 1


def test_phases_add_up_and_trl_sync_overflows_on_counted_bytes_alone(moe_plan):
    summary = moe_plan["model_summary"]
    for name, phase in moe_plan["phases"].items():
        terms = phase["terms"].values()
        assert all(t["kind"] in ("counted", "estimated") and t["formula"] for t in terms), name
        assert phase["total_gib"] == pytest.approx(sum(t["gib"] for t in terms), abs=0.01), name
    whole = moe_plan["phases"]["sync_trl"]["terms"]["gathered"]
    assert whole["gib"] == pytest.approx((summary["bytes"] + 2 * summary["trainable_params"]) / 2**30, abs=1e-3)
    # TRL's whole-model gather does not fit an 80 GB card whatever the estimates say; one layer at a time does.
    counted = sum(t["gib"] for t in moe_plan["phases"]["sync_trl"]["terms"].values() if t["kind"] == "counted")
    assert counted > moe_plan["gpu_memory_gib"]
    assert moe_plan["phases"]["sync_per_layer"]["terms"]["gathered"]["gib"] < 3


def test_bad_recipe_is_one_json_error(capsys):
    assert memory_plan.main(["--recipe", str(ROOT / "README.md")]) == 1
    assert "error" in json.loads(capsys.readouterr().out)


def test_ddp_replicates_and_keeps_the_loaded_dtype(tmp_path):
    """Without ZeRO-3 the weights, gradients and AdamW states are whole on every GPU, in the loaded dtype (bf16: no
    master weights), and nothing is gathered."""
    launch = tmp_path / "ddp.yaml"
    launch.write_text("distributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_processes: 8\n")
    report = memory_plan.plan(RECIPES / "qwen3_1.7b_base_dapo_math.yaml", None, 80.0, accelerate_config=launch)
    params = report["model_summary"]["params"]
    terms = report["phases"]["train_step"]["terms"]
    assert report["gpus"] == 8 and report["launch"]["distribution"] == "ddp"
    assert terms["weights"]["gib"] == pytest.approx(2 * params / 2**30, abs=1e-3)
    assert terms["optimizer_states"]["gib"] == pytest.approx(4 * params / 2**30, abs=1e-3)
    assert "zero3_gathered_layers" not in terms and "gathered" not in report["phases"]["sync_trl"]["terms"]
