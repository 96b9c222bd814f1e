"""Launch checks (`dppo_trl.hardening.distributed`): launches accelerate would silently run as something else fail early.

The real launches these errors describe are exercised in `tests/system/test_multiprocess.py`; here the inputs are passed
explicitly so each case runs in one process.
"""

import pytest
from trainer_setup import ascii_reward, prompt_dataset

from dppo_dev.tiny_models import build_byte_tokenizer
from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.hardening.distributed import check_distributed_setup


def _config(tmp_path, **kwargs):
    return DPPOConfig(output_dir=str(tmp_path), report_to="none", **{"use_cpu": True, **kwargs})


def test_plain_launches_pass(tmp_path):
    config = _config(tmp_path)
    check_distributed_setup(config, environ={}, group_world_size=None)
    check_distributed_setup(config, environ={}, group_world_size=config.world_size)


def test_deepspeed_with_use_cpu_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"`use_cpu=True`.*plain DDP.*use_cpu=False.*ddp_backend='gloo'"):
        check_distributed_setup(_config(tmp_path), environ={"ACCELERATE_USE_DEEPSPEED": "true"})


def test_group_larger_than_accelerate_world_names_the_deepspeed_fix(tmp_path):
    config = _config(tmp_path, use_cpu=False, bf16=False)
    assert config.world_size == 1
    with pytest.raises(ValueError, match=r"2 processes but accelerate set up 1.*rather than `--deepspeed`"):
        check_distributed_setup(config, environ={"ACCELERATE_USE_DEEPSPEED": "true"}, group_world_size=2)
    with pytest.raises(ValueError, match=r"2 processes but accelerate set up 1.*Set `ddp_backend`"):
        check_distributed_setup(config, environ={}, group_world_size=2)


def test_fsdp_on_cpu_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"FSDP was requested on CPU.*silently run plain DDP"):
        check_distributed_setup(_config(tmp_path), environ={"ACCELERATE_USE_FSDP": "true"})


def test_trainer_runs_the_check_before_building_the_model(tmp_path, monkeypatch):
    config = _config(tmp_path)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="FSDP was requested on CPU"):
        DPPOTrainer(
            model="no/such-model-is-loaded",
            reward_funcs=ascii_reward,
            args=config,
            train_dataset=prompt_dataset(),
            processing_class=build_byte_tokenizer(),
        )
