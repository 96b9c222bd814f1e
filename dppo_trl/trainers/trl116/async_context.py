"""Each turn's `max_tokens` fitted to the room left in the vLLM server's context, in TRL's asynchronous rollout worker.

TRL 1.16's `AsyncRolloutWorker` re-renders the whole conversation every turn and asks the server for `max_tokens`
(the config's `max_completion_length`) new tokens, whatever the conversation has grown to. A server of vLLM 0.28 or
0.31 answers a request whose prompt plus `max_tokens` exceeds its context with HTTP 400, which the worker retries as a
transport error (about 90 times, with back-off) and then dies of; 0.32 shortens `max_tokens` itself; every version
rejects a prompt that leaves no room at all.

[`ContextFitRolloutLoop`] asks for at most `max_model_len - len(prompt)` tokens (a *clamped* turn,
`completions/context_clamped_turns_total`). A later turn whose re-rendered prompt leaves no room (a tool result made
the conversation outgrow the context) is not sent: the rollout ends there, after that tool result (an *ended* turn,
`completions/context_ended_turns_total`). Its training rows are TRL's reconciliation (`_chain_to_sequences`) of the
turns that were sampled, every trained token with the server's own log-prob; the last tool result is in the
completion messages the rewards read, and in no row (no sampled token follows it). A first turn with no room is the
dataset's prompt: it raises, naming the lengths.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from trl.chat_template_utils import parse_response
from trl.experimental.async_grpo.async_rollout_worker import (
    AsyncRolloutWorker,
    TurnRecord,
    _AsyncRolloutLoop,
    _chain_to_sequences,
)

__all__ = ["CLAMPED_METRIC", "ENDED_METRIC", "ContextFitRolloutLoop", "ContextFitRolloutWorker"]

# Counters (TRL's async metric convention: a `total` word is summed over the logging window).
CLAMPED_METRIC = "completions/context_clamped_turns_total"
ENDED_METRIC = "completions/context_ended_turns_total"


class _NoRoomLeft(Exception):
    """A later turn's prompt fills the server's context: the conversation ends before that turn."""


@dataclass
class _Rollout:
    """What one conversation has done so far, as TRL's `_generate_one` did it: the sampled turns and, after each turn
    that called tools, `(tool messages, calls, failures)`."""

    tools: list
    started: float = field(default_factory=time.monotonic)
    turns: list[TurnRecord] = field(default_factory=list)
    tool_results: list[tuple[list[dict[str, str]], int, int]] = field(default_factory=list)


def _current_task() -> asyncio.Task:
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("The rollout loop samples only inside the worker's asyncio tasks.")
    return task


class ContextFitRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (in the worker's child process) with every turn's `max_tokens` fitted to the room left in
    the server's context, and a conversation that outgrows the context ended instead of failing. See the module
    docstring; everything else is TRL's."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._max_model_len: int | None = None
        # One conversation per asyncio task (TRL runs each `_generate_one` as a task and awaits its requests in it).
        self._rollouts: dict[asyncio.Task, _Rollout] = {}

    async def _server_max_model_len(self) -> int:
        """The served model's `max_model_len`, read once from the server's `/v1/models`."""
        if self._max_model_len is None:
            timeout = aiohttp.ClientTimeout(total=self.request_timeout)
            async with self.session.get(f"{self.vllm_server_url}/v1/models", timeout=timeout) as response:
                response.raise_for_status()
                models = (await response.json())["data"]
            served = self._request_model
            entry = next((m for m in models if m.get("id") == served), models[0])
            self._max_model_len = int(entry["max_model_len"])
        return self._max_model_len

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        if path != "/v1/completions":
            return await super()._post(path, payload, timeout, max_retries)
        max_model_len = await self._server_max_model_len()
        length = len(payload["prompt"])
        room = max_model_len - length
        if room < 1:
            rollout = self._rollouts.get(_current_task())
            if rollout is None or not rollout.turns:
                raise ValueError(
                    f"A prompt of {length} tokens leaves no room for a completion in the vLLM server's context of "
                    f"{max_model_len} tokens. Shorten the dataset's prompts or restart the server with a larger "
                    "`--max-model-len`."
                )
            raise _NoRoomLeft
        if room < payload["max_tokens"]:
            payload = {**payload, "max_tokens": room}
        return await super()._post(path, payload, timeout, max_retries)

    async def _generate_one_turn(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        # Counted here, once per turn: `_post` runs again on every transport retry.
        if 0 < await self._server_max_model_len() - len(prompt_ids) < self.max_tokens:
            self._counters[CLAMPED_METRIC] += 1
        turn_ids, turn_logprobs = await super()._generate_one_turn(prompt_ids)
        self._rollouts[_current_task()].turns.append(TurnRecord(list(prompt_ids), list(turn_ids), list(turn_logprobs)))
        return turn_ids, turn_logprobs

    async def _execute_tool_calls(self, tool_calls, tool_dict):
        messages, calls, failures = await super()._execute_tool_calls(tool_calls, tool_dict)
        self._rollouts[_current_task()].tool_results.append((list(messages), calls, failures))
        return messages, calls, failures

    async def _generate_one(self, prompt, tool_dict, tools, group_id=0):
        task = _current_task()
        rollout = self._rollouts[task] = _Rollout(tools=tools)
        try:
            return await super()._generate_one(prompt, tool_dict, tools, group_id)
        except _NoRoomLeft:
            return self._ended_rollout(rollout)
        finally:
            del self._rollouts[task]

    def _ended_rollout(self, rollout: _Rollout):
        """`_generate_one`'s result for a conversation whose next turn had no room: the turns sampled so far, their
        parsed replies and tool results, reconciled into rows by TRL's own `_chain_to_sequences`."""
        completion: list[dict[str, Any]] = []
        completion_ids: list[int] = []
        for i, turn in enumerate(rollout.turns):
            tools = rollout.tools
            completion.append(parse_response(self.tokenizer, turn.output_ids, prefix=turn.prompt_ids, tools=tools))
            completion_ids.extend(turn.output_ids)
            if i < len(rollout.tool_results):
                completion.extend(rollout.tool_results[i][0])
        sequences, tally = _chain_to_sequences(rollout.turns, uuid.uuid4().hex, self._fork_threshold_tokens)
        self._counters[ENDED_METRIC] += 1
        self._push_rollout_metrics(
            turns=len(rollout.turns),
            sequences=len(sequences),
            completion_ids=completion_ids,
            tally=tally,
            loop_exhausted=False,
            duration_s=time.monotonic() - rollout.started,
        )
        calls = sum(n for _, n, _ in rollout.tool_results)
        failures = sum(n for _, _, n in rollout.tool_results)
        return completion, completion_ids, sequences, calls, failures, None


class ContextFitRolloutWorker(AsyncRolloutWorker):
    """TRL's rollout worker running [`ContextFitRolloutLoop`] (same arguments as TRL's worker)."""

    _loop_cls = ContextFitRolloutLoop

    @classmethod
    def like(cls, worker: AsyncRolloutWorker, **extra: Any) -> AsyncRolloutWorker:
        """A not-yet-started worker of this class with `worker`'s arguments (those `AsyncGRPOTrainer` built it with),
        plus `extra` loop arguments."""
        return cls(**worker._loop_kwargs, **extra)
