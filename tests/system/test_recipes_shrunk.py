"""Every GPU recipe in `examples/recipes/` runs end to end on CPU, shrunk: tiny model, data, lengths, batch and steps.

Each recipe is loaded exactly as `examples/train_dapo_math.py` loads it (`parse_args(["--config", recipe, ...])`,
then `main`) and keeps every setting that is not about size: vLLM colocate generation, the evaluation callback,
`loss_type`, `scale_rewards`, the divergence and its deltas, beta, sampling, the LoRA targets (attention modules and
the fused expert parameters), the MoE router aux loss, the GA / `steps_per_generation` structure (scaled down with
the same ratio), dtype. Only two kinds of settings change:

- `size_overrides`: model, data, lengths, batch, steps, output folder (nothing about how the recipe trains);
- `CPU_OVERRIDES`: what a CPU cannot run, each with its reason. This is the one visible list, also in
  docs/recipes.md ("Tested on CPU, shrunk").
"""

import glob
import json
import math
import os

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES_DIR = os.path.join(ROOT, "examples", "recipes")
TINY_MODEL = os.path.join(ROOT, "examples", "tiny_math_model")
TINY_TRAIN = os.path.join(ROOT, "examples", "data", "tiny_math", "train.jsonl")
TINY_TEST = os.path.join(ROOT, "examples", "data", "tiny_math", "test.jsonl")

# Recipes run here, by the tiny model that stands in for theirs.
SHRUNK_RECIPES = {
    "qwen3_1.7b_base_dapo_math.yaml": "dense",
    "qwen3_8b_base_dapo_math.yaml": "dense",
    "qwen3_30b_a3b_base_lora_dapo_math.yaml": "moe",
}
# Recipes not run by this module, and where they are covered.
NOT_RUN_HERE = {
    "qwen3_8b_base_dapo_math_server.yaml": "covered by tests/system/test_vllm_server.py (needs the server launcher)",
    "tiny_math_cpu.yaml": "the CPU default (no arguments); covered by tests/system/test_dapo_example.py",
}

# What a CPU cannot run, and why. Applied only where a recipe sets the key to something else.
CPU_OVERRIDES = {
    "vllm_enable_sleep_mode": "vLLM's CPU platform has no sleep mode: `Platform.is_sleep_mode_available()` is true "
    "only for CUDA, ROCm and XPU, and vLLM's ModelConfig rejects `enable_sleep_mode` elsewhere",
    "vllm_tensor_parallel_size": "TRL's colocate mode splits the training world into TP groups and needs "
    "`num_processes % tensor_parallel_size == 0`; the shrunk run is one process (see the accelerate entry)",
    "accelerate config (zero3.yaml: DeepSpeed ZeRO-3, 8 processes)": "the shrunk run is one in-process rank: 8 "
    "ranks each with its own vLLM engine do not fit 2 shared cores, and DeepSpeed is not installed here",
}
_CPU_VALUES = {"vllm_enable_sleep_mode": False, "vllm_tensor_parallel_size": 1}

# Shrunk shape: 2 optimizer steps of GA micro-steps each; one rollout still spans `steps_per_generation / GA`
# optimizer steps as in the recipe (8), so the second step trains on data sampled by an older policy.
SHRUNK_GA = 2
SHRUNK_STEPS = 2


def size_overrides(recipe: dict, model_dir: str, output_dir: str) -> dict:
    """Settings that only set the size of the run: tiny model and data, short lengths, few steps."""
    rollout_ratio = recipe["steps_per_generation"] // recipe["gradient_accumulation_steps"]
    return {
        "model_name_or_path": model_dir,
        "dataset_name": TINY_TRAIN,
        "max_train_samples": 32,
        "math_eval_datasets": [f"tiny_math_test={TINY_TEST}"],
        "max_eval_samples": 4,
        "math_eval_num_samples": 2,
        "math_eval_steps": SHRUNK_STEPS,
        "max_completion_length": 16,
        "vllm_max_model_length": 512,  # the tiny models' max_position_embeddings
        "gradient_accumulation_steps": SHRUNK_GA,
        "steps_per_generation": SHRUNK_GA * rollout_ratio,
        "max_steps": SHRUNK_STEPS,
        "logging_steps": 1,
        "save_steps": SHRUNK_STEPS,
        "output_dir": output_dir,
    }


def _argv(settings: dict) -> list[str]:
    argv = []
    for key, value in settings.items():
        argv.append(f"--{key}")
        argv += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return argv


def shrunk_argv(recipe_path: str, model_dir: str, output_dir: str) -> tuple[list[str], dict]:
    """`train_dapo_math.py` arguments that run `recipe_path` shrunk, and the settings they override."""
    with open(recipe_path) as f:
        recipe = yaml.safe_load(f)
    overrides = size_overrides(recipe, model_dir, output_dir)
    overrides.update({k: v for k, v in _CPU_VALUES.items() if k in recipe and recipe[k] != v})
    return ["--config", recipe_path, *_argv(overrides)], overrides


