"""The gradient DPPOTrainer gets through GRPOTrainer's real `_compute_loss` in bf16, the precision users train in: the
crafted batch of test_loss_gradient.py with bf16 weights, or float32 weights under bf16 autocast, against eq. 11 in
float64 on the very same weights (binary and top-K TV)."""

import math

import pytest
import torch
from references import dppo_per_token_loss
from test_loss_gradient import ADVANTAGES, PROMPT_LEN, _crafted_batch, _trainer

from dppo_dev.tiny_models import build_byte_tokenizer
from dppo_trl.core.functional import compute_divergence, trust_region_mask

# ---------------------------------------------------------------------------------------------------------------------
# bf16 lanes: the precision users train in, against a float64 copy of the same weights
# ---------------------------------------------------------------------------------------------------------------------

# bf16's unit roundoff: 8 significant bits, so one rounding moves a value by at most 2^-8 of itself.
U_BF16 = 2.0**-8
BF16_PRECISIONS = {
    # AsyncGRPOConfig's default on GPUs (dtype="float32", bf16=True): float32 weights, the forward under bf16 autocast.
    "fp32-weights-bf16-autocast": {"bf16": True},
    "bf16-weights": {"bf16": True, "model_init_kwargs": {"dtype": "bfloat16"}},
}
TOP_K = 3


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def _float64_copy(model_dir, model):
    """The trainer's model with its very weights (bf16 ones included, exactly) in float64."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    reference.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    return reference.train()


def _topk_lists(full_logps, completion_ids, mu):
    """μ's top-K lists as the engine reports them: slot 0 the sampled token (μ of its regime), slots 1..K the K most
    probable other ids at their (float64) probabilities."""
    others = full_logps.scatter(-1, completion_ids.unsqueeze(-1), -math.inf).topk(TOP_K, dim=-1).indices
    ids = torch.cat([completion_ids.unsqueeze(-1), others], dim=-1)
    lists = full_logps.gather(-1, ids).float()
    lists[..., 0] = mu
    return ids, lists


@pytest.mark.parametrize("kind", ["binary_tv", "topk_tv"])
@pytest.mark.parametrize("precision", list(BF16_PRECISIONS))
def test_bf16_gradient_is_eq11_to_bf16_rounding(tiny_model_dir, tokenizer, tmp_path, precision, kind):
    """The crafted batch through GRPOTrainer's real loss with the model in bf16 (bf16 weights, or float32 weights whose
    forward accelerate runs under bf16 autocast, as `Trainer.train` prepares it), against eq. 11 computed in float64
    on the same weights. `topk_tv` also takes π at μ's top-K ids through the trainer's gather of the head rows from
    the bf16 hidden states.

    What bf16 can promise, in u = 2^-8 (its unit roundoff: one rounding moves a value by at most u of itself):
    - π: each logit z is a bf16 GEMM output, rounded once (≤ u·|z|), and log-softmax is a difference of z and log Z
      (≤ u·max|z| each): a first-order error of 2u·max|z|, plus what the rounded hidden states carry in. Allowed:
      4u·max(1, max|z|); measured ≤ 0.65u (the tiny model's logits are small: max|z| ≈ 0.7).
    - the mask: eq. 12 is a step in D, so bf16 may flip a token whose float64 D lies within its error of δ; every
      other counted token must keep the float64 decision (here none is that close).
    - the gradient, given the trainer's mask: each parameter's gradient is a product of a few bf16-rounded forward
      activations and backward signals, a few u relative each. Measured (4 batches, both lanes, both kinds): ≤ 4.8u
      per parameter (a q/k-norm weight, whose gradient sums cancelling terms) and ≤ 2.4u over the whole model.
      Allowed: 16u and 8u.
    """
    trainer = _trainer(
        tiny_model_dir,
        tokenizer,
        tmp_path,
        divergence=kind,
        divergence_top_k=TOP_K if kind == "topk_tv" else None,
        delta_low=0.02,
        delta_high=0.001,
        ratio_cap=2.0,
        **BF16_PRECISIONS[precision],
    )
    from dppo_trl.trainers.dppo_trainer import BEHAVIOR_TOPK_IDS, BEHAVIOR_TOPK_LOGPS

    reference = _float64_copy(tiny_model_dir, trainer.model)
    inputs, ids, attn, mu, valid = _crafted_batch(reference, torch.Generator().manual_seed(6))
    completion_ids = inputs["completion_ids"]

    def full_logps(model):
        return torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, PROMPT_LEN - 1 : -1], -1)

    if kind == "topk_tv":
        with torch.no_grad():
            list_ids, mu_lists = _topk_lists(full_logps(reference), completion_ids, mu)
        inputs[BEHAVIOR_TOPK_IDS], inputs[BEHAVIOR_TOPK_LOGPS] = list_ids, mu_lists

    # As `Trainer.train` prepares it: accelerate wraps the forward in bf16 autocast (outputs back to float32).
    model = trainer.accelerator.prepare_model(trainer.model)
    compute_dtypes = []
    hook = trainer.model.model.layers[0].self_attn.v_proj.register_forward_hook(
        lambda module, args, output: compute_dtypes.append(output.dtype)
    )
    seen = []
    trainer.trust_region_observers.append(seen.append)
    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    hook.remove()
    assert torch.isfinite(loss) and set(compute_dtypes) == {torch.bfloat16}  # the forward really ran in bf16
    got = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert {g.dtype for g in got.values()} == {next(trainer.model.parameters()).dtype}

    full = full_logps(reference)
    pi = full.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    adv = ADVANTAGES.double().unsqueeze(1)
    mu64 = mu.double()
    counted = inputs["completion_mask"].bool() & valid
    if kind == "topk_tv":
        pi_lists = full.detach().gather(-1, list_ids)
        divergence = compute_divergence(kind, pi.detach(), mu64, pi_lists, mu_lists.double())
    else:
        divergence = compute_divergence(kind, pi.detach(), mu64)

    # π: what the trainer compared with μ, against float64.
    max_logit = reference(input_ids=ids, attention_mask=attn).logits.detach().abs().max().item()
    pi_error = (seen[0]["pi_logps"].double() - pi.detach())[counted].abs().max().item()
    assert pi_error <= 4 * U_BF16 * max(1.0, max_logit), pi_error / U_BF16
    # The mask: the float64 decision wherever D is clear of both thresholds by more than bf16's error on it.
    keep = seen[0]["keep"].double()
    keep64 = trust_region_mask(pi.detach(), mu64, adv, divergence, 0.02, 0.001)
    # A probability moves by at most p·|Δlog p| ≤ |Δlog p|, so D (half a sum of |π − μ| over the lists and the
    # rest, or one such term) moves by at most the bound on π's error.
    margin = 4 * U_BF16 * max(1.0, max_logit)
    assert (seen[0]["divergence"].double() - divergence)[counted].abs().max() <= margin  # the same D (top-K lists)
    clear = counted & ((divergence - 0.02).abs() > margin) & ((divergence - 0.001).abs() > margin)
    assert torch.equal(keep[clear], keep64[clear]) and (keep[counted] == 0).any() and (keep[counted] == 1).any()

    # The gradient of eq. 11 in float64, given the trainer's mask (dapo: token sum over the batch's tokens).
    mask = inputs["completion_mask"].double()
    per_token = dppo_per_token_loss(pi, mu64, adv, keep * valid, 2.0)
    ((per_token * mask).sum() / mask.sum()).backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for name in want:
        error = (got[name].double() - want[name]).norm() / want[name].norm()
        assert error <= 16 * U_BF16, (name, error.item() / U_BF16)
    total = torch.cat([(got[n].double() - want[n]).flatten() for n in want]).norm()
    total = total / torch.cat([want[n].flatten() for n in want]).norm()
    assert total <= 8 * U_BF16, total.item() / U_BF16
