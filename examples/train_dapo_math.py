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

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from dapo_math.card import attach_recipe_to_model_card, recipe_card_section
from dapo_math.data import load_dapo_math
from dapo_math.demo import TINY_EVAL_DEFAULTS, TINY_MODEL_DIR, TINY_RUN_DEFAULTS, TINY_TEST_FILE, TINY_TRAIN_FILE
from dapo_math.evaluation import MathEvalCallback
from dapo_math.evaluation import load_eval_sets as load_math_eval_sets
from dapo_math.plots import plot_training_curves, summarize_run, summary_line
from dapo_math.preflight import run_preflight
from dapo_math.recipe import MathRecipeArguments, math_rewards
from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.cli.inputs import model_init_kwargs
from dppo_trl.cli.options import explicit_arg_names, has_accelerator

# The no-argument CPU run's settings (`TINY_RUN_DEFAULTS`, `TINY_EVAL_DEFAULTS`) and the bundled model and data live
# in `dapo_math.demo`, shared with `dppo-trl train`; `examples/recipes/tiny_math_cpu.yaml` spells them out.


@dataclass
class DAPOMathScriptArguments(MathRecipeArguments, ScriptArguments):
    """Data, reward and evaluation options of `train_dapo_math.py` (TRL's `ScriptArguments`, the DAPO-Math recipe's
    options shared with `dppo-trl`, and the script's data options)."""

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
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start over in an `--output_dir` that holds a previous run: its checkpoints, curves and logs are "
            "deleted first. Without it (or `--resume_from_checkpoint latest`) such a folder is refused. (transformers "
            "5 dropped this TrainingArguments option; the script keeps it.)"
        },
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
    if not has_accelerator():
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
    return load_math_eval_sets(
        script_args.math_eval_datasets or [], script_args.math_eval_split, script_args.max_eval_samples
    )


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

    # Recipe values (e.g. MoE `output_router_logits`) win over the generic ModelConfig ones.
    training_args.model_init_kwargs = model_init_kwargs(model_args, training_args)
    quantization_config = get_quantization_config(model_args)

    train_dataset = load_dapo_math(
        script_args.dataset_name,
        split=script_args.dataset_train_split,
        dedup=script_args.dedup,
        max_samples=script_args.max_train_samples,
        config_name=script_args.dataset_config,
    )
    eval_sets = load_eval_sets(script_args)

    reward_funcs = math_rewards(script_args, training_args)

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
