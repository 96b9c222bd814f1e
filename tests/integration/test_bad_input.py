"""Each bad input fails before any model load or engine start, with a message naming the option and the fix.

Trainer inputs (`dppo_trl/hardening/inputs.py`, run in `DPPOTrainer.__init__` before `GRPOTrainer.__init__`) and the example's
own checks (`examples/dapo_math/preflight.py`, run at the top of `main()`).
"""

import functools
import os

import pytest
from datasets import Dataset
from trainer_setup import ascii_reward, make_trainer, prompt_dataset, small_config

from dppo_dev.tiny_models import build_byte_tokenizer
from dppo_trl import DPPOTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything reaches GRPOTrainer.__init__ (the model load and engine start)."""
    _replace_grpo_init(monkeypatch, AssertionError("GRPOTrainer.__init__ was reached: the check ran too late"))


def _replace_grpo_init(monkeypatch, error: Exception, seen: dict | None = None) -> None:
    """GRPOTrainer.__init__ (which loads the model, then the tokenizer, then starts vLLM) replaced by a raise; it keeps
    its signature, which DPPOTrainer binds its arguments to."""
    from trl import GRPOTrainer

    @functools.wraps(GRPOTrainer.__init__)
    def replaced(self, *args, **kwargs):
        if seen is not None:
            seen.update(kwargs)
        raise error

    monkeypatch.setattr(GRPOTrainer, "__init__", replaced)


# --- DPPOTrainer inputs ------------------------------------------------------------------------------------------
TRAINER_CASES = {
    # name: (trainer kwargs, expected error text)
    "max_completion_length_0": (
        dict(max_completion_length=0),
        r"max_completion_length=0: .*Set max_completion_length",
    ),
    "empty_dataset": (
        dict(dataset=Dataset.from_dict({"prompt": []})),
        r"train_dataset is empty, fewer than one generation batch: each generation draws 1 distinct prompts",
    ),
    "smaller_than_a_generation_batch": (
        # 16 prompts x 8 samples per generation (the example's CPU default), 15 problems.
        dict(dataset=Dataset.from_dict({"prompt": ["1+1="] * 15}), per_device_train_batch_size=128, num_generations=8),
        r"train_dataset has 15 prompts, .*each generation draws 16 distinct prompts .*Provide at least 16 prompts",
    ),
    "no_prompt_column": (
        dict(dataset=Dataset.from_dict({"question": ["1+1="] * 8, "answer": ["2"] * 8})),
        r"train_dataset has no `prompt` column \(columns found: \['answer', 'question'\]\)\. .*rename",
    ),
    "eval_without_prompt_column": (
        dict(eval_dataset=Dataset.from_dict({"text": ["1+1="] * 4})),
        r"eval_dataset has no `prompt` column \(columns found: \['text'\]\)",
    ),
}


@pytest.mark.parametrize("case", sorted(TRAINER_CASES))
def test_trainer_input_errors(tiny_model_dir, tmp_path, no_model_load, case):
    kwargs, message = TRAINER_CASES[case]
    with pytest.raises(ValueError, match=message):
        make_trainer(tiny_model_dir, tmp_path, **kwargs)


def test_conversational_prompts_need_a_chat_template(tiny_model_dir, tmp_path, no_model_load):
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"prompts are conversations .* has no chat template.*processing_class"):
        _dppo_trainer(tiny_model_dir, tmp_path, conversational=True, processing_class=tokenizer)


@pytest.mark.parametrize("conversational", [False, True])
def test_processing_class_given_as_a_path(tiny_model_dir, tmp_path, no_model_load, conversational):
    """A path is refused as what it is (not as a tokenizer without a chat template), before the model loads."""
    with pytest.raises(TypeError, match=r"processing_class=.* is a path, .*AutoTokenizer.from_pretrained"):
        _dppo_trainer(tiny_model_dir, tmp_path, conversational=conversational, processing_class=tiny_model_dir)


def test_chat_template_is_checked_on_the_tokenizer_trl_would_load(tmp_path, no_model_load):
    """No `processing_class`: the tokenizer saved with the model is loaded (as TRL would) and checked, before the
    model."""
    from dppo_dev.tiny_models import build_tiny_model

    model, tokenizer = build_tiny_model(kind="qwen3")
    tokenizer.chat_template = None
    model_dir = str(tmp_path / "model")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with pytest.raises(ValueError, match="has no chat template"):
        _dppo_trainer(model_dir, tmp_path / "out", conversational=True)


def _dppo_trainer(model, output_dir, *, conversational: bool, **kwargs) -> DPPOTrainer:
    return DPPOTrainer(
        model=model,
        reward_funcs=ascii_reward,
        args=small_config(output_dir),
        train_dataset=prompt_dataset(conversational=conversational),
        **kwargs,
    )


def test_good_inputs_reach_grpo_init_as_given(tiny_model_dir, tmp_path, monkeypatch):
    """Conversational prompts and no `processing_class`: the template is checked, and GRPOTrainer still loads its own
    tokenizer (with its own arguments)."""
    seen = {}
    _replace_grpo_init(monkeypatch, RuntimeError("stop"), seen)
    with pytest.raises(RuntimeError, match="stop"):
        DPPOTrainer(
            model=tiny_model_dir,
            reward_funcs=ascii_reward,
            args=small_config(tmp_path),
            train_dataset=prompt_dataset(conversational=True),
        )
    assert seen.get("processing_class") is None


# --- the example script -------------------------------------------------------------------------------------------


@pytest.fixture
def nothing_loads(monkeypatch, example):
    """Fail the test if the example gets as far as loading data or building the trainer."""

    def refuse(*args, **kwargs):
        raise AssertionError("the example loaded data or built the trainer: the check ran too late")

    monkeypatch.setattr(example, "load_dapo_math", refuse)
    monkeypatch.setattr(example, "DPPOTrainer", refuse)


def _run(example, argv):
    example.main(*example.parse_args(argv))


def test_missing_local_model_path(example, nothing_loads, tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=r"--model_name_or_path '.*no-such-model' does not exist: no such local"):
        _run(example, ["--model_name_or_path", missing, "--output_dir", str(tmp_path / "out")])
    # Relative paths too, and before the "--dataset_name is required" message.
    with pytest.raises(ValueError, match=r"--model_name_or_path './models/qwen' does not exist"):
        _run(example, ["--model_name_or_path", "./models/qwen", "--output_dir", str(tmp_path / "out")])


def test_hub_model_id_not_in_the_offline_cache(example, nothing_loads, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ValueError, match=r"'nobody/no-such-model' is not a local path, so it is read as a Hub model"):
        _run(example, ["--model_name_or_path", "nobody/no-such-model", "--output_dir", str(tmp_path / "out")])


def test_missing_and_empty_data_files(example, nothing_loads, tmp_path):
    out = ["--output_dir", str(tmp_path / "out")]
    with pytest.raises(ValueError, match=r"--dataset_name '.*missing.jsonl' does not exist"):
        _run(example, ["--dataset_name", str(tmp_path / "missing.jsonl")] + out)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"--dataset_name '.*empty.jsonl' is empty: it holds no rows"):
        _run(example, ["--dataset_name", str(empty)] + out)
    with pytest.raises(ValueError, match=r"--math_eval_datasets '.*nope.jsonl' does not exist"):
        _run(example, ["--math_eval_datasets", f"x={tmp_path / 'nope.jsonl'}"] + out)


def test_example_max_completion_length_0(example, nothing_loads, tmp_path):
    with pytest.raises(ValueError, match=r"max_completion_length=0: completions need at least one token"):
        _run(example, ["--max_completion_length", "0", "--output_dir", str(tmp_path)])


def test_example_dataset_smaller_than_a_generation_batch(example, tmp_path, monkeypatch):
    """One problem fewer than the CPU default draws per generation batch: refused before the model loads."""
    _replace_grpo_init(monkeypatch, AssertionError("GRPOTrainer.__init__ was reached: the check ran too late"))
    defaults = example.TINY_RUN_DEFAULTS
    per_generation = (
        defaults["per_device_train_batch_size"] * defaults["steps_per_generation"] // defaults["num_generations"]
    )
    lines = open(os.path.join(ROOT, "examples", "data", "tiny_math", "train.jsonl")).readlines()[: per_generation - 1]
    data = tmp_path / "small.jsonl"
    data.write_text("".join(lines))
    argv = ["--dataset_name", str(data), "--output_dir", str(tmp_path / "out"), "--math_eval_datasets", "none"]
    expected = rf"train_dataset has {per_generation - 1} prompts, .*at least {per_generation} prompts"
    with pytest.raises(ValueError, match=expected):
        _run(example, argv)


# --- output folder and resume (examples/dapo_math/preflight.py) ----------------------------------------------------
def _previous_run(out, steps=(2, 4), incomplete=(6,)):
    os.makedirs(out, exist_ok=True)
    for step in steps:
        os.makedirs(out / f"checkpoint-{step}")
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    for step in incomplete:
        os.makedirs(out / f"_incomplete-checkpoint-{step}" / f"checkpoint-{step}")
    (out / "model.safetensors").write_bytes(b"x")
    (out / "training_curves.png").write_bytes(b"x")


def test_output_dir_with_a_previous_run_is_refused(example, nothing_loads, tmp_path):
    out = tmp_path / "run"
    _previous_run(out)
    with pytest.raises(
        ValueError, match=r"already holds a previous run \(checkpoint-2, checkpoint-4, .*model.safetensors"
    ):
        _run(example, ["--output_dir", str(out)])
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint latest to continue it, or --overwrite_output_dir"):
        _run(example, ["--output_dir", str(out)])


def test_overwrite_output_dir_clears_the_previous_run(example, tmp_path):
    from dapo_math.preflight import prepare_output_dir

    out = tmp_path / "run"
    _previous_run(out)
    script_args, training_args, _ = example.parse_args(["--output_dir", str(out), "--overwrite_output_dir"])
    prepare_output_dir(script_args, training_args)
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # overwritten by the run's own save
    assert training_args.resume_from_checkpoint is None


@pytest.mark.parametrize("value", ["true", "True", "latest"])
def test_resume_latest_picks_the_newest_complete_checkpoint(example, tmp_path, capsys, value):
    from dapo_math.preflight import prepare_output_dir

    out = tmp_path / "run"
    _previous_run(out, steps=(2, 4), incomplete=(6,))
    os.makedirs(out / "checkpoint-8")  # written in place and cut short: no trainer_state.json
    script_args, training_args, _ = example.parse_args(["--output_dir", str(out), "--resume_from_checkpoint", value])
    prepare_output_dir(script_args, training_args)
    assert training_args.resume_from_checkpoint == str(out / "checkpoint-4")
    printed = capsys.readouterr().out
    assert "Skipping incomplete checkpoints (interrupted saves): _incomplete-checkpoint-6, checkpoint-8" in printed


def test_resume_errors(example, nothing_loads, tmp_path):
    out = tmp_path / "run"
    _previous_run(out, steps=(), incomplete=(6,))
    with pytest.raises(
        ValueError, match=r"holds no complete checkpoint \(incomplete, skipped: _incomplete-checkpoint-6"
    ):
        _run(example, ["--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint '.*checkpoint-9' is not a folder"):
        _run(example, ["--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-9")])
    os.makedirs(out / "checkpoint-7")
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint '.*checkpoint-7' is incomplete"):
        _run(example, ["--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-7")])
