"""`dppo-trl train`: DPPOTrainer as `trl grpo` runs GRPOTrainer.

`dppo-trl train ARGS` checks ARGS here (parser, rewards, data, output folder: before any model loads), then runs
`accelerate launch [launch options] -m dppo_trl.cli.train ARGS`; this module is that training script too, so
`accelerate launch -m dppo_trl.cli.train ...` and `python -m dppo_trl.cli.train ...` run the same thing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dppo_trl.cli.inputs import load_training_data, model_init_kwargs, prepare_output_dir, resolve_rewards
from dppo_trl.cli.options import CLIError, ParsedRun, TrainScriptArguments, parse_run

PROG = "dppo-trl train"


@dataclass
class PreparedRun:
    run: ParsedRun
    reward_funcs: list
    train_dataset: Any
    eval_dataset: Any


def parse(argv: Sequence[str] | None = None, return_remaining: bool = False) -> ParsedRun:
    from dppo_trl import DPPOConfig

    return parse_run(
        argv, TrainScriptArguments, DPPOConfig, asynchronous=False, prog=PROG, return_remaining=return_remaining
    )


def default_rewards(run: ParsedRun) -> list | None:
    for recipe, options in run.recipes:
        rewards = recipe.reward_funcs(options, run.training_args)
        if rewards is not None:
            return rewards
    return None


def prepare(run: ParsedRun) -> PreparedRun:
    """Every check and load a run makes before its model (shared by the launcher and the training processes)."""
    from dppo_trl.cli.inputs import check_source
    from dppo_trl.hardening.inputs import check_generation_config

    script_args, training_args, model_args = run.script_args, run.training_args, run.model_args
    check_generation_config(training_args)
    if model_args.model_name_or_path is None:
        raise CLIError("no --model_name_or_path: pass a Hub model id or a local model folder.")
    check_source("--model_name_or_path", model_args.model_name_or_path, "model")
    for recipe, options in run.recipes:
        recipe.check(options, script_args, training_args)
    reward_funcs = resolve_rewards(script_args, default_rewards(run))
    prepare_output_dir(script_args.overwrite_output_dir, training_args)
    train_dataset, eval_dataset = load_training_data(script_args, run.dataset_args, training_args)
    return PreparedRun(run, reward_funcs, train_dataset, eval_dataset)


def train(prepared: PreparedRun, callbacks: list | None = None):
    """Build the DPPOTrainer, train, save; returns the trainer."""
    from trl import get_peft_config, get_quantization_config

    from dppo_trl import DPPOTrainer

    run = prepared.run
    script_args, training_args, model_args = run.script_args, run.training_args, run.model_args
    training_args.model_init_kwargs = model_init_kwargs(model_args, training_args)
    processing_class = None
    for recipe, _ in run.recipes:
        processing_class = processing_class or recipe.processing_class(model_args.model_name_or_path)
    trainer = DPPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=prepared.reward_funcs,
        args=training_args,
        train_dataset=prepared.train_dataset,
        eval_dataset=prepared.eval_dataset,
        processing_class=processing_class,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
        callbacks=callbacks,
    )
    for recipe, options in run.recipes:
        recipe.attach(trainer, options, script_args, False)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    processes = trainer.accelerator.num_processes
    trainer.accelerator.print(f"Training completed on {processes} process{'es' if processes > 1 else ''}.")
    for recipe, options in run.recipes:
        recipe.finish(trainer, options, False)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return trainer


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        prepared = prepare(parse(argv))
    except CLIError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    train(prepared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
