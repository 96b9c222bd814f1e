"""DPPOTrainer with `environment_factory=` against a real vLLM server (`python -m dppo_trl.backends.cpu.vllm_server`),
binary and top-K.

The environment's tool raises on every other call (an environment that fails, which TRL reports to the model as an
error). Before any weight update, μ — and μ's top-K lists — at every model token must be the log-probs of the weights
that sampled; the server and the trainer hold the same weights then, so the trainer's own fp32 forward re-scores them.
Tool-result tokens carry no list and are out of the loss mask.
"""

import json
import math
import os

import pytest
import torch
from datasets import Dataset
from server_setup import running_server
from trainer_setup import logged, record_first_generation
from transformers import AutoTokenizer

from dppo_dev.tiny_agent import agent_reward
from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.trainers.dppo_trainer import BEHAVIOR_LOGPS, BEHAVIOR_TOPK_IDS, BEHAVIOR_TOPK_LOGPS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = os.path.join(ROOT, "examples", "tiny_agent_model")
K = 4
ATOL = 2e-3  # vLLM CPU kernels vs the trainer's fp32 forward, same weights


class CalculatorEnv:
    """A TRL environment: `reset` per row, one tool (same schema as the agent's), which fails intermittently: every
    other call made in this process, whatever the arguments (the server's sampling is not seeded, so which problems
    get a call varies from run to run; a failure tied to the arguments could then never happen)."""

    calls_in_process = 0

    def reset(self, **row) -> None:
        self.calls = 0

    def _intermittent(self) -> bool:
        CalculatorEnv.calls_in_process += 1
        return CalculatorEnv.calls_in_process % 2 == 0

    def multiply(self, a: int, b: int) -> int:
        """
        Multiply a by b.

        Args:
            a: first factor
            b: second factor
        """
        self.calls += 1
        if self._intermittent():
            raise RuntimeError("environment failure")
        return a * b


@pytest.fixture(scope="module")
def server_port(tmp_path_factory):
    # No API key: the trainer's client sends none here.
    with running_server(str(tmp_path_factory.mktemp("agent_server")), model=AGENT, max_logprobs=K, api_key=None) as s:
        yield s.port


def _dataset() -> Dataset:
    with open(os.path.join(ROOT, "examples", "data", "tiny_agent", "test.jsonl")) as f:
        return Dataset.from_list([json.loads(line) for line in f][:16])


