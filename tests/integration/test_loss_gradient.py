"""The gradient DPPOTrainer gets through GRPOTrainer's real `_compute_loss` is eq. 11, for every aggregation.

A crafted batch puts tokens in each regime of eq. 12 (masked on either side, kept moves back toward μ, ratios above
the cap, an engine log-prob the engine could not report), then compares the model's parameter gradients with the
gradient of the literal eq.-11 loss built from `dppo_trl.core.functional` on full logits.
"""

import math

import pytest
import torch
from datasets import Dataset
from references import dppo_per_token_loss

from dppo_dev.tiny_models import build_byte_tokenizer
from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.core.functional import compute_divergence, trust_region_mask
from dppo_trl.trainers.dppo_trainer import BEHAVIOR_LOGPS, BEHAVIOR_VALID

PROMPT_LEN, COMPLETION_LEN = 3, 6
ADVANTAGES = torch.tensor([1.0, -1.0, 0.7, -1.5])
# μ per token as a function of π (probabilities): each entry is one regime of eqs. 11–12.
#   "far_below": μ = π/10      → A>0: π>μ, D>δ: masked;  A<0: kept (moving back up), ratio 10 > C: capped
#   "above":     μ = 0.6       → A<0: π<μ, D>δ: masked;  A>0: kept (moving back toward μ)
#   "same":      μ = π         → kept, ratio 1
#   "nan":       engine log-prob missing → weight 0
#   "tiny":      μ = 1e-30     → huge ratio, capped at C (A<0 kept; A>0 masked)
#   "close":     μ = π·0.999   → kept (D < δ)
PATTERN = ["far_below", "above", "same", "nan", "tiny", "close"]


def _mu_from_pi(pi_logps: torch.Tensor) -> torch.Tensor:
    mu = torch.empty_like(pi_logps)
    for t, regime in enumerate(PATTERN):
        col = pi_logps[:, t]
        mu[:, t] = {
            "far_below": col - math.log(10.0),
            "above": torch.full_like(col, math.log(0.6)),
            "same": col,
            "nan": torch.full_like(col, float("nan")),
            "tiny": torch.full_like(col, math.log(1e-30)),
            "close": col + math.log(0.999),
        }[regime]
    return mu


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_len: int) -> torch.Tensor:
    """GRPOTrainer's documented normalisers (gradient accumulation 1, one process)."""
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_len)
    if loss_type == "dapo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if loss_type == "luspo":
        return (per_token * mask).sum(-1).mean()
    raise ValueError(loss_type)


