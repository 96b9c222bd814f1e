"""The `dppo-trl` console script launching several processes: `--accelerate_config multi_gpu --num_processes 2` on
CPU (two gloo ranks, transformers generation, flags only, a reward by import path), as short as the multi-process
tests. The server-mode runs (`dppo-trl vllm-serve` used by `train` and `train-async`, trackio read back) share the
asynchronous tests' server in tests/integration/test_async_server.py; the rest is in process in tests/unit/test_cli.py.
"""

from __future__ import annotations

import pytest
from cli_runs import DPPO_TRL, run_cli
from conftest import get_free_port

TINY_MODEL = "examples/tiny_math_model"
TINY_TRAIN = "examples/data/tiny_math/train.jsonl"

pytestmark = pytest.mark.slow


def test_two_processes_through_an_accelerate_preset(tmp_path):
    """TRL's multi_gpu preset with 2 processes: both ranks train; the preset's bf16 gives way to the run's fp32."""
    assert DPPO_TRL.endswith("dppo-trl")
    output = run_cli(
        tmp_path, "train", "--accelerate_config", "multi_gpu", "--num_processes", "2",
        "--main_process_port", str(get_free_port()), "--model_name_or_path", TINY_MODEL, "--dataset_name", TINY_TRAIN,
        "--reward_funcs", "dapo_math.rewards.accuracy_reward", "--use_vllm", "false", "--max_steps", "1",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
        "--logging_steps", "1", "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert "Training completed on 2 processes." in output and (tmp_path / "out" / "model.safetensors").exists()
