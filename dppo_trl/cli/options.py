"""The options of `dppo-trl train` and `train-async`, and how a command line becomes a run's settings.

The parser is TRL's (`TrlParser`: `--config` YAML recipes and their `env:` block, any field as a flag, the command
line winning over the YAML) over the script arguments below, the trainer's config, TRL's `ModelConfig` (PEFT and
quantization flags) and `DatasetMixtureConfig` (`datasets:` mixtures), plus the options of the installed recipes
(`dppo_trl.cli.recipes`). Defaults are installed before parsing, so anything set on the command line or in
`--config` wins and the configs' post-processing sees the final values:

- no `--model_name_or_path` (flag or YAML): the bundled demo's settings, from the recipe that provides it;
- no CUDA/XPU/MPS device: `use_cpu=True` and `bf16=False` (TRL's bf16 default runs as slow autocast on CPU).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

from trl import ScriptArguments

from dppo_trl.cli.recipes import Recipe, installed_recipes


class CLIError(ValueError):
    """Bad input to `dppo-trl`: the message names the option and the fix; the command exits with code 2."""


@dataclass
class TrainScriptArguments(ScriptArguments):
    """Data and reward options of `dppo-trl train` (TRL's `ScriptArguments` plus `trl grpo`'s reward options)."""

    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: TRL's bundled `accuracy_reward`, `reasoning_accuracy_reward`, "
            "`think_format_reward`, `get_soft_overlong_punishment` (max_completion_len=1280, soft_punish_cache=256, "
            "as `trl grpo`), or any import path `package.module.function` (the current folder is searched first). "
            "Weights: `--reward_weights`."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A reward model (Hub id or local folder) scored before the `--reward_funcs`."},
    )
    dedup: bool = field(
        default=False,
        metadata={"help": "Drop repeated prompts, keeping the first of each (DAPO-Math-17k repeats each ~100 times)."},
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N (deduplicated) training prompts."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start over in an `--output_dir` that holds a previous run (its checkpoints are deleted first). "
            "Without it (or `--resume_from_checkpoint latest`) such a folder is refused."
        },
    )


@dataclass
class AsyncTrainScriptArguments(TrainScriptArguments):
    """`dppo-trl train-async`'s options: those of `train`, plus the CPU server the run may start for itself."""

    start_server: bool | None = field(
        default=None,
        metadata={
            "help": "Start a CPU vLLM server (`dppo-trl vllm-serve`) for the model on a free local port, stopped after "
            "training. Default: yes without CUDA unless `--vllm_server_base_url` is given; no with CUDA (start "
            "`dppo-trl vllm-serve` on its own GPUs and pass `--vllm_server_base_url`)."
        },
    )
    server_max_model_len: int = field(
        default=512, metadata={"help": "Context length of the server `--start_server` starts."}
    )


@dataclass
class ParsedRun:
    """A parsed command line: every dataclass it filled, and which recipes take part."""

    script_args: Any
    training_args: Any
    model_args: Any
    dataset_args: Any
    recipes: list[tuple[Recipe, Any]]  # the recipes taking part, with their parsed options
    demo: Recipe | None  # the recipe whose bundled demo supplied the defaults
    explicit: set[str]
    config_remaining: list[str] = field(default_factory=list)
    cli_remaining: list[str] = field(default_factory=list)


def explicit_arg_names(argv: Sequence[str]) -> set[str]:
    """Option names the user set, on the command line or in the `--config` YAML (everything else is a default)."""
    argv = list(argv)
    names = {arg[2:].split("=", 1)[0] for arg in argv if arg.startswith("--")}
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        import yaml

        path = argv[argv.index("--config") + 1]
        if not os.path.isfile(path):
            raise CLIError(f"--config {path!r}: no such file (from {os.getcwd()!r}). Fix the path to the YAML recipe.")
        with open(path) as f:
            config = yaml.safe_load(f) or {}
        if not isinstance(config, dict):
            raise CLIError(f"--config {path!r} must hold a YAML mapping of option: value.")
        names |= set(config)
    return names


def has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or any(
        getattr(torch, name, None) is not None and getattr(torch, name).is_available() for name in ("xpu", "mps")
    )


def wants_help(argv: Sequence[str]) -> bool:
    return any(arg in ("-h", "--help") for arg in argv)