def _assert_grad_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """fp32 rounding of the fused head vs full logits: compare against the gradient's own scale."""
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * scale + 1e-9, f"gradient of {name}: max error {err:.3g} at scale {scale:.3g}"


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def _trainer(model_dir, tokenizer, tmp_path, **config):
    args = DPPOConfig(
        **{
            "output_dir": str(tmp_path),
            "use_cpu": True,
            "bf16": False,
            "report_to": "none",
            "save_strategy": "no",
            "per_device_train_batch_size": 4,
            "num_generations": 2,
            "max_completion_length": COMPLETION_LEN,
            **config,
        }
    )
    dataset = Dataset.from_dict({"prompt": ["1+1=", "2+2="]})
    trainer = DPPOTrainer(
        model=model_dir,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def _crafted_batch(model, generator):
    """The crafted batch on the model's device (the draws come from a CPU generator: the same batch everywhere)."""
    batch, device = ADVANTAGES.numel(), next(model.parameters()).device
    prompt_ids = torch.randint(0, 256, (batch, PROMPT_LEN), generator=generator).to(device)
    completion_ids = torch.randint(0, 256, (batch, COMPLETION_LEN), generator=generator).to(device)
    prompt_mask = torch.ones_like(prompt_ids)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[2, -2:] = 0  # a shorter completion
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, PROMPT_LEN - 1 : -1]
        pi = torch.log_softmax(logits.float(), -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    mu = _mu_from_pi(pi)
    valid = torch.isfinite(mu)
    mu_clean = torch.where(valid, mu, torch.zeros_like(mu))
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": ADVANTAGES.clone().to(device),
        "num_items_in_batch": completion_mask.sum(),
        "old_per_token_logps": mu_clean.clamp(min=-60.0),
        BEHAVIOR_LOGPS: mu_clean,
        BEHAVIOR_VALID: valid,
    }
    return inputs, ids, attn, mu_clean, valid


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo", "luspo"])
@pytest.mark.parametrize("kind", ["binary_tv", "binary_kl"])
def test_gradient_through_parent_loss_equals_eq11(tiny_model_dir, tokenizer, tmp_path, loss_type, kind):
    delta_low, delta_high, cap = 0.02, 0.001, 2.0
    trainer = _trainer(
        tiny_model_dir,
        tokenizer,
        tmp_path,
        loss_type=loss_type,
        divergence=kind,
        delta_low=delta_low,
        delta_high=delta_high,
        ratio_cap=cap,
    )
    model = trainer.model
    inputs, ids, attn, mu, valid = _crafted_batch(model, torch.Generator().manual_seed(0))

    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert torch.isfinite(loss)

    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, PROMPT_LEN - 1 : -1]
    pi = torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    adv = ADVANTAGES.unsqueeze(1)
    div = compute_divergence(kind, pi.detach(), mu)
    keep = trust_region_mask(pi.detach(), mu, adv, div, delta_low, delta_high) * valid
    per_token = dppo_per_token_loss(pi, mu, adv, keep, cap)
    reference = _aggregate(per_token, inputs["completion_mask"].float(), loss_type, COMPLETION_LEN)
    reference.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    # The crafted batch really exercises every regime.
    mask = inputs["completion_mask"].bool() & valid
    assert (keep[mask] == 0).any() and (keep[mask] == 1).any()
    assert ((pi.detach() - mu)[mask] > math.log(cap)).any(), "no token above the ratio cap"
    assert set(got) == set(want)
    for name in want:
        _assert_grad_close(got[name], want[name], name)

    mode_metrics = trainer._metrics["train"]
    assert 0 < mode_metrics["dppo/mask_ratio"][-1] < 1
    assert "clip_ratio/region_mean" not in mode_metrics


def test_on_policy_without_behavior_keeps_everything(tiny_model_dir, tokenizer, tmp_path):
    """Transformers generation, on-policy: μ ≡ π, so the loss is the plain policy gradient (ratio 1, no mask)."""
    trainer = _trainer(tiny_model_dir, tokenizer, tmp_path)
    model = trainer.model
    inputs, ids, attn, _, _ = _crafted_batch(model, torch.Generator().manual_seed(1))
    for key in ("old_per_token_logps", BEHAVIOR_LOGPS, BEHAVIOR_VALID):
        inputs.pop(key)
    model.zero_grad()
    trainer._compute_loss(model, inputs).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, PROMPT_LEN - 1 : -1]
    pi = torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    mask = inputs["completion_mask"].float()
    (-(ADVANTAGES.unsqueeze(1) * pi * mask).sum() / mask.sum()).backward()
    for name, param in model.named_parameters():
        if param.grad is not None:
            _assert_grad_close(got[name], param.grad, name)
    assert trainer._metrics["train"]["dppo/mask_ratio"][-1] == 0.0


ABLATIONS = ["grpo_clip", "clip_higher", "cispo", "pg_is", "minirl", "dppo_decoupled", "relax_low", "relax_both"]


