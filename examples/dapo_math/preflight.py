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

import os
import shutil

from dppo_trl.hardening.checkpoints import latest_complete_checkpoint, scan_checkpoints
from dppo_trl.hardening.inputs import check_generation_config
from dppo_trl.hardening.model_card import looks_like_local_path

# Files that mean "a trained model lives here" (transformers / PEFT save names) or a previous run of this recipe.
MODEL_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
RUN_FILES = ("training_curves.png", "log_history.json")
RESUME_LATEST = ("true", "latest", "last")
RESUME_NONE = ("", "false", "none", "no")


def check_source(option: str, value: str, kind: str) -> None:
    """`value` of `--option` must be an existing local path, or a Hub id that can be reached."""
    if os.path.exists(os.path.expanduser(value)):
        return
    if looks_like_local_path(value):
        raise ValueError(
            f"{option} {value!r} does not exist: no such local file or folder (from {os.getcwd()!r}). Fix the path, "
            f"or pass a Hub {kind} id such as 'org/name'."
        )
    # Models load from the Hub cache; datasets may also come from the `datasets` cache, so only models are checked.
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if kind == "model" and offline and not _in_hub_cache(value, kind):
        raise ValueError(
            f"{option} {value!r} is not a local path, so it is read as a Hub {kind} id, but HF_HUB_OFFLINE=1 and the "
            f"{kind} is not in the Hugging Face cache. Pass a local folder, or download it first (unset HF_HUB_OFFLINE "
            f"and run `hf download {value}`)."
        )


def _in_hub_cache(repo_id: str, kind: str) -> bool:
    from huggingface_hub import scan_cache_dir

    try:
        repos = scan_cache_dir().repos
    except Exception:  # no cache folder at all
        return False
    return any(r.repo_id == repo_id and r.repo_type == kind for r in repos)


def check_data_file(option: str, path: str) -> None:
    """A local json/jsonl/csv file must hold at least one row (an empty one makes `datasets` raise StopIteration)."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path) or os.path.splitext(path)[1].lower() not in (".json", ".jsonl", ".csv"):
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        if not any(line.strip() for line in f):
            raise ValueError(f"{option} {path!r} is empty: it holds no rows. Point {option} at a file with problems.")


def check_sources(script_args, model_args) -> None:
    """Model and data options the user set (the bundled demo paths are not checked: they ship with the example)."""
    if model_args.model_name_or_path is not None:
        check_source("--model_name_or_path", model_args.model_name_or_path, "model")
    if script_args.dataset_name is not None:
        check_source("--dataset_name", script_args.dataset_name, "dataset")
        check_data_file("--dataset_name", script_args.dataset_name)
    from dapo_math.data import AIME_DATASETS

    for spec in script_args.math_eval_datasets or []:
        if spec.lower() == "none":
            continue
        source = spec.split("=", 1)[1] if "=" in spec else spec
        source = AIME_DATASETS.get(source, source)
        check_source("--math_eval_datasets", source, "dataset")
        check_data_file("--math_eval_datasets", source)


def previous_run_contents(output_dir: str) -> list[str]:
    """Names in `output_dir` that belong to an earlier run: checkpoints (complete or not), model and run files."""
    if not os.path.isdir(output_dir):
        return []
    complete, incomplete = scan_checkpoints(output_dir)
    found = [os.path.basename(p) for p in complete + incomplete]
    found += [name for name in MODEL_FILES + RUN_FILES if os.path.exists(os.path.join(output_dir, name))]
    return found


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """`--resume_from_checkpoint` as a checkpoint path (or None): `true`/`latest` is the newest complete one."""
    if value is None or str(value).strip().lower() in RESUME_NONE:
        return None
    complete, incomplete = scan_checkpoints(output_dir)
    if str(value).strip().lower() in RESUME_LATEST:
        skipped = [os.path.basename(p) for p in incomplete]
        if not complete:
            raise ValueError(
                f"--resume_from_checkpoint {value}: {output_dir!r} holds no complete checkpoint"
                + (f" (incomplete, skipped: {', '.join(skipped)})" if skipped else "")
                + ". Start without --resume_from_checkpoint (with --overwrite_output_dir if the folder holds a "
                "previous run), or pass the path of a checkpoint."
            )
        latest = latest_complete_checkpoint(output_dir)
        if skipped:
            print(f"Skipping incomplete checkpoints (interrupted saves): {', '.join(skipped)}", flush=True)
        print(f"Resuming from the newest complete checkpoint: {latest}", flush=True)
        return latest
    path = os.path.expanduser(str(value))
    if not os.path.isdir(path):
        raise ValueError(
            f"--resume_from_checkpoint {value!r} is not a folder. Pass a checkpoint folder (e.g. "
            f"{os.path.join(output_dir, 'checkpoint-500')}) or `latest` for the newest complete one in --output_dir."
        )
    from dppo_trl.hardening.checkpoints import is_complete_checkpoint

    if not is_complete_checkpoint(path):
        raise ValueError(
            f"--resume_from_checkpoint {value!r} is incomplete (no readable trainer_state.json: its save was "
            "interrupted). Pass an earlier checkpoint, or `latest` for the newest complete one."
        )
    return path


def prepare_output_dir(script_args, training_args) -> None:
    """Apply the output-folder policy (module docstring); sets `training_args.resume_from_checkpoint` to a path."""
    output_dir = training_args.output_dir
    resume = resolve_resume(training_args.resume_from_checkpoint, output_dir)
    training_args.resume_from_checkpoint = resume
    if resume is not None:
        return
    previous = previous_run_contents(output_dir)
    if not previous:
        return
    if not script_args.overwrite_output_dir:
        shown = ", ".join(previous[:6]) + (", ..." if len(previous) > 6 else "")
        raise ValueError(
            f"--output_dir {output_dir!r} already holds a previous run ({shown}). Pass --resume_from_checkpoint "
            "latest to continue it, or --overwrite_output_dir to start over in it (its checkpoints, curves and logs "
            "are deleted first), or choose another --output_dir."
        )
    if int(os.environ.get("RANK", "0")) != 0:
        return
    complete, incomplete = scan_checkpoints(output_dir)
    removed = [os.path.basename(p) for p in complete + incomplete]
    for path in complete + incomplete:
        shutil.rmtree(path)
    for name in RUN_FILES:
        if os.path.exists(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))
            removed.append(name)
    # The model files are left to be overwritten by this run's save.
    print(f"--overwrite_output_dir: removed {', '.join(removed) or 'nothing'} from {output_dir}", flush=True)


def run_preflight(script_args, training_args, model_args) -> None:
    """Everything `main()` checks before it loads data (call before `resolve_model_and_data`)."""
    check_generation_config(training_args)
    check_sources(script_args, model_args)
    prepare_output_dir(script_args, training_args)
