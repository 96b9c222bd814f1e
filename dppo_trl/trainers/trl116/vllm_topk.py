"""Behavior-policy (μ) capture: the rollout engine's sampled-token and top-K log-probs, as tensors.

TRL's vLLM backend returns, per completion token, a list of `(token_id, logprob)` entries sorted by rank. With
`logprobs=K` the sampled token is always among them but is *not* necessarily first, while `GRPOTrainer` reads entry 0
as the sampled token's log-prob (the "lp[0] trap"). [`VLLMTopKCapture`] asks vLLM for K entries, keeps them for the
loss, and hands the trainer back the `logprobs=0` contract: one entry per token, the sampled one, found by id.

Slot layout of the `(B, T, K + 1)` tensors built here: slot 0 is the sampled token y_t; slots 1..K are TopK(μ) without
y_t, in rank order; unused slots hold id `-1` and log-prob `-inf`. So the slots list the distinct tokens of
TopK(μ) ∪ {y_t}, as `dppo_trl.core.functional.topk_tv/topk_kl` expect.

Multi-turn tool calling (`tools=` / `environment_factory=`): GRPOTrainer's tool loop samples the first turn with one
`generate` call, then regenerates the rows that called a tool with one more call per turn, on prompts built by
concatenation (`prompt + completion so far + tool-result tokens`), and splices the tool-result tokens into the
completion. [`place_turns`] puts each call's lists at the positions its tokens occupy in the final completion, found
from the call's prompts; tool-result positions get no list (id `-1`, log-prob `-inf`: outside the loss anyway).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

PAD_ID = -1
# vLLM's OpenAI-compatible serving floors log-probs here (`max(logprob, -9999.0)`): a token the sampler dropped (`-inf`)
# arrives as this value over HTTP.
VLLM_LOGPROB_FLOOR = -9999.0


def topk_entries_to_tensors(
    completion_ids: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[Sequence[float | None]]],
    token_ids: Sequence[Sequence[Sequence[int]]],
    k: int,
    length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert the engine's ragged per-token top-K lists to `(ids, logps)` tensors of shape `(B, length, k + 1)`.

    `logprobs[b][t]` / `token_ids[b][t]` are the entries of completion `b`'s token `t`, in rank order (TRL's
    `extract_logprobs` layout). Slot 0 gets `completion_ids[b][t]` and the log-prob of the entry with that id; slots
    1..k get the other entries, in order, up to k of them. A `None` log-prob (the engine reported NaN) and a sampled
    token missing from the entries both become NaN, so the trainer can count and mask them. Positions past a row's
    end are padding (`-1`, `-inf`).
    """
    batch = len(completion_ids)
    if len(logprobs) != batch or len(token_ids) != batch:
        raise ValueError(f"Got {batch} completions but {len(logprobs)} log-prob rows and {len(token_ids)} id rows.")
    lengths = [len(row) for row in completion_ids]
    for b, (n, row_lps, row_tids) in enumerate(zip(lengths, logprobs, token_ids)):
        if len(row_lps) != n or len(row_tids) != n:
            raise ValueError(
                f"Completion {b} has {n} tokens but {len(row_lps)} log-prob and {len(row_tids)} id entries."
            )
    length = max(lengths, default=0) if length is None else length
    if lengths and max(lengths) > length:
        raise ValueError(f"A completion has {max(lengths)} tokens, more than length={length}.")
    ids = np.full((batch, length, k + 1), PAD_ID, dtype=np.int64)
    logps = np.full((batch, length, k + 1), -np.inf, dtype=np.float32)
    n_tokens = sum(lengths)
    if n_tokens:
        _fill_slots(ids, logps, completion_ids, logprobs, token_ids, lengths, n_tokens, k)
    return torch.from_numpy(ids), torch.from_numpy(logps)


