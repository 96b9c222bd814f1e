"""Drop-in parity with GRPOTrainer: `environment_factory` datasets without `prompt`, `loss_type="luspo"`, the order of
the `use_liger_kernel` errors, and docs/api.md's supported/rejected table against the code."""

import dataclasses
import math
import re
from pathlib import Path

import pytest
from datasets import Dataset
from peft import LoraConfig
from trainer_setup import byte_mean_reward, changed_parameters, make_trainer, small_config, snapshot_trainable
from trl import GRPOConfig
from trl.chat_template_utils import qwen3_chat_template

from dppo_dev.tiny_models import build_byte_tokenizer
from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.trainers.config import SUPPORTED_LOSS_TYPES

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


# --- environment_factory without a `prompt` column ---------------------------------------------------------------
class ReachTarget:
    """A real TRL environment: `reset()` writes the task from the row's `level`, a tool, and the reward it owns."""

    resets: list[dict] = []

    def __init__(self):
        self.target = 0
        self.steps = 0

    def reset(self, **row) -> str:
        ReachTarget.resets.append(dict(row))
        self.target, self.steps = 3 * row["level"], 0
        return f"Reach {self.target} by adding."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.steps += 1
        return a + b

    def get_reward(self) -> float:
        return 1.0 / (1 + self.steps)


def _tool_tokenizer():
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = qwen3_chat_template  # renders tool calls; TRL adds its response parser
    return tokenizer


def test_environment_supplies_the_prompt(tiny_model_dir, tmp_path):
    ReachTarget.resets.clear()
    dataset = Dataset.from_dict({"level": list(range(8))})  # no `prompt` column
    trainer = DPPOTrainer(
        model=tiny_model_dir,
        reward_funcs=byte_mean_reward,
        args=small_config(tmp_path, max_steps=2),
        train_dataset=dataset,
        processing_class=_tool_tokenizer(),
        environment_factory=ReachTarget,
    )
    before = snapshot_trainable(trainer)
    trainer.train()
    assert {row["level"] for row in ReachTarget.resets} <= set(range(8)) and len(ReachTarget.resets) >= 8
    assert all(set(row) == {"level"} for row in ReachTarget.resets)
    assert any("Reach" in str(prompt) for prompt in trainer._logs["prompt"])  # reset()'s text reached the prompt
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert any("rewards/ReachTarget/mean" in e for e in trainer.state.log_history)
    assert changed_parameters(trainer, before)


def test_prompt_column_still_required_without_an_environment(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="train_dataset has no `prompt` column"):
        make_trainer(tiny_model_dir, tmp_path, dataset=Dataset.from_dict({"level": list(range(8))}))


def _config(tmp_path, **kwargs) -> DPPOConfig:
    return DPPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **kwargs)


# --- luspo --------------------------------------------------------------------------------------------------------
def test_luspo_is_the_token_level_seq_mean_token_sum(tmp_path):
    """Supported as TRL's loss code computes it for a per-token term (`tests/integration/test_loss_gradient.py` checks its gradient
    against eq. 11 aggregated as sum over tokens, mean over completions); GSPO's sequence level stays refused."""
    assert _config(tmp_path, loss_type="luspo").importance_sampling_level == "token"
    with pytest.raises(ValueError, match="loss_type='luspo' then aggregates .* seq-mean-token-sum"):
        _config(tmp_path, loss_type="luspo", importance_sampling_level="sequence")


# --- use_liger_kernel: TRL's errors first -------------------------------------------------------------------------
def test_liger_trl_lm_head_adapter_error_comes_first(tiny_model_dir, tmp_path):
    lora = LoraConfig(r=2, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="Applying a PEFT adapter to `lm_head` is not supported"):
        make_trainer(tiny_model_dir, tmp_path, peft_config=lora, use_liger_kernel=True)


def test_liger_trl_fused_cross_entropy_error_comes_first(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="fused_linear_cross_entropy.*is not supported"):
        make_trainer(
            tiny_model_dir,
            tmp_path,
            use_liger_kernel=True,
            liger_kernel_config={"fused_linear_cross_entropy": True},
        )


# --- docs/api.md's table ------------------------------------------------------------------------------------------
def _combinations_table() -> dict[str, str]:
    # DPPOTrainer's table: the section up to the next heading (AsyncDPPOTrainer's own table follows under `###`).
    text = API_DOC.read_text(encoding="utf-8").split("## Supported combinations", 1)[1].split("\n#", 1)[0]
    rows = [line.split(" | ", 1) for line in text.splitlines() if line.startswith("| ") and " | " in line]
    return {option.lstrip("| ").strip(): status for option, status in rows}


def _trl_loss_types() -> set[str]:
    help_text = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type").metadata["help"]
    return set(re.findall(r"'(\w+)'", help_text.split("Supported values are", 1)[1].split(".", 1)[0]))


def test_api_table_matches_the_loss_types_the_code_accepts(tmp_path):
    table = _combinations_table()
    supported = next(k for k in table if k.startswith("`loss_type` `dapo`"))
    rejected = next(k for k in table if k.startswith("`loss_type`") and table[k].startswith("rejected"))
    assert set(re.findall(r"`(\w+)`", supported)) - {"loss_type"} == set(SUPPORTED_LOSS_TYPES)
    assert set(re.findall(r"`(\w+)`", rejected)) - {"loss_type"} == _trl_loss_types() - set(SUPPORTED_LOSS_TYPES)
    for loss_type in SUPPORTED_LOSS_TYPES:
        _config(tmp_path, loss_type=loss_type)
    for loss_type in _trl_loss_types() - set(SUPPORTED_LOSS_TYPES):
        with pytest.raises(ValueError, match=f"loss_type={loss_type!r} is its own trust region"):
            _config(tmp_path, loss_type=loss_type)


def test_api_table_states_the_liger_and_environment_rules():
    table = _combinations_table()
    assert "refused by `DPPOTrainer(...)` when the trainer's device is not CUDA" in table["`use_liger_kernel=True`"]
    assert '`liger_kernel_config={"swiglu": False}`' in table["`use_liger_kernel=True`"]
    assert "with `use_liger_kernel=True` too" in table["MoE router aux loss (`output_router_logits`)"]
    assert "may omit `prompt`" in table["tools / `environment_factory`"]