@pytest.mark.parametrize("name", ABLATIONS)
def test_ablation_gradient_through_parent_loss(tiny_model_dir, tokenizer, tmp_path, name):
    """Each baseline trust region reaches the parent's loss as `−A · coef · ∇log π` (coef from dppo_trl.core.baselines)."""
    from dppo_trl.core import baselines
    from dppo_trl.core.registry import TRUST_REGIONS
    from dppo_trl.trainers.dppo_trainer import RECOMPUTED_LOGPS

    trainer = _trainer(tiny_model_dir, tokenizer, tmp_path, trust_region=name, delta_low=0.02, delta_high=0.001)
    model = trainer.model
    inputs, ids, attn, mu, valid = _crafted_batch(model, torch.Generator().manual_seed(2))
    if TRUST_REGIONS[name].needs_old_logps:
        # A π_old between π and μ, so the recompute anchor differs from both.
        inputs[RECOMPUTED_LOGPS] = (inputs["old_per_token_logps"] + 0.3).clamp(max=0.0)

    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    assert torch.isfinite(loss)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, PROMPT_LEN - 1 : -1]
    pi = torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    adv = ADVANTAGES.unsqueeze(1).expand_as(pi)
    kwargs = {
        "grpo_clip": {"eps_low": 0.2, "eps_high": 0.2},
        "clip_higher": {"eps_low": 0.2, "eps_high": 0.28},
        "cispo": {},
        "pg_is": {},
        "minirl": {"eps_low": 0.2, "eps_high": 0.2},
        "dppo_decoupled": {"divergence": "binary_tv", "delta_low": 0.02, "delta_high": 0.001, "ratio_cap": 20.0},
        "relax_low": {"alpha": 0.1, "relax": "low", "eps_low": 0.2, "eps_high": 0.2},
        "relax_both": {"alpha": 0.1, "relax": "both", "eps_low": 0.2, "eps_high": 0.2},
    }[name]
    if RECOMPUTED_LOGPS in inputs:
        kwargs["old_logps"] = inputs[RECOMPUTED_LOGPS]
    coefficient = {
        "grpo_clip": baselines.grpo_clip_coefficient,
        "clip_higher": baselines.grpo_clip_coefficient,
        "cispo": baselines.cispo_coefficient,
        "pg_is": baselines.pg_is_coefficient,
        "minirl": baselines.minirl_coefficient,
        "dppo_decoupled": baselines.dppo_decoupled_coefficient,
        "relax_low": baselines.relaxed_clip_coefficient,
        "relax_both": baselines.relaxed_clip_coefficient,
    }[name]
    coef = coefficient(pi.detach(), mu, adv, **kwargs).clamp(max=1e6) * valid
    mask = inputs["completion_mask"].float()
    (-(adv * coef * pi * mask).sum() / mask.sum()).backward()
    for param_name, param in model.named_parameters():
        if param.grad is not None:
            _assert_grad_close(got[param_name], param.grad, param_name)


def test_tool_mask_tokens_carry_no_gradient(tiny_model_dir, tokenizer, tmp_path):
    """Tool-result tokens (TRL's `tool_mask` = 0, engine μ = 0.0) are outside the loss and the metrics."""
    trainer = _trainer(tiny_model_dir, tokenizer, tmp_path, delta_low=0.02, delta_high=0.001, ratio_cap=2.0)
    model = trainer.model
    inputs, ids, attn, mu, valid = _crafted_batch(model, torch.Generator().manual_seed(3))
    tool_mask = torch.ones_like(inputs["completion_mask"])
    tool_mask[:, 1:3] = 0
    inputs["tool_mask"] = tool_mask
    for key in ("old_per_token_logps", BEHAVIOR_LOGPS):
        inputs[key] = inputs[key].masked_fill(tool_mask == 0, 0.0)
    inputs[BEHAVIOR_VALID] = inputs[BEHAVIOR_VALID] | (tool_mask == 0)
    inputs["num_items_in_batch"] = (inputs["completion_mask"] * tool_mask).sum()

    seen = []
    trainer.trust_region_observers.append(seen.append)
    model.zero_grad()
    trainer._compute_loss(model, inputs).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(seen) == 1
    assert not seen[0]["valid"][tool_mask == 0].any(), "tool tokens must not enter the trust-region metrics"
    assert seen[0]["valid"][(tool_mask == 1) & (inputs["completion_mask"] == 1) & valid].all()

    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, PROMPT_LEN - 1 : -1]
    pi = torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    adv = ADVANTAGES.unsqueeze(1)
    mu_ref = inputs[BEHAVIOR_LOGPS]
    keep = trust_region_mask(
        pi.detach(), mu_ref, adv, compute_divergence("binary_tv", pi.detach(), mu_ref), 0.02, 0.001
    )
    mask = (inputs["completion_mask"] * tool_mask).float()
    per_token = dppo_per_token_loss(pi, mu_ref, adv, keep * inputs[BEHAVIOR_VALID], 2.0)
    ((per_token * mask).sum() / mask.sum()).backward()
    for name, param in model.named_parameters():
        if param.grad is not None:
            _assert_grad_close(got[name], param.grad, name)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo", "luspo"])
