"""`examples/train_dapo_math.py`: recipe parsing, CPU defaults, a short end-to-end run, evaluation and model card."""

import glob
import json
import os
import re

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "examples", "recipes", "*.yaml")))
GPU_RECIPES = [r for r in RECIPES if not os.path.basename(r).startswith("tiny")]
TINY_MODEL = os.path.join(ROOT, "examples", "tiny_math_model")
TINY_TEST = os.path.join(ROOT, "examples", "data", "tiny_math", "test.jsonl")


# --- recipes ------------------------------------------------------------------------------------------------------
def test_there_are_recipes():
    names = {os.path.basename(r) for r in RECIPES}
    assert {"qwen3_1.7b_base_dapo_math.yaml", "qwen3_8b_base_dapo_math.yaml", "tiny_math_cpu.yaml"} <= names
    assert any("server" in n for n in names) and any("lora" in n for n in names)


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_recipe_parses_into_dppo_config(example, recipe):
    from dppo_trl import DPPOConfig

    script_args, training_args, model_args = example.parse_args(["--config", recipe])
    assert isinstance(training_args, DPPOConfig)
    assert model_args.model_name_or_path and script_args.dataset_name
    assert training_args.divergence in ("binary_tv", "binary_kl", "topk_tv", "topk_kl")
    assert training_args.top_p == 1.0 and training_args.top_k == 0  # the authors' untruncated sampling


def _accelerate_config(recipe: str) -> dict:
    with open(recipe) as f:
        match = re.search(r"--config_file (\S+\.yaml)", f.read())
    assert match, f"{recipe} names no accelerate config in its header"
    with open(os.path.join(ROOT, match.group(1))) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=os.path.basename)
def test_gpu_recipes_match_the_authors_batch_shape(example, recipe):
    _, args, model_args = example.parse_args(["--config", recipe])
    processes = _accelerate_config(recipe)["num_processes"]
    completions_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * processes
    completions_per_rollout = args.per_device_train_batch_size * args.steps_per_generation * processes
    # 256 prompts x 16 samples per rollout, mini-batches of 32 prompts: 8 optimizer steps per rollout, 500 rollouts.
    assert args.num_generations == 16
    assert completions_per_rollout == 256 * 16
    assert completions_per_step == 32 * 16
    assert args.max_steps == 500 * 8 and args.num_iterations == 1
    assert args.max_completion_length == 8192 and args.temperature == 1.0
    assert args.beta == 0.0 and args.entropy_coef == 0.0 and args.scale_rewards == "none"
    assert args.delta_low == args.delta_high == (0.15 if args.divergence.endswith("tv") else 0.05)
    assert args.learning_rate == (1e-5 if model_args.use_peft else 1e-6)
    assert args.use_vllm and not args.vllm_importance_sampling_correction


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=os.path.basename)
def test_gpu_recipes_save_on_generation_boundaries(example, recipe):
    """Their checkpoints resume exactly: save_steps is a multiple of the generation cycle (docs/api.md)."""
    from dppo_trl.hardening.checkpoints import save_steps_hint

    _, args, _ = example.parse_args(["--config", recipe])
    assert args.save_strategy == "steps" and save_steps_hint(args) is None