def upcycle_tiny_moe(path: str) -> str:
    """A tiny Qwen3-MoE (Qwen3-MoE module and parameter names) that answers like the bundled tiny model.

    Every expert is a copy of the bundled model's MLP and the router renormalises its top-k weights (as Qwen3-30B-A3B
    does), so the MoE computes exactly the dense model: its completions get rewards with variance, so DPPO has
    non-zero advantages and the adapters really train. A randomly initialised MoE never writes an answer (reward 0
    everywhere, no gradient). The router stays random, which is what the aux loss acts on.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dppo_dev.tiny_models import tiny_qwen3_moe_config

    dense_config = json.load(open(os.path.join(TINY_MODEL, "config.json")))
    dense = load_file(os.path.join(TINY_MODEL, "model.safetensors"))
    config = tiny_qwen3_moe_config(
        hidden_size=dense_config["hidden_size"],
        num_layers=dense_config["num_hidden_layers"],
        num_heads=dense_config["num_attention_heads"],
        num_kv_heads=dense_config["num_key_value_heads"],
        head_dim=dense_config["head_dim"],
        moe_intermediate_size=dense_config["intermediate_size"],
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rope_parameters=dense_config["rope_parameters"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        moe = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = moe.state_dict()
    for name in state:
        if name in dense:
            state[name] = dense[name]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp"
        gate_up = torch.cat([dense[f"{prefix}.gate_proj.weight"], dense[f"{prefix}.up_proj.weight"]])
        state[f"{prefix}.experts.gate_up_proj"] = gate_up.expand(config.num_experts, -1, -1).clone()
        down = dense[f"{prefix}.down_proj.weight"]
        state[f"{prefix}.experts.down_proj"] = down.expand(config.num_experts, -1, -1).clone()
    missing = [n for n in state if n not in dense and ".mlp." not in n]
    assert not missing, f"dense weights missing for {missing}"
    moe.load_state_dict(state)
    moe.generation_config = AutoModelForCausalLM.from_pretrained(TINY_MODEL).generation_config
    moe.save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(path)
    return path


def _recipe_path(name: str) -> str:
    return os.path.join(RECIPES_DIR, name)


def _load_yaml(name: str) -> dict:
    with open(_recipe_path(name)) as f:
        return yaml.safe_load(f)


def _parsed_setting(parsed: tuple, key: str):
    for args in parsed:
        if hasattr(args, key):
            return getattr(args, key)
    raise AssertionError(f"no parsed argument is named {key!r}")


def _assert_keeps_recipe_settings(example, name: str, parsed: tuple, overrides: dict) -> None:
    """Every setting of the YAML that is not overridden reaches the run with the recipe's value."""
    original = example.parse_args(["--config", _recipe_path(name)])
    kept = [key for key in _load_yaml(name) if key not in overrides]
    assert kept
    for key in kept:
        assert _parsed_setting(parsed, key) == _parsed_setting(original, key), key


# --- what runs, what is overridden ---------------------------------------------------------------------------------
def test_every_recipe_is_accounted_for():
    recipes = {os.path.basename(p) for p in glob.glob(os.path.join(RECIPES_DIR, "*.yaml"))}
    assert recipes == set(SHRUNK_RECIPES) | set(NOT_RUN_HERE)
    assert _load_yaml("tiny_math_cpu.yaml")["model_name_or_path"] == "examples/tiny_math_model"  # the CPU default


def test_cpu_overrides_are_listed_in_the_docs():
    print("\nCPU_OVERRIDES (settings a CPU cannot run, overridden in the shrunk recipe runs):")
    for setting, reason in CPU_OVERRIDES.items():
        print(f"  {setting}: {reason}")
    docs = open(os.path.join(ROOT, "docs", "recipes.md")).read()
    section = docs.split("### Tested on CPU, shrunk", 1)[1]
    for setting in CPU_OVERRIDES:
        assert f"`{setting.split(' ')[0]}`" in section, setting
    assert set(_CPU_VALUES) <= set(CPU_OVERRIDES)


@pytest.mark.parametrize("name", sorted(SHRUNK_RECIPES))
def test_shrunk_recipe_keeps_every_setting_but_size_and_cpu_ones(example, name, tmp_path):
    argv, overrides = shrunk_argv(_recipe_path(name), TINY_MODEL, str(tmp_path))
    assert set(overrides) <= set(size_overrides(_load_yaml(name), "", "")) | set(_CPU_VALUES)
    parsed = example.parse_args(argv)
    _assert_keeps_recipe_settings(example, name, parsed, overrides)
    _, args, _ = parsed
    recipe = _load_yaml(name)
    # The GA / rollout structure is the recipe's, scaled: one rollout spans the same number of optimizer steps.
    assert args.steps_per_generation // args.gradient_accumulation_steps == (
        recipe["steps_per_generation"] // recipe["gradient_accumulation_steps"]
    )
    assert args.use_vllm and args.vllm_mode == "colocate"


