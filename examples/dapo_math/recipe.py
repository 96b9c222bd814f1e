"""The DAPO-Math recipe for the `dppo-trl` command (registered by `dev/pyproject.toml` under `dppo_trl.recipes`).

It brings the options the example scripts and `examples/recipes/*.yaml` use beyond TRL's (`format_reward_weight`,
`math_eval_*`), so `dppo-trl train --config examples/recipes/qwen3_8b_base_dapo_math.yaml` runs the same recipe as
`examples/train_dapo_math.py`, and the bundled CPU demo (`dppo-trl train` / `train-async` without a model). When it
takes part (one of its options is set, or the demo runs) and no `--reward_funcs` is given, the run is rewarded with
`accuracy_reward` (plus `format_reward` at `format_reward_weight`), evaluates avg@k on `math_eval_datasets` and ends
with the example's summary.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from dapo_math import demo as bundled
from dppo_trl.cli.inputs import check_data_file, check_source
from dppo_trl.cli.options import CLIError
from dppo_trl.cli.recipes import Recipe

RUN_FILES = ("training_curves.png", "log_history.json")


@dataclass
class MathRecipeArguments:
    """The DAPO-Math recipe's reward and evaluation options (`examples/train_dapo_math.py` and `dppo-trl`)."""

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


def eval_specs(options: MathRecipeArguments) -> list[str]:
    """`--math_eval_datasets` with its default (AIME 2024/2025) applied; [] when disabled."""
    specs = options.math_eval_datasets if options.math_eval_datasets is not None else ["aime24", "aime25"]
    return [] if [s.lower() for s in specs] == ["none"] else list(specs)


def check_eval_sources(options: MathRecipeArguments) -> None:
    from dapo_math.data import AIME_DATASETS

    for spec in options.math_eval_datasets or []:
        if spec.lower() == "none":
            continue
        source = spec.split("=", 1)[1] if "=" in spec else spec
        source = AIME_DATASETS.get(source, source)
        check_source("--math_eval_datasets", source, "dataset")
        check_data_file("--math_eval_datasets", source)


def math_rewards(options: MathRecipeArguments, training_args) -> list:
    """`accuracy_reward`, plus `format_reward` weighted `format_reward_weight` (unless reward weights are set)."""
    from dapo_math.rewards import accuracy_reward, format_reward

    rewards = [accuracy_reward]
    if options.format_reward_weight:
        rewards.append(format_reward)
        if not hasattr(training_args, "reward_weights"):  # AsyncGRPOConfig sums its rewards unweighted
            if options.format_reward_weight != 1.0:
                raise CLIError(
                    f"--format_reward_weight {options.format_reward_weight}: the asynchronous trainer sums its rewards "
                    "unweighted. Pass 1 (or 0 to drop the format reward)."
                )
        elif training_args.reward_weights is None:
            training_args.reward_weights = [1.0, options.format_reward_weight]
    return rewards


class DAPOMathRecipe(Recipe):
    name = "dapo_math"
    arguments = MathRecipeArguments

    def demo(self, asynchronous: bool) -> dict:
        missing = [
            p
            for p in (bundled.TINY_MODEL_DIR, bundled.TINY_TRAIN_FILE, bundled.TINY_TEST_FILE)
            if not os.path.exists(p)
        ]
        if missing:
            raise CLIError(
                f"the bundled demo's files are missing: {', '.join(missing)}. They live in the clone the development "
                "package was installed from (`pip install --no-deps -e ./dev`); restore them (git checkout), or pass "
                "--model_name_or_path, --dataset_name and --reward_funcs."
            )
        common = {
            "model_name_or_path": bundled.TINY_MODEL_DIR,
            "dataset_name": bundled.TINY_TRAIN_FILE,
            "math_eval_datasets": [f"tiny_math_test={bundled.TINY_TEST_FILE}"],
        }
        if asynchronous:
            # The asynchronous example's: equal accuracy and format rewards, avg@4 before and after training.
            return {
                **common,
                **bundled.TINY_ASYNC_RUN_DEFAULTS,
                "format_reward_weight": 1.0,
                "math_eval_num_samples": 4,
            }
        return {**common, "dedup": True, **bundled.TINY_RUN_DEFAULTS, **bundled.TINY_EVAL_DEFAULTS}

    def reward_funcs(self, options, training_args) -> list:
        return math_rewards(options, training_args)

    def check(self, options, script_args, training_args) -> None:
        check_eval_sources(options)

    def attach(self, trainer, options, script_args, asynchronous: bool) -> None:
        from dapo_math.evaluation import MathEvalCallback, async_eval_callback, load_eval_sets

        eval_sets = load_eval_sets(eval_specs(options), options.math_eval_split, options.max_eval_samples)
        if not eval_sets:
            return
        if asynchronous:
            callback = async_eval_callback(trainer, eval_sets, options.math_eval_num_samples, trainer.args)
            callback.eval_steps = options.math_eval_steps
        else:
            callback = MathEvalCallback(
                trainer, eval_sets, num_samples=options.math_eval_num_samples, eval_steps=options.math_eval_steps
            )
        trainer.add_callback(callback)

    def finish(self, trainer, options, asynchronous: bool) -> None:
        from dapo_math.plots import plot_training_curves, summarize_async_run, summarize_run, summary_line

        if not trainer.accelerator.is_main_process:
            return
        history = trainer.state.log_history
        if asynchronous:
            print(json.dumps(summarize_async_run(history)), flush=True)
            return
        if any("reward" in e for e in history):
            print(summary_line(summarize_run(history)), flush=True)
        output_dir = trainer.args.output_dir
        if options.plot_curves:
            path = plot_training_curves(history, os.path.join(output_dir, "training_curves.png"))
            if path:
                print(f"Saved training curves to {path}")
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "log_history.json"), "w") as f:
            json.dump(history, f, indent=1)


RECIPE = DAPOMathRecipe()
