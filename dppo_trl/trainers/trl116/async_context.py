"""Each turn's `max_tokens` fitted to the room left in the vLLM server's context, in TRL's asynchronous rollout worker.

TRL 1.16's `AsyncRolloutWorker` re-renders the whole conversation every turn and asks the server for `max_tokens`
(the config's `max_completion_length`) new tokens, whatever the conversation has grown to. A server of vLLM 0.28 or
0.31 answers a request whose prompt plus `max_tokens` exceeds its context with HTTP 400, which the worker retries as a
transport error (about 90 times, with back-off) and then dies of; 0.32 shortens `max_tokens` itself; every version
rejects a prompt that leaves no room at all.

[`ContextFitRolloutLoop`] asks for at most `max_model_len - len(prompt)` tokens (a *clamped* turn,
`completions/context_clamped_turns_total`). A later turn whose re-rendered prompt leaves no room (a tool result made
the conversation outgrow the context) is not sent: the conversation ends there, after that tool result (an *ended*
turn, `completions/context_ended_turns_total`). TRL's turn loop has no exit for it, so `_generate_one` is TRL's
method restated with one edit (`_fits_context` before each turn, whose `break` leaves the loop as a finished
conversation does; tests/meta/test_trl_contract.py checks the rest is TRL's code token for token): the training rows
are TRL's reconciliation (`_chain_to_sequences`) of the turns that were sampled, every trained token with the server's
own log-prob; the last tool result is in the completion messages the rewards read, and in no row (no sampled token
follows it). A first turn with no room is the dataset's prompt: it raises, naming the lengths.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
from trl.chat_template_utils import parse_response
from trl.experimental.async_grpo.async_rollout_worker import (
    AsyncRolloutWorker,
    Messages,
    TrainingSequence,
    TurnRecord,
    _AsyncRolloutLoop,
    _chain_to_sequences,
)

__all__ = ["CLAMPED_METRIC", "ENDED_METRIC", "ContextFitRolloutLoop", "ContextFitRolloutWorker"]

# Counters (TRL's async metric convention: a `total` word is summed over the logging window).
CLAMPED_METRIC = "completions/context_clamped_turns_total"
ENDED_METRIC = "completions/context_ended_turns_total"


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

    async def _fits_context(self, prompt_ids: list[int], turns: list[TurnRecord]) -> bool:
        """Whether the next turn (its prompt `prompt_ids`, after the conversation's `turns`) has room in the server's
        context; counts it as clamped when the room is below `max_tokens`, or as ended when there is none. A first turn
        with no room is the dataset's prompt: it raises."""
        max_model_len = await self._server_max_model_len()
        room = max_model_len - len(prompt_ids)
        if room < 1:
            if not turns:
                raise ValueError(
                    f"A prompt of {len(prompt_ids)} tokens leaves no room for a completion in the vLLM server's "
                    f"context of {max_model_len} tokens. Shorten the dataset's prompts or restart the server with a "
                    "larger `--max-model-len`."
                )
            self._counters[ENDED_METRIC] += 1
            return False
        if room < self.max_tokens:
            self._counters[CLAMPED_METRIC] += 1
        return True

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        if path == "/v1/completions":
            room = await self._server_max_model_len() - len(payload["prompt"])
            if 0 < room < payload["max_tokens"]:
                payload = {**payload, "max_tokens": room}
        return await super()._post(path, payload, timeout, max_retries)

    async def _generate_one(
        self, prompt: Messages, tool_dict: dict[str, Callable], tools: list[Callable], group_id: int = 0
    ) -> tuple[list[dict[str, str]], list[int], list[TrainingSequence], int, int, float | None]:
        """TRL's `_generate_one` (restated TRL code) with `_fits_context` before each turn: a turn with no room left
        ends the conversation as a finished one does (`ASYNC_GENERATE_ONE_EDITS` in tests/trl_contract.py)."""
        # restates-trl: begin _AsyncRolloutLoop._generate_one
        t_dispatch = time.monotonic()
        messages = list(prompt)  # a MESSAGE list, not a token list
        rollout_id = uuid.uuid4().hex
        turns: list[TurnRecord] = []
        completion, completion_ids = [], []
        tool_call_count = 0
        tool_failure_count = 0
        iteration_num = 0
        loop_exhausted = False
        max_iterations = self.max_tool_calling_iterations
        while True:
            prompt_ids = self.tokenizer.apply_chat_template(  # re-tokenize the WHOLE conversation
                messages,
                return_dict=False,
                add_generation_prompt=True,
                tools=tools or None,
                chat_template=self.chat_template,
                **self.chat_template_kwargs,
            )
            if not await self._fits_context(prompt_ids, turns):
                break
            turn_ids, turn_logprobs = await self._generate_one_turn(prompt_ids)
            assistant_message = parse_response(self.tokenizer, turn_ids, prefix=prompt_ids, tools=tools)
            completion.append(assistant_message)
            completion_ids.extend(turn_ids)
            messages.append(assistant_message)
            turns.append(TurnRecord(prompt_ids, turn_ids, turn_logprobs))
            tool_calls = assistant_message.get("tool_calls")
            if tool_calls is None:
                break
            if max_iterations is not None and iteration_num >= max_iterations:
                # Cut off mid-loop: the model asked for another tool and we refused. The conversation is trained as if
                # it had finished, so this is a silent truncation — hence the metric.
                loop_exhausted = True
                break
            tool_messages, n_calls, n_failures = await self._execute_tool_calls(tool_calls, tool_dict)
            tool_call_count += n_calls
            tool_failure_count += n_failures
            completion.extend(tool_messages)
            messages.extend(tool_messages)  # tool result goes back as a MESSAGE, re-tokenized next turn
            iteration_num += 1
        # >= 1 row per conversation; `tally` is the drift bookkeeping over the turn transitions.
        sequences, tally = _chain_to_sequences(turns, rollout_id, self._fork_threshold_tokens)
        self._push_rollout_metrics(
            turns=len(turns),
            sequences=len(sequences),
            completion_ids=completion_ids,
            tally=tally,
            loop_exhausted=loop_exhausted,
            duration_s=time.monotonic() - t_dispatch,
        )
        return completion, completion_ids, sequences, tool_call_count, tool_failure_count, None
        # restates-trl: end


class ContextFitRolloutWorker(AsyncRolloutWorker):
    """TRL's rollout worker running [`ContextFitRolloutLoop`] (same arguments as TRL's worker)."""

    _loop_cls = ContextFitRolloutLoop

    @classmethod
    def like(cls, worker: AsyncRolloutWorker, **extra: Any) -> AsyncRolloutWorker:
        """A not-yet-started worker of this class with `worker`'s arguments (those `AsyncGRPOTrainer` built it with),
        plus `extra` loop arguments."""
        return cls(**worker._loop_kwargs, **extra)
