"""Top-K DPPO over a multi-turn (tool-calling) batch: the gradient through GRPOTrainer's real `_compute_loss` is the
literal eq. 11 over model tokens only, and tool-result tokens reach neither the loss nor any `dppo/*` metric.

The batch is laid out as GRPOTrainer's tool loop lays it out: tool-result tokens inside the completion with
`tool_mask` 0, μ 0.0 there and no top-K list (id -1, log-prob -inf), as `place_turns` leaves them.
"""

import math

import pytest
import torch
from datasets import Dataset
from references import dppo_per_token_loss

from dppo_dev.tiny_models import build_byte_tokenizer
from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.core.functional import topk_tv, trust_region_mask
from dppo_trl.trainers.dppo_trainer import BEHAVIOR_LOGPS, BEHAVIOR_TOPK_IDS, BEHAVIOR_TOPK_LOGPS, BEHAVIOR_VALID

PROMPT_LEN, COMPLETION_LEN, K = 3, 8, 4
ADVANTAGES = torch.tensor([1.0, -1.0, 0.7, -1.5])
TOOL = slice(3, 6)  # tool-result positions of every row
DELTA_LOW, DELTA_HIGH, CAP = 0.05, 0.01, 2.0


def _trainer(model_dir, tmp_path) -> DPPOTrainer:
    args = DPPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=COMPLETION_LEN,
        divergence="topk_tv",
        divergence_top_k=K,
        delta_low=DELTA_LOW,
        delta_high=DELTA_HIGH,
        ratio_cap=CAP,
    )
    trainer = DPPOTrainer(
        model=model_dir,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+1=", "2+2="]}),
        processing_class=build_byte_tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def _batch(model, generator):
    batch = ADVANTAGES.numel()
    prompt_ids = torch.randint(0, 256, (batch, PROMPT_LEN), generator=generator)
    completion_ids = torch.randint(0, 256, (batch, COMPLETION_LEN), generator=generator)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[2, -1:] = 0
    tool_mask = torch.ones_like(completion_ids)
    tool_mask[:, TOOL] = 0
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([torch.ones_like(prompt_ids), completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, PROMPT_LEN - 1 : -1].float()
    # μ: a perturbed π, far enough in places that the trust region masks some tokens.
    mu_full = torch.log_softmax(logits + 1.5 * torch.randn(logits.shape, generator=generator), -1)
    mu = mu_full.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    top = mu_full.topk(K + 1, dim=-1).indices
    topk_ids = torch.full((batch, COMPLETION_LEN, K + 1), -1, dtype=torch.long)
    for b in range(batch):
        for t in range(COMPLETION_LEN):
            others = [i for i in top[b, t].tolist() if i != completion_ids[b, t]][:K]
            topk_ids[b, t] = torch.tensor([int(completion_ids[b, t]), *others])
    topk_logps = mu_full.gather(-1, topk_ids.clamp(min=0))
    model_tokens = tool_mask.bool()
    mu = mu.masked_fill(~model_tokens, 0.0)  # TRL's placeholder
    topk_ids = topk_ids.masked_fill(~model_tokens.unsqueeze(-1), -1)
    topk_logps = topk_logps.masked_fill(~model_tokens.unsqueeze(-1), -math.inf)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": ADVANTAGES.clone(),
        "num_items_in_batch": (completion_mask * tool_mask).sum(),
        "old_per_token_logps": mu,
        BEHAVIOR_LOGPS: mu,
        BEHAVIOR_VALID: torch.ones_like(mu, dtype=torch.bool),
        BEHAVIOR_TOPK_IDS: topk_ids,
        BEHAVIOR_TOPK_LOGPS: topk_logps,
    }
    return inputs, ids, attn


def _loss_grads_metrics(trainer, inputs):
    model = trainer.model
    seen = []
    trainer.trust_region_observers[:] = [seen.append]
    trainer._metrics["train"].clear()
    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    metrics = {k: list(v) for k, v in trainer._metrics["train"].items() if k.startswith("dppo/")}
    return loss.detach(), grads, metrics, seen


def test_topk_gradient_over_model_tokens_only(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path)
    model = trainer.model
    inputs, ids, attn = _batch(model, torch.Generator().manual_seed(0))
    loss, got, metrics, seen = _loss_grads_metrics(trainer, inputs)
    assert torch.isfinite(loss) and metrics
    tool = inputs["tool_mask"] == 0
    assert not seen[0]["valid"][tool].any(), "tool tokens must not enter the trust-region metrics"

    # Literal eq. 11 with the top-K TV of eq. 14 on full logits, aggregated (dapo) over model tokens only.
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, PROMPT_LEN - 1 : -1].float()
    logp = torch.log_softmax(logits, -1)
    pi = logp.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    pi_topk = logp.detach().gather(-1, inputs[BEHAVIOR_TOPK_IDS].clamp(min=0))
    mu_topk = inputs[BEHAVIOR_TOPK_LOGPS]
    div = torch.where(mask, topk_tv(pi_topk, mu_topk), torch.zeros_like(pi))
    adv = ADVANTAGES.unsqueeze(1)
    mu = inputs[BEHAVIOR_LOGPS]
    keep = trust_region_mask(pi.detach(), mu, adv, div, DELTA_LOW, DELTA_HIGH) * mask
    assert (keep[mask] == 0).any() and (keep[mask] == 1).any(), "the batch must exercise both regimes"
    per_token = dppo_per_token_loss(pi, mu, adv, keep, CAP)
    ((per_token * mask).sum() / mask.sum()).backward()
    for name, param in model.named_parameters():
        if param.grad is not None:
            want = param.grad
            err = (got[name] - want).abs().max().item()
            assert err <= 1e-5 * want.abs().max().item() + 1e-9, f"gradient of {name}: max error {err:.3g}"

    # Garbage μ and lists at the tool positions change nothing: not the loss, the gradient or any dppo/* metric.
    garbage = dict(inputs)
    garbage[BEHAVIOR_LOGPS] = inputs[BEHAVIOR_LOGPS].masked_fill(tool, -30.0)
    garbage["old_per_token_logps"] = garbage[BEHAVIOR_LOGPS]
    garbage[BEHAVIOR_TOPK_IDS] = inputs[BEHAVIOR_TOPK_IDS].masked_fill(tool.unsqueeze(-1), 7)
    garbage[BEHAVIOR_TOPK_LOGPS] = inputs[BEHAVIOR_TOPK_LOGPS].masked_fill(tool.unsqueeze(-1), -0.1)
    loss2, got2, metrics2, _ = _loss_grads_metrics(trainer, garbage)
    assert torch.equal(loss, loss2)
    assert all(torch.equal(got[n], got2[n]) for n in got)
    assert metrics == metrics2
    assert metrics["dppo/mask_ratio"][0] == pytest.approx(1 - keep[mask].float().mean().item())
