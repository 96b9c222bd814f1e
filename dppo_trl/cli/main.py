"""`dppo-trl`: the command line, as TRL's `trl` is built (`trl/cli/main.py`, `trl/cli/commands/training.py`).

`dppo-trl train|train-async ARGS` parses ARGS with the training script's own parser (so `-h` and bad values fail
here), checks everything it can before a model loads (rewards, data, output folder), then hands the options no
dataclass knows to `accelerate launch` (`--num_processes 2`, `--main_process_port`, ..., and
`--accelerate_config NAME|FILE` as `--config_file`) and launches `-m dppo_trl.cli.train[_async]` with the rest.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from dppo_trl.cli.options import CLIError

TRAINING_COMMANDS = {
    "train": ("dppo_trl.cli.train", "Train with DPPOTrainer (TRL's GRPOTrainer with DPPO's trust region)"),
    "train-async": ("dppo_trl.cli.train_async", "Train with AsyncDPPOTrainer (TRL's experimental AsyncGRPOTrainer)"),
}
VLLM_SERVE_HELP = "Serve a model with vLLM for server-mode training (TRL's server on GPU, the CPU server on CPU)"
# TRL ships its accelerate presets as package data (`trl/accelerate_configs/<name>.yaml`), as `trl grpo` reads them.
PRESET_PACKAGE = "trl.accelerate_configs"


def accelerate_presets() -> list[str]:
    return sorted(
        p.name[: -len(".yaml")] for p in resources.files(PRESET_PACKAGE).iterdir() if p.name.endswith(".yaml")
    )


def resolve_accelerate_config(launch_args: list[str]) -> list[str]:
    """`--accelerate_config NAME|FILE` in `launch_args` as accelerate's `--config_file PATH` (a file wins)."""
    if "--accelerate_config" not in launch_args:
        return launch_args
    index = launch_args.index("--accelerate_config")
    if index + 1 >= len(launch_args):
        raise CLIError(f"--accelerate_config needs a value: a preset ({', '.join(accelerate_presets())}) or a file.")
    value = launch_args[index + 1]
    if Path(value).is_file():
        path = value
    else:
        candidate = resources.files(PRESET_PACKAGE).joinpath(f"{value}.yaml")
        if not candidate.is_file():
            raise CLIError(
                f"--accelerate_config {value!r} is neither a file nor one of TRL's presets "
                f"({', '.join(accelerate_presets())}). Pass a preset name, or the path of an accelerate config file "
                "(`accelerate config --config_file my.yaml` writes one)."
            )
        path = str(candidate)
    return ["--config_file", path, *launch_args[:index], *launch_args[index + 2 :]]


def _subtract_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """`items` without the ordered `subsequence` (the options the parser left over, in their command-line order)."""
    rest, position = [], 0
    for item in items:
        if position < len(subsequence) and item == subsequence[position]:
            position += 1
        else:
            rest.append(item)
    return rest


def launch_arguments(remaining: list[str]) -> list[str]:
    """The options the training parser left over, checked as `accelerate launch` options."""
    from accelerate.commands.launch import launch_command_parser

    launch_args = resolve_accelerate_config(remaining)
    _, unknown = launch_command_parser().parse_known_args([*launch_args, "-m", "script"])
    if unknown:
        raise CLIError(
            f"unknown option(s) {' '.join(unknown)}: neither an option of this command (see --help) nor an "
            "`accelerate launch` option. Check the spelling; YAML keys in --config are options too."
        )
    return launch_args


def run_training_command(name: str, argv: list[str]) -> int:
    module_name, _ = TRAINING_COMMANDS[name]
    prog = f"dppo-trl {name}"
    module = importlib.import_module(module_name)
    try:
        run = module.parse(argv, return_remaining=True)
        launch_args = launch_arguments(run.config_remaining + run.cli_remaining)
        module.prepare(run)  # fails here, before any process starts or model loads
    except CLIError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    if "--mixed_precision" not in launch_args:
        # accelerate exports a config's `mixed_precision` (TRL's presets say bf16) and transformers reads it back
        # when bf16/fp16 are off, so a preset would silently override the run's own precision: the run's wins.
        args = run.training_args
        launch_args += ["--mixed_precision", "bf16" if args.bf16 else "fp16" if args.fp16 else "no"]
    script_args = _subtract_subsequence(argv, run.cli_remaining)
    from accelerate.commands.launch import launch_command, launch_command_parser

    accelerate_args = launch_command_parser().parse_args([*launch_args, "-m", module_name, *script_args])
    try:
        launch_command(accelerate_args)
    except subprocess.CalledProcessError as error:
        # The training processes printed their own error; accelerate's traceback would only bury it.
        return error.returncode or 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dppo-trl",
        description="DPPO for TRL, driven like `trl grpo`. Run `dppo-trl COMMAND --help` for a command's options.",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in TRAINING_COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    commands.add_parser("vllm-serve", help=VLLM_SERVE_HELP, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `dppo-trl` command (`argv` without the program name)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    parser = build_parser()
    args, _ = parser.parse_known_args(argv[:1])
    if args.command is None:
        parser.print_help()
        return 0 if not argv else 2
    rest = argv[1:]
    if args.command == "vllm-serve":
        from dppo_trl.cli.vllm_serve import main as vllm_serve

        return vllm_serve(rest)
    return run_training_command(args.command, rest)