def test_mu_kl_gradient_through_parent_loss(tiny_model_dir, tokenizer, tmp_path, loss_type):
    """`mu_kl_coef = τ` adds τ · (log π − log μ)² on every valid completion token — A = 0 tokens included —
    aggregated like the policy term: the gradient equals the literal eq.-11 loss plus that term, per aggregation."""
    tau, delta_low, delta_high, cap = 0.1, 0.02, 0.001, 2.0
    trainer = _trainer(
        tiny_model_dir,
        tokenizer,
        tmp_path,
        loss_type=loss_type,
        delta_low=delta_low,
        delta_high=delta_high,
        ratio_cap=cap,
        mu_kl_coef=tau,
    )
    model = trainer.model
    inputs, ids, attn, mu, valid = _crafted_batch(model, torch.Generator().manual_seed(4))
    adv = ADVANTAGES.clone()
    adv[1] = 0.0  # a whole sequence with A = 0: only the μ-KL term moves it
    inputs["advantages"] = adv

    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert torch.isfinite(loss)
    assert trainer._metrics["train"]["dppo/mu_kl_mean"][-1] > 0

    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, PROMPT_LEN - 1 : -1]
    pi = torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    div = compute_divergence("binary_tv", pi.detach(), mu)
    keep = trust_region_mask(pi.detach(), mu, adv.unsqueeze(1), div, delta_low, delta_high) * valid
    mu_kl = torch.where(valid, tau * (pi - mu) ** 2, torch.zeros_like(pi))
    per_token = dppo_per_token_loss(pi, mu, adv.unsqueeze(1), keep, cap) + mu_kl
    _aggregate(per_token, inputs["completion_mask"].float(), loss_type, COMPLETION_LEN).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for name in want:
        _assert_grad_close(got[name], want[name], name)


def test_loss_call_channel_is_scoped_and_metrics_are_logged_once(tiny_model_dir, tokenizer, tmp_path):
    """One loss call: one set of `dppo/*` metrics, one observer call; the per-call channel is gone afterwards, also
    after a failing call, and the instance's `get_off_policy_mask` is TRL's again."""
    from trl import GRPOTrainer

    trainer = _trainer(tiny_model_dir, tokenizer, tmp_path)
    model = trainer.model
    inputs, *_ = _crafted_batch(model, torch.Generator().manual_seed(5))
    seen = []
    trainer.trust_region_observers.append(seen.append)
    trainer._compute_loss(model, inputs)
    assert len(seen) == 1 and len(trainer._metrics["train"]["dppo/mask_ratio"]) == 1
    assert trainer._loss_call is None
    with pytest.raises(KeyError):
        trainer._compute_loss(model, {k: v for k, v in inputs.items() if k != "advantages"})
    assert trainer._loss_call is None
    args = (
        ADVANTAGES.unsqueeze(1),
        inputs[BEHAVIOR_LOGPS],
        inputs[BEHAVIOR_LOGPS] - 1.0,
        inputs["completion_mask"],
        0.5,
    )
    assert torch.equal(trainer.get_off_policy_mask(*args), GRPOTrainer.get_off_policy_mask(*args))


def _kept_lists(full_logps, completion_ids, generator, width):
    """The engine's lists for a truncated sampler: slot 0 the sampled token, slots 1.. other ids; a random subset of
    them kept (the sampled token always), the rest at -inf as vLLM's processed log-probs report dropped tokens."""
    batch, length, vocab = full_logps.shape
    others = torch.stack([torch.randperm(vocab, generator=generator)[: width - 1] for _ in range(batch * length)])
    others = others.view(batch, length, width - 1)
    others = torch.where(others == completion_ids.unsqueeze(-1), (others + 1) % vocab, others)
    ids = torch.cat([completion_ids.unsqueeze(-1), others], dim=-1)
    kept = torch.rand(ids.shape, generator=generator) < 0.6
    kept[..., 0] = True
    return ids, kept


