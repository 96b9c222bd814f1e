"""The `dppo-trl` command in process: help, parsing (recipes, demo, env block, PEFT flags), rewards, presets, the
launch it hands to accelerate, the CPU server command, and each bad input failing before anything launches or loads.

The runs themselves are in tests/system/test_cli_accelerate.py (2 accelerate processes) and at the end of
tests/integration/test_async_server.py (`train` and `train-async` against `dppo-trl vllm-serve`, trackio read back).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dppo_trl.cli import main as cli_main
from dppo_trl.cli import train, train_async
from dppo_trl.cli.main import accelerate_presets, resolve_accelerate_config
from dppo_trl.cli.options import CLIError

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = str(ROOT / "examples" / "tiny_math_model")
TINY_TRAIN = str(ROOT / "examples" / "data" / "tiny_math" / "train.jsonl")
TINY_RECIPE = str(ROOT / "examples" / "recipes" / "tiny_math_cpu.yaml")
ASYNC_RECIPE = str(ROOT / "examples" / "recipes" / "async" / "qwen3_1.7b_base_dapo_math_async.yaml")
REWARD = "dapo_math.rewards.accuracy_reward"


@pytest.fixture
def nothing_launches(monkeypatch):
    """Fail the test if the command launches processes or loads a model."""
    import accelerate.commands.launch as launch
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("launched or loaded although the input is bad")

    monkeypatch.setattr(launch, "launch_command", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.fixture
def launches(monkeypatch):
    """Record the accelerate arguments instead of launching."""
    import accelerate.commands.launch as launch

    seen = []
    monkeypatch.setattr(launch, "launch_command", seen.append)
    return seen


def _flags(tmp_path, *extra: str) -> list[str]:
    return ["--model_name_or_path", TINY_MODEL, "--dataset_name", TINY_TRAIN, "--reward_funcs", REWARD,
            "--output_dir", str(tmp_path / "out"), *extra]  # fmt: skip


# --- help ------------------------------------------------------------------------------------------------------------
def test_top_level_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("train", "train-async", "vllm-serve"))
    assert cli_main([]) == 0


@pytest.mark.parametrize(
    "command, options",
    [
        ("train", ["--reward_funcs", "--lora_r", "--use_peft", "--divergence", "--math_eval_datasets", "--datasets"]),
        ("train-async", ["--reward_funcs", "--start_server", "--max_staleness", "--lora_r", "--vllm_server_base_url"]),
        ("vllm-serve", ["--model", "--max_model_len", "--data_parallel_size", "--gpu_memory_utilization"]),
    ],
)
def test_each_command_has_help(capsys, command, options):
    with pytest.raises(SystemExit) as exit_info:
        cli_main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"dppo-trl {command}" in out
    assert all(option in out for option in options), [o for o in options if o not in out]


# --- parsing ---------------------------------------------------------------------------------------------------------
def test_no_arguments_is_the_bundled_demo_spelled_out_by_the_tiny_recipe():
    """`dppo-trl train` alone and `--config examples/recipes/tiny_math_cpu.yaml` configure the same run."""
    demo = train.parse([])
    recipe = train.parse(["--config", TINY_RECIPE])
    assert demo.demo is not None and recipe.demo is None
    keys = ("learning_rate", "max_steps", "per_device_train_batch_size", "steps_per_generation", "num_generations",
            "max_completion_length", "use_vllm", "vllm_mode", "vllm_cpu_dtype", "use_cpu", "bf16", "seed")  # fmt: skip
    for key in keys:
        assert getattr(demo.training_args, key) == getattr(recipe.training_args, key), key
    assert Path(demo.model_args.model_name_or_path).resolve() == Path(TINY_MODEL).resolve()
    assert Path(recipe.model_args.model_name_or_path).resolve() == Path(TINY_MODEL).resolve()
    # The DAPO-Math recipe takes part in both (its options are set): math rewards, format weighted 0.5.
    for run in (demo, recipe):
        assert [r.name for r, _ in run.recipes] == ["dapo_math"]
        rewards = train.default_rewards(run)
        assert [f.__name__ for f in rewards] == ["accuracy_reward", "format_reward"]
        assert run.training_args.reward_weights == [1.0, 0.5]


def test_flags_only_run_uses_no_recipe_and_cli_wins_over_yaml(tmp_path):
    run = train.parse(_flags(tmp_path, "--learning_rate", "0.01", "--use_peft", "--lora_r", "4"))
    assert run.recipes == [] and run.demo is None
    assert run.training_args.learning_rate == 0.01
    assert (run.model_args.use_peft, run.model_args.lora_r) == (True, 4)
    assert train.default_rewards(run) is None
    config = tmp_path / "recipe.yaml"
    config.write_text("learning_rate: 0.5\nmax_steps: 3\nenv:\n  DPPO_CLI_TEST_ENV: from-yaml\n")
    os.environ.pop("DPPO_CLI_TEST_ENV", None)
    try:
        run = train.parse(["--config", str(config), *_flags(tmp_path, "--learning_rate", "0.25")])
        assert (run.training_args.learning_rate, run.training_args.max_steps) == (0.25, 3)
        assert os.environ["DPPO_CLI_TEST_ENV"] == "from-yaml"  # TRL's `env:` block
    finally:
        os.environ.pop("DPPO_CLI_TEST_ENV", None)


def test_async_gpu_recipe_parses_with_its_rewards(tmp_path):
    run = train_async.parse(["--config", ASYNC_RECIPE, "--output_dir", str(tmp_path), "--bf16", "false"])
    assert (run.training_args.divergence, run.training_args.max_staleness) == ("binary_tv", 4)
    assert run.script_args.start_server is False and not train_async.starts_server(run)
    assert run.script_args.reward_funcs == ["dapo_math.rewards.accuracy_reward", "dapo_math.rewards.format_reward"]


def test_async_demo_is_the_async_example_run():
    from dapo_math.demo import TINY_ASYNC_RUN_DEFAULTS

    run = train_async.parse([])
    for key, value in TINY_ASYNC_RUN_DEFAULTS.items():
        assert getattr(run.training_args, key) == ([] if key == "report_to" else value), key  # "none" parses as []
    assert [f.__name__ for f in train.default_rewards(run)] == ["accuracy_reward", "format_reward"]
    assert train_async.starts_server(run)  # on CPU, with no --vllm_server_base_url


# --- rewards ---------------------------------------------------------------------------------------------------------
def test_rewards_by_trl_name_and_by_import_path(tmp_path, monkeypatch):
    import trl.rewards

    from dapo_math.rewards import accuracy_reward
    from dppo_trl.cli.inputs import resolve_reward_func

    assert resolve_reward_func("accuracy_reward") is trl.rewards.accuracy_reward
    assert resolve_reward_func(REWARD) is accuracy_reward
    # A rewards file in the current folder imports by its name, as with `trl grpo`; sys.path is left as it was.
    (tmp_path / "my_cli_rewards.py").write_text(
        "def length(completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    before = list(os.sys.path)
    assert resolve_reward_func("my_cli_rewards.length").__name__ == "length"
    assert os.sys.path == before


# --- presets and the launch ------------------------------------------------------------------------------------------
def test_trl_presets_and_files(tmp_path):
    assert {"single_gpu", "multi_gpu", "zero1", "zero2", "zero3", "fsdp1", "fsdp2"} <= set(accelerate_presets())
    args = resolve_accelerate_config(["--accelerate_config", "zero3", "--num_processes", "2"])
    assert args[0] == "--config_file" and args[1].endswith(os.path.join("trl", "accelerate_configs", "zero3.yaml"))
    assert args[2:] == ["--num_processes", "2"]
    own = tmp_path / "acc.yaml"
    own.write_text("distributed_type: 'NO'\n")
    assert resolve_accelerate_config(["--accelerate_config", str(own)]) == ["--config_file", str(own)]


def test_launch_hands_accelerate_its_options_and_the_script_the_rest(tmp_path, launches):
    argv = ["--accelerate_config", "multi_gpu", "--num_processes", "2", "--main_process_port", "35001",
            *_flags(tmp_path, "--max_steps", "1")]  # fmt: skip
    assert cli_main(["train", *argv]) == 0
    (args,) = launches
    assert args.config_file.endswith("multi_gpu.yaml") and args.num_processes == 2 and args.main_process_port == 35001
    assert args.mixed_precision == "no"  # the run's fp32 (CPU default), not the preset's bf16
    assert args.module and args.training_script == "dppo_trl.cli.train"
    assert args.training_script_args == _flags(tmp_path, "--max_steps", "1")


# --- bad input: fails before anything launches or loads, naming the fix ----------------------------------------------
BAD_INPUTS = {
    "missing reward module": (["--reward_funcs", "no_such_pkg.rewards.accuracy"], "cannot import the module"),
    "missing reward function": (["--reward_funcs", "dapo_math.rewards.no_such_reward"], "has no 'no_such_reward'"),
    "bare unknown reward": (["--reward_funcs", "accuracy"], "neither a bundled reward"),
    "unknown preset": (["--accelerate_config", "zero4"], "neither a file nor one of TRL's presets (fsdp1, fsdp2"),
    "unknown option": (["--learnin_rate", "0.1"], "unknown option(s) --learnin_rate"),
    "missing model path": (["--model_name_or_path", "./no/such/model"], "does not exist"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_before_launch(tmp_path, capsys, nothing_launches, case):
    extra, message = BAD_INPUTS[case]
    assert cli_main(["train", *_flags(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dppo-trl train: error: ") and message in err, err


def test_dataset_without_prompt_column(tmp_path, capsys, nothing_launches):
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    assert cli_main(["train-async", *_flags(tmp_path, "--dataset_name", str(data))]) == 2
    err = capsys.readouterr().err
    assert "no `prompt` column (columns: question, answer)" in err and "rename_column" in err, err


def test_pip_install_without_the_demo_says_what_is_missing(tmp_path, capsys, nothing_launches, monkeypatch):
    import dppo_trl.cli.options as options

    monkeypatch.setattr(options, "installed_recipes", lambda: [])  # what a wheel alone has
    assert cli_main(["train", "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no bundled demo is installed" in err and "--model_name_or_path" in err, err
    # The math recipe's options are unknown then: named as such, not passed on to accelerate.
    assert cli_main(["train", "--config", TINY_RECIPE, "--output_dir", str(tmp_path)]) == 2
    assert "unknown option(s) --math_eval_datasets" in capsys.readouterr().err


def test_previous_run_is_not_overwritten(tmp_path, capsys, nothing_launches):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("x")
    assert cli_main(["train", *_flags(tmp_path)]) == 2
    assert "--overwrite_output_dir" in capsys.readouterr().err


def test_recipe_errors_are_raised_as_cli_errors():
    assert issubclass(CLIError, ValueError)  # callers that catch ValueError (the examples' tests) still do


# --- vllm-serve ------------------------------------------------------------------------------------------------------
def test_vllm_serve_on_cpu_starts_the_cpu_server_with_trls_flags(capsys):
    argv = ["--model", TINY_MODEL, "--port", "35002", "--max_model_len", "512", "--dtype", "bfloat16",
            "--no-enable-chunked-prefill", "--dry-run"]  # fmt: skip
    assert cli_main(["vllm-serve", *argv]) == 0
    command = capsys.readouterr().out.split()
    assert "vllm.entrypoints.openai.api_server" in command
    assert command[command.index("--host") + 1] == "127.0.0.1"  # not TRL's 0.0.0.0: the dev endpoints stay local
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert command[command.index("--max-model-len") + 1] == "512"
    assert command[command.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert "--no-enable-chunked-prefill" in command and "--dry-run" not in command


def test_vllm_serve_refuses_a_gpu_only_option_on_cpu(capsys):
    assert cli_main(["vllm-serve", "--model", TINY_MODEL, "--gpu_memory_utilization", "0.5", "--dry-run"]) == 2
    assert "--kv-cache-memory-bytes" in capsys.readouterr().err


def test_vllm_serve_on_gpu_is_trls(monkeypatch):
    import trl.scripts.vllm_serve as trl_vllm_serve

    import dppo_trl.backends.cpu.platform as platform

    seen = []
    monkeypatch.setattr(platform, "is_vllm_cpu_platform", lambda: False)
    monkeypatch.setattr(trl_vllm_serve, "main", lambda args, extra: seen.append((args, extra)))
    assert cli_main(["vllm-serve", "--model", "Qwen/Qwen3-0.6B", "--data_parallel_size", "8", "--foo", "1"]) == 0
    ((args, extra),) = seen
    assert (args.model, args.data_parallel_size, extra) == ("Qwen/Qwen3-0.6B", 8, ["--foo", "1"])


def test_train_async_refuses_a_server_serving_another_model(tmp_path, capsys, nothing_launches, monkeypatch):
    """TRL's rollout worker asks the server for the model by name; a mismatch is named before anything starts."""
    import requests

    class Served:
        status_code = 200

        def json(self):
            return {"data": [{"id": "/elsewhere/tiny_math_model"}]}

    monkeypatch.setattr(requests, "get", lambda url, **kwargs: Served())
    argv = _flags(tmp_path, "--vllm_server_base_url", "http://127.0.0.1:35003")
    assert cli_main(["train-async", *argv]) == 2
    err = capsys.readouterr().err
    assert "serves '/elsewhere/tiny_math_model', not --model_name_or_path" in err and "vllm-serve --model" in err, err


@pytest.mark.parametrize("command", [train, train_async])
def test_flags_only_prepares_model_data_and_reward(tmp_path, nothing_launches, command):
    """What both commands check and load before a model, from flags alone (the runs: tests/system, integration)."""
    from dapo_math.rewards import accuracy_reward

    extra = ["--vllm_server_base_url", "http://127.0.0.1:1"] if command is train_async else []  # never reached
    prepared = command.prepare(command.parse(_flags(tmp_path, "--max_train_samples", "10", *extra)))
    assert prepared.reward_funcs == [accuracy_reward]
    assert len(prepared.train_dataset) == 10 and "prompt" in prepared.train_dataset.column_names
