# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""
DPPO on DAPO-Math: train a model to solve math problems with a rule-based reward, evaluating avg@k on AIME.

With no arguments it runs a complete, CPU-sized version of the recipe offline: the bundled tiny Qwen3
(`examples/tiny_math_model`, pretrained on one-step arithmetic to answer like a base model: in DAPO's `Answer:` format
only about half the time, and not always correctly) is trained with DPPO on the bundled tiny math set
(`examples/data/tiny_math`), in a few minutes on 2 cores. It is DPPO's setting at CPU size: vLLM (colocated, bf16
where the CPU has it) samples, the fp32 trainer takes 8 optimizer steps per rollout, so π drifts from the engine's μ
and the trust region masks tokens. The training accuracy it prints climbs as the model learns the format and sharpens
its answers; `training_curves.png`, saved next to the model, shows the learning curves and, below them, the trust
region at work (mask rates for A > 0 and A < 0, |π − μ| on fresh vs drifted steps, ratio-cap hits).

```bash
# CPU smoke run of the whole recipe (a few minutes, no network)
python examples/train_dapo_math.py
# The same with GRPO's ratio clip instead of DPPO's mask, then both runs on one plot
python examples/train_dapo_math.py --trust_region grpo_clip --output_dir outputs/tiny-math-grpo-clip
python examples/compare_runs.py outputs/tiny-math-dppo outputs/tiny-math-grpo-clip
# Transformers generation instead of vLLM (no engine mismatch; the drift over the 8 steps per rollout remains)
python examples/train_dapo_math.py --use_vllm false

# The paper's recipe on one 8-GPU node (see docs/recipes.md)
accelerate launch --config_file examples/recipes/accelerate/zero3.yaml examples/train_dapo_math.py \
    --config examples/recipes/qwen3_8b_base_dapo_math.yaml

# Anything can be overridden on the command line
python examples/train_dapo_math.py \
    --model_name_or_path Qwen/Qwen3-8B-Base --dataset_name BytedTsinghua-SIA/DAPO-Math-17k \
    --use_vllm --vllm_mode colocate --divergence binary_tv --learning_rate 1e-6 --num_generations 16
```

Preemption: `--enable_jit_checkpoint` (on in the GPU recipes) makes a SIGTERM save a complete checkpoint and exit with
code 143 naming it, without writing a final model; `--resume_from_checkpoint latest` continues (docs/faults.md).

Rewards: `accuracy_reward` (math-verify on the `Answer:` line or last `\\boxed{}`), plus an optional
`format_reward` (`--format_reward_weight`). Evaluation: `--math_eval_datasets aime24 aime25` (Hub ids or local
files; `name=path` to rename), every `--math_eval_steps` steps, `--math_eval_num_samples` samples per problem.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

# The default run is offline; respect anything the user exported.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from dapo_math.card import attach_recipe_to_model_card, recipe_card_section
from dapo_math.data import AIME_DATASETS, load_aime, load_dapo_math
from dapo_math.evaluation import MathEvalCallback
from dapo_math.plots import plot_training_curves, summarize_run, summary_line
from dapo_math.preflight import run_preflight
from dapo_math.rewards import accuracy_reward, format_reward
from dppo_trl import DPPOConfig, DPPOTrainer

EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
TINY_MODEL_DIR = os.path.join(EXAMPLES_DIR, "tiny_math_model")
TINY_TRAIN_FILE = os.path.join(EXAMPLES_DIR, "data", "tiny_math", "train.jsonl")
TINY_TEST_FILE = os.path.join(EXAMPLES_DIR, "data", "tiny_math", "test.jsonl")

# Settings of the no-argument CPU run. They apply only to the bundled tiny model, and only to options the user did
# not set (on the command line or in --config). They reproduce, at CPU size, the setting DPPO exists for: a vLLM
# engine samples in bf16 (`vllm_cpu_dtype`) while the trainer runs in fp32, and each rollout is split into 8
# optimizer steps (the authors' 8 mini-batches per rollout), so π drifts away from the engine's μ within a rollout
# and the trust region masks tokens. `--use_vllm false` runs the transformers-generation variant instead (no engine
# mismatch; μ is TRL's recompute of the generating weights). The real recipes live in examples/recipes/*.yaml.
TINY_RUN_DEFAULTS = {
    "output_dir": "outputs/tiny-math-dppo",
    "use_vllm": True,
    "vllm_mode": "colocate",
    "learning_rate": 3e-4,  # a 130k-parameter model needs a far larger step than an 8B one (1e-6)
    "lr_scheduler_type": "constant",
    "max_steps": 100,  # 12.5 rollouts
    "per_device_train_batch_size": 128,  # completions per optimizer step: 16 prompts x 8 samples
    "gradient_accumulation_steps": 1,
    "steps_per_generation": 8,  # a rollout of 128 prompts x 8 samples feeds 8 optimizer steps
    "num_generations": 8,
    "max_completion_length": 16,  # "Answer: 17" plus end-of-turn is 11 tokens
    "temperature": 1.0,
    "logging_steps": 1,  # per-step logs tell a rollout's first (fresh) step from the drifted ones
    "save_strategy": "no",
    "report_to": "none",
    "gradient_checkpointing": False,  # saves nothing on a model this small and costs time
    "seed": 42,
}
# The tiny model writes DAPO's "Answer:" line only half the time; a small format reward lets RL fix that first
# (accuracy requires the format), which is what makes the accuracy climb within a few minutes. The engine samples in
# bf16 where the CPU has it natively (`DPPOConfig.vllm_cpu_dtype="auto"`).
TINY_EVAL_DEFAULTS = {
    "math_eval_steps": 50,
    "math_eval_num_samples": 4,
    "format_reward_weight": 0.5,
    "vllm_cpu_dtype": "auto",
}


