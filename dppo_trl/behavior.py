"""Behaviour-policy (μ) capture: the rollout engine's sampled-token and top-K log-probs, as tensors.

TRL's vLLM backend returns, per completion token, a list of `(token_id, logprob)` entries sorted by rank. With
`logprobs=K` the sampled token is always among them but is *not* necessarily first, while `GRPOTrainer` reads entry 0
as the sampled token's log-prob (the "lp[0] trap"). [`VLLMTopKCapture`] asks vLLM for K entries, keeps them for the
loss, and hands the trainer back the `logprobs=0` contract: one entry per token, the sampled one, found by id.

Slot layout of the `(B, T, K + 1)` tensors built here: slot 0 is the sampled token y_t; slots 1..K are TopK(μ) without
y_t, in rank order; unused slots hold id `-1` and log-prob `-inf`. So the slots list the distinct tokens of
TopK(μ) ∪ {y_t}, as `dppo_trl.trust_region.topk_tv/topk_kl` expect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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

    A `None` log-prob (the engine reported NaN) and a sampled token missing from the entries both become NaN in
    slot 0, so the trainer can count and mask them. Positions past a row's end are padding (`-1`, `-inf`).
    """
    length = max((len(row) for row in completion_ids), default=0) if length is None else length
    batch = len(completion_ids)
    ids = torch.full((batch, length, k + 1), PAD_ID, dtype=torch.long)
    logps = torch.full((batch, length, k + 1), -math.inf, dtype=torch.float32)
    # One flat pass building Python lists, then a single tensor copy per row: much cheaper than per-element writes.
    for b, (row_ids, row_lps, row_tids) in enumerate(zip(completion_ids, logprobs, token_ids, strict=True)):
        n = len(row_ids)
        if n == 0:
            continue
        flat_ids: list[list[int]] = []
        flat_lps: list[list[float]] = []
        for sampled, entry_lps, entry_ids in zip(row_ids, row_lps, row_tids, strict=True):
            slot_ids = [sampled]
            slot_lps = [math.nan]
            for tid, lp in zip(entry_ids, entry_lps, strict=True):
                value = math.nan if lp is None else lp
                if tid == sampled:
                    slot_lps[0] = value
                elif len(slot_ids) <= k:
                    slot_ids.append(tid)
                    slot_lps.append(value)
            pad = k + 1 - len(slot_ids)
            flat_ids.append(slot_ids + [PAD_ID] * pad)
            flat_lps.append(slot_lps + [-math.inf] * pad)
        ids[b, :n] = torch.tensor(flat_ids, dtype=torch.long)
        logps[b, :n] = torch.tensor(flat_lps, dtype=torch.float32)
    return ids, logps


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
        self._records: list[tuple[list[list[int]], torch.Tensor, torch.Tensor]] = []
        vllm_generation.logprobs = k
        vllm_generation.generate = self._generate_and_record

    def _generate_and_record(self, *args, **kwargs):
        prompt_ids, completion_ids, logprobs, token_ids = self._generate(*args, **kwargs)
        if logprobs is None or token_ids is None:
            raise RuntimeError(
                "The vLLM engine returned no log-probs, so DPPO has no behaviour policy μ. With `vllm_mode='server'`, "
                "make sure the server runs a vLLM version that returns `logprob_token_ids`."
            )
        ids, logps = topk_entries_to_tensors(completion_ids, logprobs, token_ids, self.k)
        self._records.append(([list(row) for row in completion_ids], ids, logps))
        sampled_logprobs = [
            [[None if math.isnan(v) else v] for v in row[: len(c), 0].tolist()]
            for c, row in zip(completion_ids, logps, strict=True)
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
        _, ids, logps = self._records.pop()
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