# --- the shrunk runs ------------------------------------------------------------------------------------------------
class _SnapshotAtTrainBegin:
    """Trainable parameters as training starts (after PEFT wrapping and dtype casts), to see what training moved."""

    def __init__(self):
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                outer.params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

        self.callback = Callback()
        self.params: dict = {}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHRUNK_RECIPES))
def test_shrunk_recipe_trains_and_evaluates(example, name, master_port, tmp_path, request):
    import torch

    from dppo_trl.backends.cpu.platform import is_vllm_cpu_platform

    if not is_vllm_cpu_platform() and not torch.cuda.is_available():
        pytest.skip("needs vLLM (the CPU build on CPU machines)")
    recipe = _load_yaml(name)
    moe = SHRUNK_RECIPES[name] == "moe"
    if moe:
        request.getfixturevalue("vllm_groups_for_moe")
    model_dir = upcycle_tiny_moe(str(tmp_path / "tiny_moe")) if moe else TINY_MODEL
    argv, overrides = shrunk_argv(_recipe_path(name), model_dir, str(tmp_path / "run"))
    parsed = example.parse_args(argv)
    _assert_keeps_recipe_settings(example, name, parsed, overrides)
    snapshot = _SnapshotAtTrainBegin()
    trainer = example.main(*parsed, callbacks=[snapshot.callback])

    history = trainer.state.log_history
    assert trainer.state.global_step == SHRUNK_STEPS
    # Generation and evaluation ran on the engine the recipe names.
    assert trainer.use_vllm and trainer.vllm_mode == "colocate" and trainer.vllm_generation.llm is not None

    train = [e for e in history if "loss" in e]
    assert [e["step"] for e in train] == [1, 2]
    for entry in train:
        for key in ("loss", "grad_norm", "entropy", "dppo/mask_ratio", "dppo/divergence_mean"):
            assert math.isfinite(entry[key]), (key, entry)
        assert all(math.isfinite(v) for k, v in entry.items() if k.startswith("dppo/")), entry
    # Rewards are logged where a rollout was generated: once, since one rollout spans both steps.
    assert math.isfinite(train[0]["reward"]) and "reward" not in train[1]
    assert train[0]["rewards/accuracy_reward/std"] > 0  # advantages are not all zero: the policy term has a gradient
    # Before the first optimizer step the engine and the trainer hold the same weights: μ and π differ only by the
    # trainer's bf16 forward (a broken weight sync shows up here, e.g. unpacked MoE experts gave 0.085).
    assert train[0]["dppo/mismatch_abs_mean"] < 0.02, train[0]

    key = "eval/tiny_math_test/avg@2"
    evals = [e for e in history if key in e]
    assert [e["step"] for e in evals] == [0, SHRUNK_STEPS]  # before training and at math_eval_steps (= the end)
    for e in evals:
        assert 0.0 <= e[key] <= e["eval/tiny_math_test/pass@2"] <= 1.0
        assert 0 < e["eval/tiny_math_test/mean_length"] <= trainer.args.max_completion_length

    model = trainer.accelerator.unwrap_model(trainer.model)
    moved = {n for n, p in model.named_parameters() if n in snapshot.params and not torch.equal(p, snapshot.params[n])}
    assert snapshot.params and moved, "training changed no trainable parameter"
    if recipe.get("use_peft"):
        lora = [n for n in snapshot.params if "lora_" in n]
        assert lora and set(snapshot.params) == set(lora)  # only adapters train; router and LM head stay frozen
        for target in recipe["lora_target_modules"]:
            assert any(f".{target}." in n for n in lora), f"no adapter on {target}"
        assert set(model.peft_config["default"].target_parameters) == set(recipe["lora_target_parameters"])
        assert any("experts" in n for n in moved), "the expert adapters did not train"
        assert any("q_proj" in n for n in moved), "the attention adapters did not train"
    if recipe.get("model_init_kwargs", {}).get("output_router_logits"):
        assert all(math.isfinite(e["aux_loss"]) and e["aux_loss"] > 0 for e in train), train
    if recipe.get("cast_lm_head_to_fp32"):
        assert model.get_output_embeddings().weight.dtype == torch.float32
    if recipe.get("dtype") == "bfloat16":
        assert any(p.dtype == torch.bfloat16 for p in model.parameters())
    assert os.path.isdir(os.path.join(trainer.args.output_dir, f"checkpoint-{SHRUNK_STEPS}"))  # save_strategy: steps
    print(f"\n{name}: {len(moved)}/{len(snapshot.params)} trainable tensors moved; step 1 {train[0]}")