def test_moe_lora_recipe_keeps_router_loss_and_targets_experts(example):
    (recipe,) = [r for r in RECIPES if "lora" in r]
    _, args, model_args = example.parse_args(["--config", recipe])
    assert args.model_init_kwargs["output_router_logits"] is True
    assert model_args.use_peft and set(model_args.lora_target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert model_args.lora_target_parameters == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_moe_lora_targets_exist_in_qwen3_moe():
    # The recipe's target names must resolve on a real Qwen3-MoE module tree (tiny config, same structure).
    from peft import LoraConfig, get_peft_model

    from dppo_dev.tiny_models import build_tiny_model

    model, _ = build_tiny_model("qwen3_moe")
    config = LoraConfig(
        r=2,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    names = [n for n, _ in get_peft_model(model, config).named_parameters() if "lora_A" in n]
    assert any("experts" in n for n in names) and any("q_proj" in n for n in names)


def test_accelerate_configs_are_valid_yaml():
    configs = glob.glob(os.path.join(ROOT, "examples", "recipes", "accelerate", "*.yaml"))
    kinds = {yaml.safe_load(open(c))["distributed_type"] for c in configs}
    assert {"DEEPSPEED", "FSDP"} <= kinds
    fsdp = yaml.safe_load(open(os.path.join(ROOT, "examples", "recipes", "accelerate", "fsdp2.yaml")))
    assert fsdp["fsdp_config"]["fsdp_version"] == 2


def test_tiny_recipe_is_the_no_argument_run(example):
    with open(os.path.join(ROOT, "examples", "recipes", "tiny_math_cpu.yaml")) as f:
        recipe = yaml.safe_load(f)
    for key, value in {**example.TINY_RUN_DEFAULTS, **example.TINY_EVAL_DEFAULTS}.items():
        assert recipe[key] == value, key


# --- defaults -----------------------------------------------------------------------------------------------------
def test_no_arguments_gives_the_cpu_demo(example):
    import torch

    script_args, args, model_args = example.parse_args([])
    assert model_args.model_name_or_path is None  # resolved in main()
    assert args.learning_rate == example.TINY_RUN_DEFAULTS["learning_rate"]
    defaults = example.TINY_RUN_DEFAULTS
    assert args.generation_batch_size == defaults["per_device_train_batch_size"] * defaults["steps_per_generation"]
    if not torch.cuda.is_available():
        assert args.use_cpu and not args.bf16
    assert example.resolve_model_and_data(script_args, model_args)
    assert model_args.model_name_or_path == TINY_MODEL and script_args.math_eval_datasets[0].endswith("test.jsonl")


def test_user_choices_win_over_demo_defaults(example, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("learning_rate: 0.01\nbf16: true\n")
    _, args, _ = example.parse_args(["--config", str(config), "--max_steps", "7"])
    assert args.learning_rate == 0.01 and args.max_steps == 7 and args.bf16
    assert args.num_generations == example.TINY_RUN_DEFAULTS["num_generations"]
    # With a real model, the demo settings do not apply.
    _, args, _ = example.parse_args(["--model_name_or_path", "Qwen/Qwen3-8B-Base"])
    assert args.learning_rate == 1e-6


def test_real_model_needs_a_dataset(example):
    script_args, _, model_args = example.parse_args(["--model_name_or_path", "Qwen/Qwen3-8B-Base"])
    with pytest.raises(ValueError, match="dataset_name"):
        example.resolve_model_and_data(script_args, model_args)
    script_args.dataset_name = "BytedTsinghua-SIA/DAPO-Math-17k"
    assert not example.resolve_model_and_data(script_args, model_args)
    assert script_args.math_eval_datasets == ["aime24", "aime25"]


def test_plot_with_nothing_to_plot(example, tmp_path):
    assert example.plot_training_curves([{"step": 1, "loss": 0.1}], str(tmp_path / "x.png")) is None


# --- end to end on the bundled tiny model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def short_run(example, tmp_path_factory):
    """Two optimizer steps of the no-argument recipe on transformers generation (one rollout per step), with a small
    evaluation every step. The default vLLM path is run by tests/system/test_default_run.py."""
    if not os.path.exists(os.path.join(TINY_MODEL, "config.json")):
        pytest.skip("bundled tiny model missing: run scripts/make_tiny_math_model.py")
    out = str(tmp_path_factory.mktemp("dapo_run"))
    argv = "--max_steps 2 --per_device_train_batch_size 16 --num_generations 4 --logging_steps 1".split()
    argv += "--use_vllm false --steps_per_generation 1".split()
    argv += "--math_eval_steps 1 --math_eval_num_samples 2 --max_eval_samples 6 --output_dir".split() + [out]
    trainer = example.main(*example.parse_args(argv))
    return trainer, out


def test_short_run_logs_training_and_eval_metrics(short_run):
    trainer, out = short_run
    history = trainer.state.log_history
    train = [e for e in history if "reward" in e]
    evals = [e for e in history if "eval/tiny_math_test/avg@2" in e]
    assert len(train) == 2 and all("rewards/accuracy_reward/mean" in e for e in train)
    assert [e["step"] for e in evals] == [0, 1, 2]  # before training, then every step (no duplicate at the end)
    assert all(0.0 <= e["eval/tiny_math_test/avg@2"] <= e["eval/tiny_math_test/pass@2"] <= 1.0 for e in evals)
    assert os.path.getsize(os.path.join(out, "training_curves.png")) > 1000
    assert json.load(open(os.path.join(out, "log_history.json"))) == json.loads(json.dumps(history))
    assert os.path.exists(os.path.join(out, "model.safetensors"))


def test_short_run_model_card(short_run):
    trainer, out = short_run
    card = open(os.path.join(out, "README.md")).read()
    assert "## Training recipe" in card and "## Evaluation" in card and "eval/tiny_math_test/avg@2" in card
    assert "dppo" in card and "2602.04879" in card  # the trainer's tags and citation survive
    # A Hub user's view: no local paths, no `None`, and the curves by a link relative to the card.
    assert "None" not in card and ROOT not in card and out not in card
    assert "the local model `tiny_math_model` on the local dataset `train.jsonl`" in card
    assert "| base model | the local model `tiny_math_model` |" in card
    assert "![Reward and accuracy during training](training_curves.png)" in card
    assert os.path.isfile(os.path.join(out, "training_curves.png"))  # the link resolves inside the output folder
    # What push_to_hub does: the card is regenerated with the dataset name, and still carries the recipe.
    trainer.create_model_card(model_name="m", dataset_name="BytedTsinghua-SIA/DAPO-Math-17k", tags=["math"])
    card = open(os.path.join(out, "README.md")).read()
    header = yaml.safe_load(card.split("---")[1])
    assert "BytedTsinghua-SIA/DAPO-Math-17k" in str(header["datasets"])
    assert "math" in header["tags"] and "dppo" in header["tags"]
    assert card.count("## Training recipe") == 1


# --- evaluation callback ------------------------------------------------------------------------------------------
def test_eval_callback_hf_path_restores_train_mode(short_run):
    from dapo_math.data import load_aime
    from dapo_math.evaluation import MathEvalCallback

    trainer, _ = short_run
    data = load_aime(TINY_TEST, max_samples=5)
    callback = MathEvalCallback(trainer, {"fixture": data}, num_samples=3)
    trainer.model.train()
    metrics = callback.evaluate()
    assert trainer.model.training
    assert set(metrics) == {"eval/fixture/avg@3", "eval/fixture/pass@3", "eval/fixture/mean_length"}
    assert 0 < metrics["eval/fixture/mean_length"] <= trainer.args.max_completion_length
    assert trainer.state.log_history[-1]["eval/fixture/avg@3"] == metrics["eval/fixture/avg@3"]
    assert callback.latest == metrics


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_colocate_run_evaluates_k_samples_per_problem(example, tmp_path, master_port):
    """The command of docs/recipes.md on the real engine: train with vLLM colocate and evaluate avg@k with it."""
    argv = "--max_steps 2 --use_vllm --vllm_mode colocate --per_device_train_batch_size 16 --num_generations 4".split()
    argv += "--logging_steps 1 --math_eval_steps 1 --math_eval_num_samples 3 --max_eval_samples 5".split()
    trainer = example.main(*example.parse_args(argv + ["--output_dir", str(tmp_path)]))
    evals = [e for e in trainer.state.log_history if "eval/tiny_math_test/avg@3" in e]
    assert [e["step"] for e in evals] == [0, 1, 2]  # before training, after each step (the end is step 2)
    # The evaluation before step 1 synced the engine, so step 1's generation did not; its rollout is still fresh
    # (checked, at the bf16 floor), step 2 reuses it (not checked).
    train = [e for e in trainer.state.log_history if "dppo/mask_ratio" in e]
    assert [e["step"] for e in train if "dppo/sync_mismatch" in e] == [1] and train[0]["dppo/sync_mismatch"] < 0.05
    for e in evals:
        assert 0.0 <= e["eval/tiny_math_test/avg@3"] <= e["eval/tiny_math_test/pass@3"] <= 1.0
        assert 0 < e["eval/tiny_math_test/mean_length"] <= trainer.args.max_completion_length

    # k samples per problem from the engine itself, prompt-major, sampled independently.
    from dapo_math.data import load_aime
    from dapo_math.evaluation import MathEvalCallback

    prompts = list(load_aime(TINY_TEST, max_samples=4)["prompt"])
    callback = MathEvalCallback(trainer, {}, num_samples=6)
    completions, lengths = callback._generate(prompts, 6)
    assert len(completions) == len(lengths) == 4 * 6
    texts = [c[0]["content"] for c in completions]
    # Six independent samples at temperature 1, not one completion copied six times.
    assert any(len(set(texts[j * 6 : (j + 1) * 6])) > 1 for j in range(4))
