"""`dppo_trl.backends.tree_attention`: a tree attention registered under TRL's name for a block only (and the float32
reference through `cpu_tree_attention`), and the choice `AsyncDPPOConfig.tree_attention` makes, "auto" falling back
when TRL's FA3 kernel cannot load. The kernels themselves are tested in tests/unit/test_tree_attention.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dppo_trl.backends.tree_attention import (
    FA3_FIX,
    TREE_ATTENTION_CHOICES,
    registered_tree_attention,
    resolve_tree_attention,
)
from dppo_trl.kernels.tree_attention import tree_attention_cpu, tree_attention_sdpa


def test_registration_is_scoped_and_restores_trls():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention, tree_attention

    register_tree_attention()
    trl_mask = AttentionMaskInterface._global_mapping[TREE_ATTENTION]
    with registered_tree_attention(tree_attention_sdpa):
        assert AttentionInterface._global_mapping[TREE_ATTENTION] is tree_attention_sdpa
        assert AttentionMaskInterface._global_mapping[TREE_ATTENTION](x=1) is None
    assert AttentionInterface._global_mapping[TREE_ATTENTION] is tree_attention
    assert AttentionMaskInterface._global_mapping[TREE_ATTENTION] is trl_mask


def test_cpu_tree_attention_is_scoped():
    from transformers import AttentionInterface
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention, tree_attention

    from dppo_trl.backends.cpu.async_cpu import cpu_tree_attention

    register_tree_attention()
    with cpu_tree_attention():
        assert AttentionInterface._global_mapping[TREE_ATTENTION] is tree_attention_cpu
    assert AttentionInterface._global_mapping[TREE_ATTENTION] is tree_attention


# ---------------------------------------------------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------------------------------------------------


def test_explicit_choices_and_cpu():
    cpu = torch.device("cpu")
    assert resolve_tree_attention("sdpa", cpu).function is tree_attention_sdpa
    assert resolve_tree_attention("eager", cpu).function is tree_attention_cpu
    auto = resolve_tree_attention("auto", cpu)
    assert (auto.name, auto.function) == ("sdpa", tree_attention_sdpa)
    assert "needs a CUDA device" in auto.reason
    with pytest.raises(RuntimeError, match="tree_attention='fa3' cannot run: FlashAttention-3 needs a CUDA device"):
        resolve_tree_attention("fa3", cpu)
    with pytest.raises(ValueError, match="tree_attention must be one of"):
        resolve_tree_attention("flash", cpu)
    assert set(TREE_ATTENTION_CHOICES) == {"auto", "fa3", "sdpa", "eager"}


# Run in a fresh process: TRL caches its kernel once loaded, and the Hub settings are read at import time.
_RESOLVE_ON_CUDA = """
import json, torch
from dppo_trl.backends.tree_attention import resolve_tree_attention
auto = resolve_tree_attention("auto", torch.device("cuda"))
try:
    resolve_tree_attention("fa3", torch.device("cuda"))
    fa3 = None
except RuntimeError as error:
    fa3 = str(error)
print(json.dumps({"name": auto.name, "reason": auto.reason, "fa3_error": fa3}))
"""


def test_auto_falls_back_when_trls_kernel_cannot_load(tmp_path):
    """On a CUDA device "auto" goes through TRL's real loader (`packing._flash_attn`: `kernels.get_kernel`, the Hub);
    with the Hub offline and empty caches (or `kernels` not installed, as here) it cannot load, so "auto" falls back to
    SDPA saying why, and an explicit "fa3" is refused naming the fix. Nothing touches the GPU before the kernel loads,
    so this runs on CPU-only machines too."""
    empty = tmp_path / "empty-cache"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(empty),
        "HF_HUB_CACHE": str(empty / "hub"),
        "HF_KERNELS_CACHE": str(empty / "kernels"),
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _RESOLVE_ON_CUDA], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["name"] == "sdpa"
    assert result["reason"].startswith("loading kernels-community/flash-attn3 failed ("), result["reason"]
    assert result["fa3_error"].startswith("tree_attention='fa3' cannot run: loading kernels-community/flash-attn3")
    assert FA3_FIX in result["fa3_error"]


def test_config_refuses_an_unknown_choice(tmp_path):
    from dppo_trl import AsyncDPPOConfig

    assert AsyncDPPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none").tree_attention == "auto"
    with pytest.raises(ValueError, match="tree_attention must be one of"):
        AsyncDPPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", tree_attention="flash")