@dataclass
class DAPOMathScriptArguments(ScriptArguments):
    """Data, reward and evaluation options of `train_dapo_math.py` (TRL's `ScriptArguments` plus math evaluation)."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Training set: a Hub id in the DAPO-Math-17k schema (e.g. `BytedTsinghua-SIA/DAPO-Math-17k`) or "
            "a local json/jsonl/parquet file or folder. Default: the bundled tiny math set (CPU demo)."
        },
    )
    dedup: bool = field(
        default=True,
        metadata={"help": "Drop repeated prompts (the Hub copy of DAPO-Math-17k repeats each problem ~100 times)."},
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N (deduplicated) training problems."}
    )
    format_reward_weight: float = field(
        default=0.0,
        metadata={"help": "Weight of `format_reward` (an `Answer:` line or `\\boxed{}` exists). 0 disables it."},
    )
    math_eval_datasets: list[str] | None = field(
        default=None,
        metadata={
            "help": "Evaluation sets: `aime24`, `aime25`, a Hub id or local file, optionally as `name=source`. "
            "Default: `aime24 aime25` for real runs, the bundled tiny test set for the CPU demo. `none` disables."
        },
    )
    math_eval_split: str = field(default="train", metadata={"help": "Split of the evaluation sets on the Hub."})
    math_eval_steps: int | None = field(
        default=None, metadata={"help": "Evaluate every N optimizer steps (also before and after training)."}
    )
    math_eval_num_samples: int = field(
        default=16, metadata={"help": "k in avg@k: samples per evaluation problem, at the training temperature."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only the first N problems per set."})
    plot_curves: bool = field(
        default=True, metadata={"help": "Save the reward/accuracy curves to `<output_dir>/training_curves.png`."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start over in an `--output_dir` that holds a previous run: its checkpoints, curves and logs are "
            "deleted first. Without it (or `--resume_from_checkpoint latest`) such a folder is refused. (transformers "
            "5 dropped this TrainingArguments option; the script keeps it.)"
        },
    )


def explicit_arg_names(argv: list[str]) -> set[str]:
    """Option names the user set, on the command line or in the `--config` YAML (everything else is a default)."""
    names = {arg[2:].split("=", 1)[0] for arg in argv if arg.startswith("--")}
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        import yaml

        with open(argv[argv.index("--config") + 1]) as f:
            names |= set((yaml.safe_load(f) or {}).keys())
    return names


def _has_accelerator() -> bool:
    return torch.cuda.is_available() or any(
        getattr(torch, name, None) is not None and getattr(torch, name).is_available() for name in ("xpu", "mps")
    )


def make_parser() -> TrlParser:
    return TrlParser((DAPOMathScriptArguments, DPPOConfig, ModelConfig))


def parse_args(argv: list[str] | None = None) -> tuple[DAPOMathScriptArguments, DPPOConfig, ModelConfig]:
    """Parse `argv` (default `sys.argv[1:]`) the way the script does, including the CPU-demo defaults.

    Defaults are installed in the parser *before* parsing, so anything set on the command line or in `--config`
    wins, and config post-processing (`generation_batch_size`, ...) sees the final values:

    - no `--model_name_or_path`: the bundled tiny model, data and `TINY_RUN_DEFAULTS`;
    - no CUDA/XPU/MPS device: `use_cpu=True` and `bf16=False` (TRL's bf16 default is ~2x slower on CPU).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    explicit = explicit_arg_names(argv)
    parser = make_parser()
    defaults = {}
    if "model_name_or_path" not in explicit:
        defaults.update(TINY_RUN_DEFAULTS)
        defaults.update(TINY_EVAL_DEFAULTS)
    if not _has_accelerator():
        defaults.update(use_cpu=True, bf16=False)
    parser.set_defaults_with_config(**defaults)
    script_args, training_args, model_args = parser.parse_args_and_config(argv)
    return script_args, training_args, model_args


def resolve_model_and_data(script_args: DAPOMathScriptArguments, model_args: ModelConfig) -> bool:
    """Point unset model/data/eval options at the bundled tiny demo; returns whether the demo model is used."""
    tiny = model_args.model_name_or_path is None
    if tiny:
        model_args.model_name_or_path = TINY_MODEL_DIR
        if script_args.dataset_name is None:
            script_args.dataset_name = TINY_TRAIN_FILE
        if script_args.math_eval_datasets is None:
            script_args.math_eval_datasets = [f"tiny_math_test={TINY_TEST_FILE}"]
    elif script_args.dataset_name is None:
        raise ValueError("`--dataset_name` is required with a custom model (e.g. BytedTsinghua-SIA/DAPO-Math-17k).")
    if script_args.math_eval_datasets is None:
        script_args.math_eval_datasets = ["aime24", "aime25"]
    return tiny


def load_eval_sets(script_args: DAPOMathScriptArguments) -> dict:
    """`{name: Dataset}` from `--math_eval_datasets` entries (`aime24`, `name=source` or a plain source)."""
    specs = script_args.math_eval_datasets or []
    if [s.lower() for s in specs] == ["none"]:
        return {}
    eval_sets = {}
    for spec in specs:
        name, source = spec.split("=", 1) if "=" in spec else (spec, spec)
        if name == source and name not in AIME_DATASETS:
            name = os.path.splitext(os.path.basename(source.rstrip("/")))[0] or source
        eval_sets[name] = load_aime(
            source, split=script_args.math_eval_split, max_samples=script_args.max_eval_samples
        )
    return eval_sets


def print_engine_dtype(training_args: DPPOConfig) -> None:
    """Print the colocated CPU engine's dtype next to the trainer's (main process; nothing elsewhere)."""
    from accelerate import PartialState

    from dppo_trl.backends.cpu.engine import resolve_engine_dtype
    from dppo_trl.backends.cpu.platform import is_vllm_cpu_platform

    if not (training_args.use_vllm and training_args.vllm_mode == "colocate" and is_vllm_cpu_platform()):
        return
    if PartialState().is_main_process:
        dtype, reason = resolve_engine_dtype(training_args.vllm_cpu_dtype)
        trainer_dtype = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "fp32"
        print(f"vLLM CPU engine dtype: {dtype} ({reason}); trainer: {trainer_dtype}", flush=True)


def main(
    script_args: DAPOMathScriptArguments,
    training_args: DPPOConfig,
    model_args: ModelConfig,
    callbacks: list | None = None,
) -> DPPOTrainer:
    """Run the recipe and return the trained `DPPOTrainer` (its `state.log_history` holds every metric)."""
    # Fail before loading anything; resolves `--resume_from_checkpoint latest` (examples/dapo_math/preflight.py).
    run_preflight(script_args, training_args, model_args)
    resolve_model_and_data(script_args, model_args)

    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": getattr(training_args, "trust_remote_code", None),
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    quantization_config = get_quantization_config(model_args)
    if quantization_config is not None:
        from trl import get_kbit_device_map

        model_init_kwargs["device_map"] = get_kbit_device_map()
    # Recipe values (e.g. MoE `output_router_logits`) win over the generic ModelConfig ones.
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = {k: v for k, v in model_init_kwargs.items() if v is not None}

    train_dataset = load_dapo_math(
        script_args.dataset_name,
        split=script_args.dataset_train_split,
        dedup=script_args.dedup,
        max_samples=script_args.max_train_samples,
        config_name=script_args.dataset_config,
    )
    eval_sets = load_eval_sets(script_args)

    reward_funcs = [accuracy_reward]
    if script_args.format_reward_weight:
        reward_funcs.append(format_reward)
        if training_args.reward_weights is None:
            training_args.reward_weights = [1.0, script_args.format_reward_weight]

    print_engine_dtype(training_args)
    trainer = DPPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        peft_config=get_peft_config(model_args),
        quantization_config=quantization_config,
        callbacks=callbacks,
    )

    eval_callback = None
    if eval_sets:
        eval_callback = MathEvalCallback(
            trainer,
            eval_sets,
            num_samples=script_args.math_eval_num_samples,
            eval_steps=script_args.math_eval_steps,
        )
        trainer.add_callback(eval_callback)

    # The card names a local dataset by file name, marked local (dppo_trl/hardening/model_card.py).
    dataset_for_card = script_args.dataset_name
    attach_recipe_to_model_card(
        trainer,
        lambda: recipe_card_section(
            script_args, training_args, model_args, eval_callback.latest if eval_callback else {}
        ),
        dataset_for_card,
    )

    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    history = trainer.state.log_history
    if trainer.accelerator.is_main_process:
        if any("reward" in e for e in history):
            print(summary_line(summarize_run(history)), flush=True)
        if script_args.plot_curves:
            path = plot_training_curves(history, os.path.join(training_args.output_dir, "training_curves.png"))
            if path:
                print(f"Saved training curves to {path}")
        with open(os.path.join(training_args.output_dir, "log_history.json"), "w") as f:
            json.dump(history, f, indent=1)

    trainer.save_model(training_args.output_dir)
    trainer.create_model_card(model_name=os.path.basename(os.path.normpath(training_args.output_dir)))
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_for_card)
    return trainer


if __name__ == "__main__":
    main(*parse_args())
