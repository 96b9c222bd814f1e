"""The loss enforces its own invariants on μ: whatever a batch carries, the loss and its gradients are finite.

`_generate_and_score_completions` sanitises the engine's log-probs, but the loss must not depend on every caller
doing so. These batches violate the invariant on purpose: μ of -inf, NaN, +inf, -1e4 or -1e38 written raw into
both `dppo_behavior_logps` and `old_per_token_logps` (with `dppo_behavior_valid` claiming they are fine), with
advantages of 0 and ±1e6, for all four divergences (top-K with μ's top-K slots carrying the same values).
"""

import math

import pytest
import torch
from test_loss_gradient import _crafted_batch, _trainer

from dppo_trl.core.functional import sanitize_behavior_logps
from dppo_trl.trainers.dppo_trainer import BEHAVIOR_LOGPS, BEHAVIOR_TOPK_IDS, BEHAVIOR_TOPK_LOGPS, BEHAVIOR_VALID

BAD_MU = {"-inf": -math.inf, "nan": math.nan, "+inf": math.inf, "-1e4": -1e4, "-1e38": -1e38}
NOT_A_LOGP = {"-inf", "nan", "+inf"}  # masked and counted; -1e4 / -1e38 are valid (tiny) probabilities
ADVANTAGES = {"0": 0.0, "+1e6": 1e6, "-1e6": -1e6}
K = 3


@pytest.fixture(scope="module")
def tokenizer():
    from dppo_dev.tiny_models import build_byte_tokenizer

    return build_byte_tokenizer()


def _corrupt(inputs: dict, value: float, advantage: float, top_k: bool) -> dict:
    """Put μ = `value` raw on two tokens of every row, without upholding the sanitiser's invariant."""
    batch = dict(inputs)
    mu = batch[BEHAVIOR_LOGPS].clone()
    mu[:, 1:3] = value
    batch[BEHAVIOR_LOGPS] = mu
    batch["old_per_token_logps"] = mu.clone()
    batch[BEHAVIOR_VALID] = torch.ones_like(mu, dtype=torch.bool)
    batch["advantages"] = torch.full_like(batch["advantages"], advantage)
    if top_k:
        ids = torch.stack([batch["completion_ids"] + j for j in range(K + 1)], dim=-1) % 256
        logps = torch.log(torch.full(ids.shape, 0.1)).clone()
        logps[..., 0] = mu
        batch[BEHAVIOR_TOPK_IDS], batch[BEHAVIOR_TOPK_LOGPS] = ids, logps
    return batch


@pytest.mark.parametrize("divergence", ["binary_tv", "binary_kl", "topk_tv", "topk_kl"])
def test_loss_is_finite_for_any_mu_in_the_batch(tiny_model_dir, tokenizer, tmp_path, divergence):
    trainer = _trainer(tiny_model_dir, tokenizer, tmp_path, divergence=divergence, divergence_top_k=K)
    model = trainer.model
    clean, *_ = _crafted_batch(model, torch.Generator().manual_seed(4))
    top_k = divergence.startswith("topk_")
    for bad_name, bad in BAD_MU.items():
        for adv_name, adv in ADVANTAGES.items():
            batch = _corrupt(clean, bad, adv, top_k)
            model.zero_grad()
            loss = trainer._compute_loss(model, batch)
            loss.backward()
            case = f"{divergence}, mu={bad_name}, A={adv_name}"
            assert torch.isfinite(loss), case
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            assert grads and all(torch.isfinite(g).all() for g in grads), case
            if adv == 0:
                assert loss.item() == 0.0 and all((g == 0).all() for g in grads), case
            invalid_ratio = trainer._metrics["train"]["dppo/invalid_behavior_ratio"][-1]
            if bad_name in NOT_A_LOGP:
                assert invalid_ratio > 0, case  # masked and counted
            else:
                assert trainer._metrics["train"]["dppo/ratio_max"][-1] <= 1e38, case
            for key in ("dppo/mask_ratio", "dppo/divergence_mean", "dppo/mismatch_abs_mean", "dppo/ratio_mean"):
                assert math.isfinite(trainer._metrics["train"][key][-1]), (case, key)


def test_loss_sanitises_a_batch_that_only_carries_old_logps(tiny_model_dir, tokenizer, tmp_path):
    """A caller that supplies μ only as `old_per_token_logps` (GRPOTrainer's key) gets the same protection."""
    trainer = _trainer(tiny_model_dir, tokenizer, tmp_path)
    model = trainer.model
    clean, *_ = _crafted_batch(model, torch.Generator().manual_seed(5))
    for bad in BAD_MU.values():
        batch = _corrupt(clean, bad, 1e6, top_k=False)
        del batch[BEHAVIOR_LOGPS], batch[BEHAVIOR_VALID]
        model.zero_grad()
        loss = trainer._compute_loss(model, batch)
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_sanitize_behavior_logps():
    mu = torch.tensor([-0.5, 0.0, 5e-7, 1e-3, -math.inf, math.nan, math.inf, -1e38], dtype=torch.bfloat16)
    clean, valid = sanitize_behavior_logps(mu)
    assert clean.dtype == torch.float32
    assert valid.tolist() == [True, True, True, False, False, False, False, True]
    assert clean[2] == 0.0  # rounding above 0 reads as log 1
    assert (clean[~valid] == 0).all() and torch.isfinite(clean).all()
    again, valid_again = sanitize_behavior_logps(clean)
    assert torch.equal(again, clean) and valid_again[valid].all()
