"""DPPOConfig / DPPOTrainer validation: every rejected combination fails at construction and names the fix."""

import math
import warnings

import pytest
from trainer_setup import ascii_reward, prompt_dataset, small_config
from trl import GRPOConfig

from dppo_trl import DPPOConfig, DPPOTrainer


def _config(tmp_path, **kwargs):
    return DPPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


def test_defaults_are_the_authors(tmp_path):
    tv = _config(tmp_path)
    assert (tv.divergence, tv.delta_low, tv.delta_high) == ("binary_tv", 0.15, 0.15)
    kl = _config(tmp_path, divergence="topk_kl")
    assert (kl.delta_low, kl.delta_high, kl.divergence_top_k) == (0.05, 0.05, 20)
    assert tv.ratio_cap == 20.0 and tv.anchor == "behavior"
    assert tv.vllm_importance_sampling_correction is False
    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True).vllm_importance_sampling_correction is True


def test_explicit_deltas_are_kept(tmp_path):
    config = _config(tmp_path, divergence="binary_kl", delta_low=0.2, delta_high=0.1)
    assert (config.delta_low, config.delta_high) == (0.2, 0.1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"divergence": "full_tv"}, "divergence='full_tv' is not supported"),
        ({"delta_low": 0.0}, "delta_low must be a finite number > 0"),
        ({"delta_high": math.inf}, "delta_high must be a finite number > 0"),
        ({"ratio_cap": math.inf}, "ratio_cap must be finite and ≥ 1"),
        ({"ratio_cap": 0.5}, "ratio_cap must be finite and ≥ 1"),
        ({"anchor": "old"}, "anchor='old' is not supported"),
        ({"divergence": "topk_tv", "divergence_top_k": 0}, "divergence_top_k must be ≥ 1"),
        (
            {"divergence": "topk_tv", "divergence_top_k": 21, "use_vllm": True, "vllm_mode": "colocate"},
            "exceeds vLLM's `max_logprobs` (20)",
        ),
        ({"loss_type": "cispo"}, "loss_type='cispo' is its own trust region"),
        ({"loss_type": "sapo"}, "loss_type='sapo' is its own trust region"),
        ({"loss_type": "vespo"}, "loss_type='vespo' is its own trust region"),
        ({"importance_sampling_level": "sequence"}, "importance_sampling_level='sequence' (GSPO) is not supported"),
        ({"delta": 2.0}, "delta=2.0 (GRPO's two-sided ratio clip) is not used by DPPO"),
        ({"epsilon_high": 0.28}, "epsilon_high is GRPO's ratio clip"),
        ({"vllm_importance_sampling_correction": True}, "would correct the train–inference mismatch twice"),
    ],
)
def test_rejected_configs(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as err:
        _config(tmp_path, **kwargs)
    assert message in str(err.value)


def test_topk_in_server_mode_may_exceed_colocate_cap(tmp_path):
    config = _config(tmp_path, divergence="topk_tv", divergence_top_k=64, use_vllm=True, vllm_mode="server")
    assert config.divergence_top_k == 64


def test_recompute_anchor_warns_and_may_use_trl_importance_sampling(tmp_path):
    with pytest.warns(UserWarning, match="anchor='recompute' .* is an ablation"):
        config = _config(tmp_path, anchor="recompute", vllm_importance_sampling_correction=True)
    assert config.anchor == "recompute"


@pytest.mark.parametrize(
    "kwargs",
    [{"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}, {"top_p": 0.9, "use_vllm": False}],
    ids=["top_p", "top_k", "min_p", "transformers"],
)
def test_truncated_sampling_is_supported_without_a_warning(tmp_path, kwargs):
    # vLLM: π is compared over the engine's kept set (tests/integration/test_truncated_sampling.py); transformers generation:
    # μ is the trainer's own full softmax. Neither biases π/μ, so neither warns.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _config(tmp_path, **{"use_vllm": True, **kwargs})


def test_default_sampling_does_not_warn(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _config(tmp_path)


def test_trainer_requires_a_dppo_config(tiny_model_dir, tmp_path):
    with pytest.raises(TypeError, match="DPPOTrainer needs a DPPOConfig"):
        DPPOTrainer(
            model=tiny_model_dir,
            reward_funcs=ascii_reward,
            args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
            train_dataset=prompt_dataset(),
        )


def test_topk_rejects_rollout_func(tiny_model_dir, tmp_path):
    """A `rollout_func` returns sampled-token log-probs only: μ's top-K does not exist. (Top-K with tools is supported:
    tests/integration/test_agents_vllm.py.)"""
    with pytest.raises(ValueError, match="divergence='topk_tv' .*rollout_func"):
        DPPOTrainer(
            model=tiny_model_dir,
            reward_funcs=ascii_reward,
            args=small_config(tmp_path, divergence="topk_tv"),
            train_dataset=prompt_dataset(),
            rollout_func=lambda prompts, trainer: {},
        )


def test_truncated_sampling_rejects_rollout_func(tiny_model_dir, tmp_path):
    """Refused before the model or the engine is built, naming the fix. (Truncated sampling with tools is supported:
    tests/integration/test_agents_vllm.py.)"""
    with pytest.raises(ValueError, match="with a `rollout_func`.*top_k=0, top_p=1.0, min_p=0.0"):
        DPPOTrainer(
            model=tiny_model_dir,
            reward_funcs=ascii_reward,
            args=small_config(tmp_path, top_p=0.9, use_vllm=True, vllm_mode="colocate"),
            train_dataset=prompt_dataset(),
            rollout_func=lambda prompts, trainer: {},
        )


def test_docstring_documents_every_dppo_field_in_groups():
    """TRL's convention: the class docstring lists each DPPO field (grouped, with its equation) and its help exists."""
    from dataclasses import fields

    own = [f for f in fields(DPPOConfig) if f.name not in {g.name for g in fields(GRPOConfig)}]
    own.append(next(f for f in fields(DPPOConfig) if f.name == "vllm_importance_sampling_correction"))
    doc = DPPOConfig.__doc__
    for f in own:
        assert f"        {f.name} (`" in doc, f"{f.name} missing from DPPOConfig's Parameters docstring"
        assert f.metadata.get("help"), f"{f.name} has no help text"
    for group in ("trust region (eqs. 11-16)", "anchor", "ablations"):
        assert f"> Parameters that define the {group}" in doc or f"> Parameters for {group}" in doc, group
    for equation in ("eq. 11", "eq. 12", "eq. 13", "eq. 14", "eqs. 15-16"):
        assert equation in doc, equation