@pytest.mark.parametrize("divergence", ["binary_tv", "topk_tv"])
def test_environment_on_server_mu_is_the_samplers(tmp_path, server_port, divergence):
    args = DPPOConfig(
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
        sync_mismatch_action="raise",  # a clean run never trips the weight-sync check
        use_vllm=True,
        vllm_mode="server",
        vllm_server_host="127.0.0.1",
        vllm_server_port=server_port,
        vllm_server_timeout=60,
        divergence=divergence,
        divergence_top_k=K,
    )
    trainer = DPPOTrainer(
        model=AGENT,
        reward_funcs=agent_reward,
        args=args,
        train_dataset=_dataset(),
        processing_class=AutoTokenizer.from_pretrained(AGENT),
        environment_factory=CalculatorEnv,
    )
    first = record_first_generation(trainer)
    trainer.train()

    output, logp = first[0]
    model_tokens = (output["completion_mask"] * output["tool_mask"]).bool()
    tool_tokens = output["completion_mask"].bool() & (output["tool_mask"] == 0)
    assert tool_tokens.any(), "no tool result was spliced"
    pi = logp.gather(-1, output["completion_ids"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(output[BEHAVIOR_LOGPS][model_tokens], pi[model_tokens], atol=ATOL, rtol=0)
    if divergence == "topk_tv":
        ids, lps = output[BEHAVIOR_TOPK_IDS], output[BEHAVIOR_TOPK_LOGPS]
        assert (ids[tool_tokens] == -1).all() and torch.isinf(lps[tool_tokens]).all()
        listed = ids[model_tokens]
        present = listed >= 0
        assert present.sum(-1).min() >= K  # the sampled token plus at least K others (K when it is in the top-K)
        want = logp[model_tokens].gather(-1, listed.clamp(min=0))
        torch.testing.assert_close(lps[model_tokens][present], want[present], atol=ATOL, rtol=0)
    assert sum(logged(trainer, "tools/failure_frequency")) > 0, "the failing environment tool never ran"
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            if key.startswith("dppo/"):
                assert math.isfinite(value), key
    assert len(logged(trainer, "loss")) == 2


def test_truncated_sampling_with_environment_on_server(tmp_path, server_port):
    """top_k = K (the server's `--max-logprobs`) with an environment in server mode: each turn's lists (the server
    floors the dropped tokens' −inf to −9999) are placed at the tokens that turn sampled; on the first (fresh) batch
    |π_kept − μ| over model tokens is rounding while the full softmax's |π − μ| is the bias, nothing is masked at
    δ = 0.01, no position can overflow (top_k ≤ N) and tool-result tokens are not counted."""
    args = DPPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=120,
        max_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
        sync_mismatch_action="raise",  # a clean run never trips the weight-sync check
        use_vllm=True,
        vllm_mode="server",
        vllm_server_host="127.0.0.1",
        vllm_server_port=server_port,
        vllm_server_timeout=60,
        top_k=K,
        delta_low=0.01,
        delta_high=0.01,
    )
    assert args.kept_set_size == K
    trainer = DPPOTrainer(
        model=AGENT,
        reward_funcs=agent_reward,
        args=args,
        train_dataset=_dataset(),
        processing_class=AutoTokenizer.from_pretrained(AGENT),
        environment_factory=CalculatorEnv,
    )
    batches, records = [], []
    compute_loss = trainer._compute_loss

    def spy(model, inputs):
        batches.append(inputs)
        return compute_loss(model, inputs)

    trainer._compute_loss = spy
    trainer.trust_region_observers.append(records.append)
    trainer.train()

    batch, record = batches[0], records[0]
    tool_tokens = batch["completion_mask"].bool() & (batch["tool_mask"] == 0)
    assert tool_tokens.any(), "no tool result was spliced"
    counted = record["valid"]
    assert counted.any() and not (counted & tool_tokens).any()
    mu = record["mu_logps"][counted].exp()
    kept = (record["pi_logps"][counted].exp() - mu).abs().mean().item()
    full = (record["pi_full_logps"][counted].exp() - mu).abs().mean().item()
    print(
        f"server top_k={K} with an environment: |pi_kept - mu| = {kept:.3g}, |pi - mu| = {full:.3g} over "
        f"{int(counted.sum())} model tokens ({int(tool_tokens.sum())} tool tokens)"
    )
    assert kept < 1e-4
    assert full > 100 * kept and full > 1e-3
    assert logged(trainer, "dppo/mask_ratio") == [0.0]
    assert logged(trainer, "dppo/kept_set_overflow_ratio") == [0.0]


class VerboseCalculatorEnv(CalculatorEnv):
    """`CalculatorEnv` whose tool answers every other call with a long report: after it, the conversation no longer fits the
    server's context (256), while the completion stays within `max_completion_length` (TRL keeps the result)."""

    # Annotated `int` like the agent's tool: the tokenizer holds the system prompt of exactly that schema as one token.
    def multiply(self, a: int, b: int) -> int:
        """
        Multiply a by b.

        Args:
            a: first factor
            b: second factor
        """
        self.calls += 1
        if self._intermittent():
            return f"{a * b} " + "(checked twice, carry digits noted) " * 7
        return str(a * b)


def verbose_multiply(a: int, b: int) -> int:
    """
    Multiply a by b.

    Args:
        a: first factor
        b: second factor
    """
    env = VerboseCalculatorEnv()
    env.reset()
    return env.multiply(a, b)  # shares the process-wide call count: every other call answers at length


verbose_multiply.__name__ = "multiply"  # same schema as the tool the agent was trained with


@pytest.mark.parametrize(("divergence", "agent"), [("binary_tv", "tools"), ("topk_tv", "environment_factory")])
def test_turns_that_outgrow_the_servers_context_end_the_rollout_not_training(tmp_path, server_port, divergence, agent):
    """Server context 256, `max_completion_length` 400: every first turn asks for more than the room left (its
    `max_tokens` is cut to the room: clamped turns), and a turn after a long tool result has no room at all (the
    rollout ends there, on the tool result, as truncated: ended turns). No request fails, μ and its lists at every
    model token are the sampler's, the ended rows end on tool-result tokens (out of the mask), training goes on."""
    args = DPPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=400,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
        sync_mismatch_action="raise",  # a clean run never trips the weight-sync check
        use_vllm=True,
        vllm_mode="server",
        vllm_server_host="127.0.0.1",
        vllm_server_port=server_port,
        vllm_server_timeout=60,
        divergence=divergence,
        divergence_top_k=K,
    )
    tokenizer = AutoTokenizer.from_pretrained(AGENT)
    trainer = DPPOTrainer(
        model=AGENT,
        reward_funcs=agent_reward,
        args=args,
        train_dataset=_dataset(),
        processing_class=tokenizer,
        **({"tools": [verbose_multiply]} if agent == "tools" else {"environment_factory": VerboseCalculatorEnv}),
    )
    first = record_first_generation(trainer)
    trainer.train()

    clamped = logged(trainer, "completions/context_clamped_turns")
    ended = logged(trainer, "completions/context_ended_turns")
    assert len(clamped) == len(ended) == 2
    assert min(clamped) >= args.per_device_train_batch_size  # every first turn asked for more than the room
    assert sum(ended) > 0, "no turn outgrew the server's context"
    assert len(logged(trainer, "loss")) == 2

    output, logp = first[0]
    model_tokens = (output["completion_mask"] * output["tool_mask"]).bool()
    tool_tokens = output["completion_mask"].bool() & (output["tool_mask"] == 0)
    prompt_lengths = output["prompt_mask"].sum(1)
    lengths = output["completion_mask"].sum(1)
    ended_rows = 0
    for b in range(len(lengths)):
        n = int(lengths[b])
        # The room is the server's: no row the server sampled holds more than its context.
        last_model = int(model_tokens[b, :n].nonzero().max()) + 1 if model_tokens[b, :n].any() else 0
        assert int(prompt_lengths[b]) + last_model <= 256
        if n and tool_tokens[b, n - 1]:  # ends on the tool result: its next turn had no room
            ended_rows += 1
            assert int(prompt_lengths[b]) + n >= 256
            assert int(output["completion_ids"][b, n - 1]) not in trainer.eos_token_ids  # truncated
    assert ended_rows > 0
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
