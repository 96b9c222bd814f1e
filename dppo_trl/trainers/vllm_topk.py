"""Behavior-policy (μ) capture: the rollout engine's sampled-token and top-K log-probs, as tensors.

TRL's vLLM backend returns, per completion token, a list of `(token_id, logprob)` entries sorted by rank. With
`logprobs=K` the sampled token is always among them but is *not* necessarily first, while `GRPOTrainer` reads entry 0
as the sampled token's log-prob (the "lp[0] trap"). [`VLLMTopKCapture`] asks vLLM for K entries, keeps them for the
loss, and hands the trainer back the `logprobs=0` contract: one entry per token, the sampled one, found by id.

Slot layout of the `(B, T, K + 1)` tensors built here: slot 0 is the sampled token y_t; slots 1..K are TopK(μ) without
y_t, in rank order; unused slots hold id `-1` and log-prob `-inf`. So the slots list the distinct tokens of
TopK(μ) ∪ {y_t}, as `dppo_trl.core.functional.topk_tv/topk_kl` expect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

PAD_ID = -1


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


class VLLMTopKCapture:
    """Wraps one `VLLMGeneration` instance so every `generate` call also records μ's top-K.

    The wrapper shadows the instance's `generate` (the class is untouched): it sets `logprobs=k` on the instance,
    which TRL reads at call time, records the `(ids, logps)` tensors, and returns the sampled-token-only lists
    GRPOTrainer expects.
    """

    def __init__(self, vllm_generation, k: int):
        self.k = k
        self._generation = vllm_generation
        self._generate = vllm_generation.generate
        self._records: list[tuple[torch.Tensor, torch.Tensor]] = []
        vllm_generation.logprobs = k
        vllm_generation.generate = self._generate_and_record

    def _generate_and_record(self, *args, **kwargs):
        prompt_ids, completion_ids, logprobs, token_ids = self._generate(*args, **kwargs)
        if logprobs is None or token_ids is None:
            raise RuntimeError(
                "The vLLM engine returned no log-probs, so DPPO has no behavior policy μ. With `vllm_mode='server'`, "
                "make sure the server runs a vLLM version that returns `logprob_token_ids`."
            )
        ids, logps = topk_entries_to_tensors(completion_ids, logprobs, token_ids, self.k)
        self._records.append((ids, logps))
        # `v != v` only for NaN, i.e. a sampled log-prob the engine did not report: GRPOTrainer expects `None` there.
        sampled_logprobs = [
            [[v] if v == v else [None] for v in row[: len(c)]]
            for c, row in zip(completion_ids, logps[..., 0].tolist(), strict=True)
        ]
        sampled_ids = [[[t] for t in row] for row in completion_ids]
        return prompt_ids, completion_ids, sampled_logprobs, sampled_ids

    def reset(self) -> None:
        self._records.clear()

    def pop(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the recorded `(ids, logps)` of the last generation batch, aligned with `completion_ids`.

        Raises if the batch was produced by several `generate` calls or does not match the completions the trainer
        scores: a silent misalignment would anchor the trust region on another token's μ.
        """
        if len(self._records) != 1:
            count = len(self._records)
            self._records.clear()
            raise RuntimeError(
                f"Expected one vLLM generate call per generation batch, saw {count}. Top-K DPPO does not support "
                "multi-turn tool calling; use a binary divergence with tools."
            )
        ids, logps = self._records.pop()
        batch, length = completion_ids.shape
        if ids.size(0) != batch or ids.size(1) > length:
            raise RuntimeError(
                f"vLLM top-K batch {tuple(ids.shape[:2])} does not match completions {(batch, length)}."
            )
        pad = length - ids.size(1)
        if pad:
            ids = torch.nn.functional.pad(ids, (0, 0, 0, pad), value=PAD_ID)
            logps = torch.nn.functional.pad(logps, (0, 0, 0, pad), value=-math.inf)
        ids, logps = ids.to(completion_ids.device), logps.to(completion_ids.device)
        valid = completion_mask.bool()
        if not torch.equal(ids[..., 0][valid], completion_ids[valid]):
            raise RuntimeError("vLLM top-K log-probs are misaligned with the completion tokens the trainer scores.")
        return ids, logps