def _fill_slots(
    ids: np.ndarray,
    logps: np.ndarray,
    completion_ids: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[Sequence[float | None]]],
    token_ids: Sequence[Sequence[Sequence[int]]],
    lengths: list[int],
    n_tokens: int,
    k: int,
) -> None:
    """Vectorised core of `topk_entries_to_tensors`: writes the slots of every completion token into `ids`/`logps`.

    Only the flattening touches Python objects, through C-level iterators (`chain`, `map`, `fromiter`); the rest is
    a handful of NumPy ops over all entries at once, so the cost per token stays a small fraction of the engine's.
    """
    token_entry_ids = list(chain.from_iterable(token_ids))
    token_entry_lps = list(chain.from_iterable(logprobs))
    counts = np.fromiter(map(len, token_entry_ids), dtype=np.int64, count=n_tokens)
    if not np.array_equal(counts, np.fromiter(map(len, token_entry_lps), dtype=np.int64, count=n_tokens)):
        raise ValueError("A token has a different number of log-prob and id entries.")
    n_entries = int(counts.sum())
    sampled = np.fromiter(chain.from_iterable(completion_ids), dtype=np.int64, count=n_tokens)
    entry_ids = np.fromiter(chain.from_iterable(token_entry_ids), dtype=np.int64, count=n_entries)
    try:
        entry_lps = np.fromiter(chain.from_iterable(token_entry_lps), dtype=np.float64, count=n_entries)
    except TypeError:
        # Some log-prob is `None`; `np.array` maps it to NaN, the contract for a missing log-prob (and is slower).
        entry_lps = np.array(list(chain.from_iterable(token_entry_lps)), dtype=np.float64).reshape(n_entries)
    entry_token = np.repeat(np.arange(n_tokens), counts)

    # Flat offset of each token's slot 0 in the (B, length, k + 1) arrays.
    row_starts = np.cumsum(lengths) - np.asarray(lengths)
    padding_before = np.repeat(np.arange(len(lengths)) * ids.shape[1] - row_starts, lengths)
    base = (np.arange(n_tokens) + padding_before) * (k + 1)
    ids_flat, logps_flat = ids.reshape(-1), logps.reshape(-1)

    # Slot 0: the sampled token, its log-prob taken from the entry with its id (NaN when there is none).
    ids_flat[base] = sampled
    is_sampled = entry_ids == sampled[entry_token]
    slot0 = np.full(n_tokens, np.nan, dtype=np.float64)
    slot0[entry_token[is_sampled]] = entry_lps[is_sampled]
    logps_flat[base] = slot0

    # Slots 1..k: the other entries in their given order. The running count of kept entries within each token is the
    # slot; entries past the k-th are dropped.
    kept = ~is_sampled
    kept_before = np.concatenate(([0], np.cumsum(kept)))  # kept entries before each index, plus the total
    token_first = np.cumsum(counts) - counts
    slot = 1 + kept_before[:-1] - kept_before[token_first][entry_token]
    take = kept & (slot <= k)
    target = base[entry_token[take]] + slot[take]
    ids_flat[target] = entry_ids[take]
    logps_flat[target] = entry_lps[take]


