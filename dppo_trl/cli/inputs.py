"""What a run checks and loads before its model: sources, the output folder, rewards, the training data.

Every check raises `CLIError` (a `ValueError`) naming the option and the fix, before any model or engine loads:

- `--model_name_or_path` / `--dataset_name` / `--reward_model_name_or_path`: a value written as a path must exist;
  only a value that is not one is read as a Hub id (a model id must then be in the cache under `HF_HUB_OFFLINE=1`).
  Local data files must hold at least one row.
- `--reward_funcs`: each name is one of TRL's bundled rewards or an importable `module.function`.
- The training data must have a `prompt` column (what GRPOTrainer reads).
- `--output_dir`: a run never silently writes over a previous one. A folder holding checkpoints or a trained model
  is used only with `--resume_from_checkpoint` (a path, or `true`/`latest` for the newest complete checkpoint) or
  `--overwrite_output_dir` (which deletes the old checkpoints and run files first).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dppo_trl.cli.options import CLIError
from dppo_trl.hardening.checkpoints import is_complete_checkpoint, latest_complete_checkpoint, scan_checkpoints
from dppo_trl.hardening.model_card import looks_like_local_path

# Files that mean "a trained model lives here" (transformers / PEFT save names).
MODEL_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
RESUME_LATEST = ("true", "latest", "last")
RESUME_NONE = ("", "false", "none", "no")
DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# `trl grpo`'s reward names (trl/scripts/grpo.py), resolved from `trl.rewards` with the same settings.
BUNDLED_REWARDS = (
    "accuracy_reward",
    "reasoning_accuracy_reward",
    "think_format_reward",
    "get_soft_overlong_punishment",
)


# --- sources ---------------------------------------------------------------------------------------------------------
def check_source(option: str, value: str, kind: str) -> None:
    """`value` of `--option` must be an existing local path, or a Hub id that can be reached."""
    if os.path.exists(os.path.expanduser(value)):
        return
    if looks_like_local_path(value):
        raise CLIError(
            f"{option} {value!r} does not exist: no such local file or folder (from {os.getcwd()!r}). Fix the path, "
            f"or pass a Hub {kind} id such as 'org/name'."
        )
    # Models load from the Hub cache; datasets may also come from the `datasets` cache, so only models are checked.
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if kind == "model" and offline and not _in_hub_cache(value, kind):
        raise CLIError(
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
            raise CLIError(f"{option} {path!r} is empty: it holds no rows. Point {option} at a file with prompts.")


# --- output folder and resuming --------------------------------------------------------------------------------------
def previous_run_contents(output_dir: str, run_files: Sequence[str] = ()) -> list[str]:
    """Names in `output_dir` that belong to an earlier run: checkpoints (complete or not), model and run files."""
    if not os.path.isdir(output_dir):
        return []
    complete, incomplete = scan_checkpoints(output_dir)
    found = [os.path.basename(p) for p in complete + incomplete]
    found += [name for name in (*MODEL_FILES, *run_files) if os.path.exists(os.path.join(output_dir, name))]
    return found


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """`--resume_from_checkpoint` as a checkpoint path (or None): `true`/`latest` is the newest complete one."""
    if value is None or str(value).strip().lower() in RESUME_NONE:
        return None
    complete, incomplete = scan_checkpoints(output_dir)
    if str(value).strip().lower() in RESUME_LATEST:
        skipped = [os.path.basename(p) for p in incomplete]
        if not complete:
            raise CLIError(
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
        raise CLIError(
            f"--resume_from_checkpoint {value!r} is not a folder. Pass a checkpoint folder (e.g. "
            f"{os.path.join(output_dir, 'checkpoint-500')}) or `latest` for the newest complete one in --output_dir."
        )
    if not is_complete_checkpoint(path):
        raise CLIError(
            f"--resume_from_checkpoint {value!r} is incomplete (no readable trainer_state.json: its save was "
            "interrupted). Pass an earlier checkpoint, or `latest` for the newest complete one."
        )
    return path


def prepare_output_dir(overwrite: bool, training_args: Any, run_files: Sequence[str] = ()) -> None:
    """Apply the output-folder policy (module docstring); sets `training_args.resume_from_checkpoint` to a path.

    `run_files`: files a previous run of the caller left (curves, logs), deleted with its checkpoints on overwrite.
    """
    output_dir = training_args.output_dir
    resume = resolve_resume(training_args.resume_from_checkpoint, output_dir)
    training_args.resume_from_checkpoint = resume
    if resume is not None:
        return
    previous = previous_run_contents(output_dir, run_files)
    if not previous:
        return
    if not overwrite:
        shown = ", ".join(previous[:6]) + (", ..." if len(previous) > 6 else "")
        raise CLIError(
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
    for name in run_files:
        if os.path.exists(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))
            removed.append(name)
    # The model files are left to be overwritten by this run's save.
    print(f"--overwrite_output_dir: removed {', '.join(removed) or 'nothing'} from {output_dir}", flush=True)


# --- rewards ---------------------------------------------------------------------------------------------------------
def _bundled_reward(name: str) -> Callable:
    from trl import rewards

    if name == "get_soft_overlong_punishment":
        return rewards.get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)
    return getattr(rewards, name)


def resolve_reward_func(name: str) -> Callable:
    """One `--reward_funcs` entry as a callable: a bundled name or `module.function` (current folder first)."""
    if name in BUNDLED_REWARDS:
        return _bundled_reward(name)
    if "." not in name:
        raise CLIError(
            f"--reward_funcs {name!r} is neither a bundled reward ({', '.join(BUNDLED_REWARDS)}) nor an import path. "
            "Name a function as `package.module.function`, e.g. `my_rewards.accuracy` for a `my_rewards.py` in the "
            "current folder."
        )
    module_name, attribute = name.rsplit(".", 1)
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)  # as `trl grpo`: a rewards file next to the recipe imports by its name
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise CLIError(
            f"--reward_funcs {name!r}: cannot import the module {module_name!r} ({error}). It is looked up in the "
            f"current folder ({cwd!r}) and the installed packages: fix the path, run from the folder that holds the "
            "module, or install the package that defines it."
        ) from error
    finally:
        if added:
            sys.path.remove(cwd)
    function = getattr(module, attribute, None)
    if function is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise CLIError(
            f"--reward_funcs {name!r}: the module {module_name!r} has no {attribute!r}"
            + (f" (its functions: {', '.join(public[:12])})" if public else "")
            + ". Fix the function's name."
        )
    if not callable(function):
        raise CLIError(f"--reward_funcs {name!r} is a {type(function).__name__}, not a function. Name a callable.")
    return function


def resolve_rewards(script_args: Any, default: list | None) -> list:
    """The run's rewards: the reward model first, then `--reward_funcs` (or the taking-part recipe's default)."""
    rewards: list = []
    if script_args.reward_model_name_or_path:
        check_source("--reward_model_name_or_path", script_args.reward_model_name_or_path, "model")
        rewards.append(script_args.reward_model_name_or_path)
    if script_args.reward_funcs:
        rewards += [resolve_reward_func(name) for name in script_args.reward_funcs]
    elif default:
        rewards += default
    if not rewards:
        raise CLIError(
            "no reward: pass --reward_funcs (a bundled name such as `accuracy_reward`, or an import path "
            "`package.module.function`) or --reward_model_name_or_path."
        )
    return rewards


# --- data ------------------------------------------------------------------------------------------------------------
def load_local_or_hub(name_or_path: str, split: str = "train", config_name: str | None = None, streaming=False):
    """A dataset split from a local file (json/jsonl/parquet/csv), a local folder (data files or `save_to_disk`) or
    the Hub."""
    from datasets import load_dataset, load_from_disk

    path = os.path.expanduser(name_or_path)
    if os.path.isfile(path):
        extension = os.path.splitext(path)[1].lower()
        if extension not in DATA_EXTENSIONS:
            raise CLIError(
                f"Unsupported data file {name_or_path!r}: expected one of {sorted(DATA_EXTENSIONS)} (or a folder, or "
                "a Hub dataset id)."
            )
        # A single file has no splits: `datasets` calls it "train" whatever it holds.
        return load_dataset(DATA_EXTENSIONS[extension], data_files=path, split="train", streaming=streaming)
    if os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, n)) for n in ("dataset_info.json", "dataset_dict.json")
    ):
        loaded = load_from_disk(path)
        if hasattr(loaded, "keys"):
            if split not in loaded:
                raise CLIError(
                    f"--dataset_name {name_or_path!r} has no split {split!r} (splits: {sorted(loaded)}). "
                    "Pass --dataset_train_split."
                )
            return loaded[split]
        return loaded
    try:
        return load_dataset(
            path if os.path.isdir(path) else name_or_path, config_name, split=split, streaming=streaming
        )
    except ValueError as error:
        if "split" in str(error).lower():
            raise CLIError(f"--dataset_name {name_or_path!r}: {error} Pass --dataset_train_split.") from error
        raise


def prompt_key(prompt: Any) -> str:
    """A stable key for one prompt (a string, or a conversation of role/content messages)."""
    if isinstance(prompt, list):
        text = "\x1e".join(f"{m['role']}\x1f{m['content']}" for m in prompt)
    else:
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def drop_repeated_prompts(dataset):
    """The dataset with the first row of each distinct `prompt`, in the original order."""
    seen, keep = set(), []
    for i, prompt in enumerate(dataset["prompt"]):
        key = prompt_key(prompt)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return dataset.select(keep) if len(keep) < len(dataset) else dataset


def check_prompt_column(dataset, option: str) -> None:
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        return  # a streamed dataset of unknown schema: TRL reports it at the first batch
    if "prompt" not in columns:
        raise CLIError(
            f"{option}: the training data has no `prompt` column (columns: {', '.join(columns)}). DPPO, like GRPO, "
            "samples completions for the prompts in `prompt` (strings or conversations [{'role': 'user', 'content': "
            "...}]): rename the column that holds them (`dataset.rename_column(old, 'prompt')`, or the key in your "
            "json/jsonl file), or pass a dataset in TRL's prompt-only format."
        )


def load_training_data(script_args: Any, dataset_args: Any, training_args: Any) -> tuple[Any, Any]:
    """(train, eval) datasets, as `trl grpo` chooses them: a `datasets:` mixture, else `--dataset_name`."""
    from trl import get_dataset

    if dataset_args.datasets:
        if script_args.dataset_name:
            print("Both `datasets` and `--dataset_name` are set: the `datasets` mixture is used.", flush=True)
        loaded = get_dataset(dataset_args)
        train = loaded[script_args.dataset_train_split]
        evaluation = loaded.get(script_args.dataset_test_split) if training_args.eval_strategy != "no" else None
        option = "datasets"
    elif script_args.dataset_name:
        check_source("--dataset_name", script_args.dataset_name, "dataset")
        check_data_file("--dataset_name", script_args.dataset_name)
        load = dict(config_name=script_args.dataset_config, streaming=script_args.dataset_streaming)
        train = load_local_or_hub(script_args.dataset_name, script_args.dataset_train_split, **load)
        evaluation = None
        if training_args.eval_strategy != "no":
            evaluation = load_local_or_hub(script_args.dataset_name, script_args.dataset_test_split, **load)
        option = f"--dataset_name {script_args.dataset_name!r}"
    else:
        raise CLIError(
            "no training data: pass --dataset_name (a Hub id or a local file or folder) or a `datasets:` "
            "mixture in --config."
        )
    check_prompt_column(train, option)
    if (script_args.dedup or script_args.max_train_samples is not None) and not hasattr(train, "__len__"):
        raise CLIError(
            "--dedup and --max_train_samples need the whole dataset; a streamed one (--dataset_streaming) has no "
            "length. Drop them or the streaming."
        )
    if script_args.dedup:
        train = drop_repeated_prompts(train)
    if script_args.max_train_samples is not None:
        train = train.select(range(min(script_args.max_train_samples, len(train))))
    return train, evaluation


# --- model -----------------------------------------------------------------------------------------------------------
def model_init_kwargs(model_args: Any, training_args: Any) -> dict[str, Any]:
    """`training_args.model_init_kwargs` from TRL's `ModelConfig`, as `trl grpo` builds it; the config's own
    `model_init_kwargs` (e.g. a MoE recipe's `output_router_logits`) win."""
    from trl import get_quantization_config

    kwargs: dict[str, Any] = {
        "revision": model_args.model_revision,
        "trust_remote_code": getattr(training_args, "trust_remote_code", None),
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    if get_quantization_config(model_args) is not None:
        from trl import get_kbit_device_map

        kwargs["device_map"] = get_kbit_device_map()
    kwargs.update(training_args.model_init_kwargs or {})
    return {k: v for k, v in kwargs.items() if v is not None}