@pytest.mark.parametrize(
    ("kind", "loss_type", "mu_kl_coef"),
    [("binary_tv", "dapo", 0.0), ("binary_kl", "grpo", 0.1), ("topk_tv", "dapo", 0.0), ("topk_kl", "luspo", 0.0)],
)
def test_truncated_sampling_gradient_is_eq11_with_pi_kept(
    tiny_model_dir, tokenizer, tmp_path, kind, loss_type, mu_kl_coef
):
    """With a kept set, the gradient is eq. 11 with π_kept = π / π(kept): `−A·w·∇log π_kept`, w and the mask from
    D(π_kept, μ); overflow positions carry none. The reference renormalises full logits over the kept ids."""
    from dppo_trl.core.functional import restrict_topk_to_kept
    from dppo_trl.trainers.dppo_trainer import BEHAVIOR_KEPT_IDS, BEHAVIOR_KEPT_LOGPS, BEHAVIOR_KEPT_OVERFLOW

    delta_low, delta_high, cap, top_k, width = 0.02, 0.001, 2.0, 2, 5
    trainer = _trainer(
        tiny_model_dir,
        tokenizer,
        tmp_path,
        loss_type=loss_type,
        divergence=kind,
        divergence_top_k=top_k,
        delta_low=delta_low,
        delta_high=delta_high,
        ratio_cap=cap,
        mu_kl_coef=mu_kl_coef,
    )
    model = trainer.model
    generator = torch.Generator().manual_seed(5)
    inputs, ids, attn, _, _ = _crafted_batch(model, generator)
    completion_ids = inputs["completion_ids"]

    def full_logps():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, PROMPT_LEN - 1 : -1]
        return torch.log_softmax(logits.float(), -1)

    with torch.no_grad():
        full = full_logps()
    list_ids, kept = _kept_lists(full, completion_ids, generator, width)

    def renormalised(full):
        at_ids = full.gather(-1, list_ids)
        log_mass = torch.logsumexp(at_ids.masked_fill(~kept, -math.inf), dim=-1)
        return at_ids - log_mass.unsqueeze(-1), log_mass

    with torch.no_grad():
        pi_kept_lists, _ = renormalised(full)
    mu = _mu_from_pi(pi_kept_lists[..., 0])
    valid = torch.isfinite(mu)
    mu = torch.where(valid, mu, torch.zeros_like(mu))
    # μ's lists: the sampled token's μ in slot 0, π_kept (≈ the engine's values) at the other kept ids.
    mu_lists = torch.where(kept, pi_kept_lists, torch.full_like(pi_kept_lists, -math.inf))
    mu_lists[..., 0] = torch.where(valid, mu, torch.full_like(mu, float("nan")))
    overflow = torch.zeros_like(valid)
    overflow[0, 2] = overflow[3, 0] = True
    inputs.update(
        {
            "old_per_token_logps": mu.clamp(min=-60.0),
            BEHAVIOR_LOGPS: mu,
            BEHAVIOR_VALID: valid,
            BEHAVIOR_KEPT_IDS: list_ids,
            BEHAVIOR_KEPT_LOGPS: mu_lists,
            BEHAVIOR_KEPT_OVERFLOW: overflow & inputs["completion_mask"].bool(),
        }
    )

    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    assert torch.isfinite(loss)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    pi_kept_all, log_mass = renormalised(full_logps())
    pi_kept = pi_kept_all[..., 0]
    adv = ADVANTAGES.unsqueeze(1)
    counted = valid & ~overflow
    if kind.startswith("topk_"):
        pi_topk = restrict_topk_to_kept(
            full.gather(-1, list_ids)[..., : top_k + 1], mu_lists[..., : top_k + 1], log_mass.detach()
        )
        div = compute_divergence(kind, pi_kept.detach(), mu, pi_topk, mu_lists[..., : top_k + 1])
    else:
        div = compute_divergence(kind, pi_kept.detach(), mu)
    keep = trust_region_mask(pi_kept.detach(), mu, adv, div, delta_low, delta_high) * counted
    per_token = dppo_per_token_loss(pi_kept, mu, adv, keep, cap)
    mask = inputs["completion_mask"].float()
    reference = _aggregate(per_token, mask, loss_type, COMPLETION_LEN)
    if mu_kl_coef:
        kl = torch.where(counted, mu_kl_coef * (pi_kept - mu).square(), torch.zeros_like(mu))
        reference = reference + _aggregate(kl, mask, loss_type, COMPLETION_LEN)
    reference.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    tokens = inputs["completion_mask"].bool() & counted
    assert (keep[tokens] == 0).any() and (keep[tokens] == 1).any()
    # π_kept really differs from π: the test would not tell them apart otherwise.
    assert (log_mass.detach()[tokens] < -0.1).any()
    assert set(got) == set(want)
    for name in want:
        _assert_grad_close(got[name], want[name], name)
    metrics = trainer._metrics["train"]
    assert metrics["dppo/kept_set_overflow_ratio"][-1] == pytest.approx(2 / inputs["completion_mask"].sum().item())