class TopKRecorder:
    """μ's top-K lists of one generation batch, recorded engine call by engine call and handed back aligned.

    `record` takes one engine call's output in TRL's layout and returns the sampled-token-only lists GRPOTrainer
    expects; `pop` returns the batch's `(ids, logps)` tensors, aligned with the completions the trainer scores (several
    calls, as in a tool loop, are placed by [`place_turns`]). Pure bookkeeping: [`VLLMTopKCapture`] feeds it from the
    engine.
    """

    def __init__(self, k: int):
        self.k = k
        self._records: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Per record: the prompt ids of each row as the engine saw them (a later turn's prompt carries the turns
        # before it), and each row's number of sampled tokens. `place_turns` locates the turns with them.
        self._prompts: list[list[list[int]]] = []
        self._lengths: list[list[int]] = []

    def record(self, prompt_ids, completion_ids, logprobs, token_ids):
        """Record one engine call; return its `(sampled log-probs, sampled ids)`, one entry per token."""
        if logprobs is None or token_ids is None:
            raise RuntimeError(
                "The vLLM engine returned no log-probs, so DPPO has no behavior policy μ. With `vllm_mode='server'`, "
                "make sure the server runs a vLLM version that returns `logprob_token_ids`."
            )
        ids, logps = topk_entries_to_tensors(completion_ids, logprobs, token_ids, self.k)
        self._records.append((ids, logps))
        self._prompts.append([list(p) for p in prompt_ids])
        self._lengths.append([len(c) for c in completion_ids])
        # `v != v` only for NaN, i.e. a sampled log-prob the engine did not report: GRPOTrainer expects `None` there.
        sampled_logprobs = [
            [[v] if v == v else [None] for v in row[: len(c)]]
            for c, row in zip(completion_ids, logps[..., 0].tolist(), strict=True)
        ]
        sampled_ids = [[[t] for t in row] for row in completion_ids]
        return sampled_logprobs, sampled_ids

    def reset(self) -> None:
        self._records.clear()
        self._prompts.clear()
        self._lengths.clear()

    def pop(
        self,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        prompts: Sequence[Sequence[int]] | None = None,
        completion_lengths: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the recorded `(ids, logps)` of the last generation batch, aligned with `completion_ids`.

        `completion_mask` marks the sampled tokens the loss counts (with tools: `completion_mask * tool_mask`). One
        `generate` call (single turn) maps row for row. Several calls (a tool loop) are placed by [`place_turns`],
        which needs each row's unpadded `prompts` and `completion_lengths`. Raises if any counted token has no list
        or a list for another token: a silent misalignment would anchor the trust region on another token's μ.
        """
        records, call_prompts, call_lengths = list(self._records), list(self._prompts), list(self._lengths)
        self.reset()
        if not records:
            raise RuntimeError("No vLLM generate call was recorded for this generation batch.")
        batch, length = completion_ids.shape
        if len(records) == 1:
            ids, logps = records[0]
            if ids.size(0) != batch or ids.size(1) > length:
                raise RuntimeError(
                    f"vLLM top-K batch {tuple(ids.shape[:2])} does not match completions {(batch, length)}."
                )
            pad = length - ids.size(1)
            if pad:
                ids = torch.nn.functional.pad(ids, (0, 0, 0, pad), value=PAD_ID)
                logps = torch.nn.functional.pad(logps, (0, 0, 0, pad), value=-math.inf)
        else:
            if prompts is None or completion_lengths is None:
                raise RuntimeError(
                    f"Saw {len(records)} vLLM generate calls for one generation batch (a tool loop); placing μ's "
                    "top-K lists needs the batch's prompts and completion lengths."
                )
            ids, logps = place_turns(
                [(p, n, i, lp) for p, n, (i, lp) in zip(call_prompts, call_lengths, records, strict=True)],
                prompts,
                completion_ids.tolist(),
                completion_lengths,
                self.k,
            )
        ids, logps = ids.to(completion_ids.device), logps.to(completion_ids.device)
        valid = completion_mask.bool()
        if not torch.equal(ids[..., 0][valid], completion_ids[valid]):
            raise RuntimeError("vLLM top-K log-probs are misaligned with the completion tokens the trainer scores.")
        return ids, logps


class VLLMTopKCapture(TopKRecorder):
    """Wraps one `VLLMGeneration` instance so every `generate` call also records μ's top-K.

    The wrapper shadows the instance's `generate` (the class is untouched): it sets `logprobs=k` on the instance,
    which TRL reads at call time, records the engine's lists, and returns the sampled-token-only lists GRPOTrainer
    expects.
    """

    def __init__(self, vllm_generation, k: int):
        super().__init__(k)
        self._generate = vllm_generation.generate
        vllm_generation.logprobs = k
        vllm_generation.generate = self._generate_and_record

    def _generate_and_record(self, *args, **kwargs):
        prompt_ids, completion_ids, logprobs, token_ids = self._generate(*args, **kwargs)
        sampled_logprobs, sampled_ids = self.record(prompt_ids, completion_ids, logprobs, token_ids)
        return prompt_ids, completion_ids, sampled_logprobs, sampled_ids


def place_turns(
    calls: Sequence[tuple[Sequence[Sequence[int]], Sequence[int], torch.Tensor, torch.Tensor]],
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    completion_lengths: Sequence[int],
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Assemble per-call top-K lists into `(B, T, k + 1)` tensors aligned with the final (multi-turn) completions.

    `calls[c] = (call_prompts, call_lengths, ids, logps)`: the engine's prompt and number of sampled tokens for each
    row of generate call `c`, and that call's lists from `topk_entries_to_tensors`. A call row whose prompt is
    `prompts[b] + completions[b][:o]` sampled the tokens at completion positions `o, o + 1, ...` of row `b` (GRPOTrainer
    builds later-turn prompts by concatenation and may cut the last turn to `max_completion_length`, so fewer tokens
    can remain). Rows of one call are matched in increasing batch order (the tool loop's order), each to the first
    row whose prefix and sampled continuation both agree; rows that agree on both are interchangeable. Positions no
    call sampled (tool results, padding) keep id `-1` and log-prob `-inf`. Raises if a call row matches no row.
    """
    batch = len(completions)
    width = max((len(row) for row in completions), default=0)
    ids = torch.full((batch, width, k + 1), PAD_ID, dtype=torch.long)
    logps = torch.full((batch, width, k + 1), -math.inf, dtype=torch.float32)
    full = [list(p) + list(c[:n]) for p, c, n in zip(prompts, completions, completion_lengths, strict=True)]
    for call_index, (call_prompts, call_lengths, call_ids, call_logps) in enumerate(calls):
        next_row = 0
        for r, (prompt, n_sampled) in enumerate(zip(call_prompts, call_lengths, strict=True)):
            sampled = call_ids[r, :n_sampled, 0].tolist()
            for b in range(next_row, batch):
                offset = len(prompt) - len(prompts[b])
                if offset < 0 or full[b][: len(prompt)] != list(prompt):
                    continue
                kept = max(0, min(n_sampled, completion_lengths[b] - offset))
                if full[b][len(prompt) : len(prompt) + kept] != sampled[:kept]:
                    continue
                ids[b, offset : offset + kept] = call_ids[r, :kept]
                logps[b, offset : offset + kept] = call_logps[r, :kept]
                next_row = b + 1
                break
            else:
                raise RuntimeError(
                    f"vLLM generate call {call_index}, row {r}: its prompt and sampled tokens match no completion of "
                    "the batch, so μ's top-K lists cannot be placed. Was the tool loop's prompt re-tokenized?"
                )
    return ids, logps
