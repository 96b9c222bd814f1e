"""Checks `train_dapo_math.py` runs before loading any data, model or engine, and its output-folder policy.

- `--model_name_or_path` / `--dataset_name` / `--math_eval_datasets`: a value written as a path must exist; only a
  value that is not one is read as a Hub id (a model id must then be in the cache when `HF_HUB_OFFLINE=1`). Data
  files must hold at least one row.
- `--max_completion_length` and the other trainer-input checks are DPPOTrainer's own (`dppo_trl/hardening/inputs.py`); the
  config-only ones run here too, before the data is loaded.
- `--output_dir`: a run never silently writes over a previous one. A folder holding checkpoints or a trained model
  is used only with `--resume_from_checkpoint` (a path, or `true`/`latest` for the newest complete checkpoint) or
  `--overwrite_output_dir` (which deletes the old checkpoints, curves and logs first).
"""

from __future__ import annotations

from dppo_trl.cli import inputs
from dppo_trl.cli.inputs import check_data_file, check_source, resolve_resume
from dppo_trl.hardening.inputs import check_generation_config

# Files that mean "a trained model lives here" (transformers / PEFT save names) or a previous run of this recipe.
MODEL_FILES = inputs.MODEL_FILES
RUN_FILES = ("training_curves.png", "log_history.json")

__all__ = [
    "check_data_file",
    "check_source",
    "check_sources",
    "prepare_output_dir",
    "previous_run_contents",
    "resolve_resume",
    "run_preflight",
]


def check_sources(script_args, model_args) -> None:
    """Model and data options the user set (the bundled demo paths are not checked: they ship with the example)."""
    if model_args.model_name_or_path is not None:
        check_source("--model_name_or_path", model_args.model_name_or_path, "model")
    if script_args.dataset_name is not None:
        check_source("--dataset_name", script_args.dataset_name, "dataset")
        check_data_file("--dataset_name", script_args.dataset_name)
    from dapo_math.recipe import check_eval_sources

    check_eval_sources(script_args)


def previous_run_contents(output_dir: str) -> list[str]:
    """Names in `output_dir` that belong to an earlier run: checkpoints (complete or not), model and run files."""
    return inputs.previous_run_contents(output_dir, RUN_FILES)


def prepare_output_dir(script_args, training_args) -> None:
    """Apply the output-folder policy (module docstring); sets `training_args.resume_from_checkpoint` to a path."""
    inputs.prepare_output_dir(script_args.overwrite_output_dir, training_args, RUN_FILES)


def run_preflight(script_args, training_args, model_args) -> None:
    """Everything `main()` checks before it loads data (call before `resolve_model_and_data`)."""
    check_generation_config(training_args)
    check_sources(script_args, model_args)
    prepare_output_dir(script_args, training_args)