def model_config_class(config_class: type) -> type:
    """TRL's `ModelConfig`, less the fields the trainer's config already has (`AsyncGRPOConfig.dtype`: the model and
    server dtype there), so both parse into one command line."""
    from trl import ModelConfig

    shared = {f.name for f in fields(ModelConfig)} & {f.name for f in fields(config_class)}
    if not shared:
        return ModelConfig
    kept = [(f.name, f.type, f) for f in fields(ModelConfig) if f.name not in shared]
    namespace = {"__post_init__": ModelConfig.__post_init__, "__doc__": ModelConfig.__doc__}
    namespace.update({name: None for name in shared})  # read as unset (`model_init_kwargs`): the config's own wins
    return make_dataclass("ModelConfig", kept, namespace=namespace)


def make_parser(script_class: type, config_class: type, recipes: Sequence[Recipe], prog: str | None = None):
    from trl import DatasetMixtureConfig, TrlParser

    recipe_types = [r.arguments for r in recipes if r.arguments is not None]
    model_class = model_config_class(config_class)
    return TrlParser((script_class, config_class, model_class, DatasetMixtureConfig, *recipe_types), prog=prog)


def _demo_defaults(command: str, recipes: Sequence[Recipe], asynchronous: bool) -> tuple[Recipe, dict[str, Any]]:
    for recipe in recipes:
        settings = recipe.demo(asynchronous)
        if settings is not None:
            return recipe, settings
    raise CLIError(
        f"no --model_name_or_path given (on the command line or in --config), and no bundled demo is installed. "
        f"The CPU demo (the tiny Qwen3 of examples/tiny_math_model, the tiny math set, the math rewards) comes with "
        f"a clone of the dppo-trl repository, where `bash scripts/setup.sh` installs it. To train your own model, "
        f"pass --model_name_or_path, --dataset_name and --reward_funcs, e.g. `{command} --model_name_or_path "
        f"Qwen/Qwen3-0.6B --dataset_name trl-lib/DeepMath-103K --reward_funcs accuracy_reward`, or a --config recipe."
    )


def parse_run(
    argv: Sequence[str] | None,
    script_class: type,
    config_class: type,
    *,
    asynchronous: bool,
    prog: str,
    return_remaining: bool = False,
) -> ParsedRun:
    """Parse a `train`/`train-async` command line into its settings (`-h` prints the help and exits).

    With `return_remaining`, options no dataclass knows are returned (from the YAML and from the command line
    separately, as TRL's CLI splits them): the launcher hands them to `accelerate launch`. Without it, unknown YAML
    keys are left to the launcher too (it ran first), and unknown flags are an error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    recipes = installed_recipes()
    parser = make_parser(script_class, config_class, recipes, prog=prog)
    explicit = set() if wants_help(argv) else explicit_arg_names(argv)
    defaults: dict[str, Any] = {}
    demo = None
    if not wants_help(argv) and "model_name_or_path" not in explicit:
        demo, settings = _demo_defaults(prog, recipes, asynchronous)
        defaults.update(settings)
    if not wants_help(argv) and not has_accelerator():
        defaults.update(use_cpu=True, bf16=False)
    unknown = parser.set_defaults_with_config(**defaults)
    if unknown:
        raise CLIError(f"the demo's settings name options this command does not have: {unknown[::2]}")
    if return_remaining:
        *parsed, config_remaining, cli_remaining = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    else:
        parsed = list(parser.parse_args_and_config(argv, fail_with_unknown_args=False))
        config_remaining, cli_remaining = [], []
    script_args, training_args, model_args, dataset_args, *recipe_options = parsed
    with_options = [r for r in recipes if r.arguments is not None]
    taking_part = []
    for recipe, options in zip(with_options, recipe_options):
        if recipe is demo or recipe.option_names() & explicit:
            taking_part.append((recipe, options))
    if demo is not None and demo.arguments is None:
        taking_part.append((demo, None))
    return ParsedRun(
        script_args=script_args,
        training_args=training_args,
        model_args=model_args,
        dataset_args=dataset_args,
        recipes=taking_part,
        demo=demo,
        explicit=explicit,
        config_remaining=list(config_remaining),
        cli_remaining=list(cli_remaining),
    )
