"""μ's top-K lists in TRL's asynchronous trainer: from the vLLM server, through the rollout worker, into the batch.

TRL 1.16's `AsyncRolloutWorker` asks the server for the sampled token's log-prob only (`"logprobs": 0`). For the
top-K divergences (eqs. 15-16) every trained token also needs TopK(μ) ∪ {y_t}; under truncated sampling it needs
the N-entry processed lists whose finite entries are the sampler's kept set (`AsyncDPPOTrainer` then builds the loop
with `logprobs_top_k = N`; the lists have the same layout). The path, each step a subclass; the subclasses of TRL's
worker and loop (`TopKRolloutWorker`, `TopKRolloutLoop`) live in the async room, `dppo_trl.trainers.trl116.async_grpo`,
and this module holds the lists' data side:

    TopKRolloutLoop._post                  the worker's `/v1/completions` request with `"logprobs": K` and ids as
                                           `token_id:N` keys; records each turn (prompt, output ids, top-K) of the
                                           conversation the current asyncio task rolls out
    TopKRolloutLoop._generate_one          TRL's rollout of one conversation (tools, environments, re-rendering),
                                           then `rows_topk`: where each sampled token landed in TRL's training rows
    TopKRolloutLoop._score_group           TRL's scoring; each `RolloutSample` becomes a `TopKRolloutSample`
      → SampleVersionQueue / SampleMetrics (trl116/async_grpo.py): the lists ride on the sample's `metrics`
      → SampleVersionCollator: `behavior_topk` lays them out in the packed loss-term order (`token_index`)

Slot layout (as in `dppo_trl.trainers.trl116.vllm_topk` and `DPPOTrainer`): slot 0 is the sampled token y_t, slots 1..K are
TopK(μ) without y_t in rank order, unused slots id −1 and log-prob −inf.

Where the sampled tokens land: TRL reconciles a conversation's turns into rows with `_chain_to_sequences` (CLEAN
append, REALIGN of a drifted tail into context, FORK into a new row). `rows_topk` runs that same function on the same
turns with each output token's log-prob replaced by its 1-based number in the conversation's output stream, so each
trained position of a row reads off which sampled token it is; context positions get TRL's 0.0. The rows must come out
identical to TRL's (checked), and the id in slot 0 must be the row's token there (checked).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from trl.experimental.async_grpo.async_rollout_worker import (
    RolloutSample,
    TrainingSequence,
    TurnRecord,
    _chain_to_sequences,
)

from dppo_trl.trainers.trl116.vllm_topk import PAD_ID, VLLM_LOGPROB_FLOOR, topk_entries_to_tensors

__all__ = [
    "BEHAVIOR_TOPK_IDS",
    "BEHAVIOR_TOPK_LOGPS",
    "TopKRolloutSample",
    "TopKTrainingSequence",
    "behavior_topk",
    "completion_topk",
    "rows_topk",
]

# Batch keys: μ's `(rows, loss terms, K + 1)` ids and log-probs, in each row's `token_index` order, padded like it.
BEHAVIOR_TOPK_IDS = "dppo_behavior_topk_ids"
BEHAVIOR_TOPK_LOGPS = "dppo_behavior_topk_logps"

_TOKEN_ID_PREFIX = "token_id:"


def completion_topk(choice: dict[str, Any], k: int) -> tuple[np.ndarray, np.ndarray]:
    """`(ids, logps)` of shape `(T, K + 1)` from one `/v1/completions` choice requested with `"logprobs": K` and
    `"return_tokens_as_token_ids": true`: per output token, the entries `{"token_id:N": logprob}` (TopK(μ) ∪ {y_t}).

    A token without entries (`null`) gets a NaN sampled log-prob, which the loss counts as invalid; −9999 (the
    server's JSON stand-in for −inf) is read as −inf.
    """
    token_ids = [int(t) for t in choice["token_ids"]]
    top = choice["logprobs"]["top_logprobs"]
    if len(top) != len(token_ids):
        raise ValueError(f"The server returned {len(top)} top-log-prob entries for {len(token_ids)} tokens.")
    entry_ids, entry_logps = [], []
    for entries in top:
        pairs = []
        for key, logp in (entries or {}).items():
            if not key.startswith(_TOKEN_ID_PREFIX):
                raise ValueError(
                    f"Top-log-prob key {key!r} is not `token_id:N`: the request must set "
                    "`return_tokens_as_token_ids` (a token string can stand for several ids)."
                )
            value = float("nan") if logp is None else float(logp)
            pairs.append((int(key[len(_TOKEN_ID_PREFIX) :]), -math.inf if value <= VLLM_LOGPROB_FLOOR else value))
        pairs.sort(key=lambda pair: -pair[1] if pair[1] == pair[1] else math.inf)  # rank order, NaN last
        entry_ids.append([i for i, _ in pairs])
        entry_logps.append([lp for _, lp in pairs])
    ids, logps = topk_entries_to_tensors([token_ids], [entry_logps], [entry_ids], k)
    return ids[0].numpy(), logps[0].numpy()


@dataclass
class TopKTrainingSequence(TrainingSequence):
    """TRL's training row plus μ's top-K of its trained tokens (`completion_mask == 1`), in row order: `(n, K + 1)`."""

    topk_ids: np.ndarray
    topk_logps: np.ndarray


@dataclass(slots=True)
class TopKRolloutSample(RolloutSample):
    """TRL's rollout sample plus μ's top-K of its trained tokens (`completion_mask == 1`), in order: `(n, K + 1)`."""

    topk_ids: np.ndarray | None = None
    topk_logps: np.ndarray | None = None


def rows_topk(
    turns: list[tuple[TurnRecord, tuple[np.ndarray, np.ndarray]]],
    rows: list[TrainingSequence],
    fork_threshold: int,
) -> list[TopKTrainingSequence]:
    """Attach to each of TRL's training rows of one conversation μ's top-K of its trained tokens.

    `turns`: the conversation's turns in order, each with its `(T, K + 1)` top-K; `rows`: what TRL's
    `_chain_to_sequences` made of them. See the module docstring for how positions are found.
    """
    numbered, offset = [], 0
    for turn, (ids, _) in turns:
        if len(ids) != len(turn.output_ids):
            raise ValueError(f"A turn has {len(turn.output_ids)} output tokens but top-K for {len(ids)}.")
        count = len(turn.output_ids)
        numbered.append(dataclasses.replace(turn, output_log_probs=[float(offset + i + 1) for i in range(count)]))
        offset += count
    layout, _ = _chain_to_sequences(numbered, "topk-layout", fork_threshold)
    if len(layout) != len(rows) or any(
        a.input_ids != b.input_ids or a.completion_mask != b.completion_mask for a, b in zip(layout, rows)
    ):
        raise RuntimeError(
            "The rollout's recorded turns do not reconcile into the rows TRL built, so μ's top-K cannot be placed "
            "(see tests/trl_contract.py, ASYNC_WORKER_*)."
        )
    all_ids = np.concatenate([ids for _, (ids, _) in turns]) if turns else np.zeros((0, 1), dtype=np.int64)
    all_logps = np.concatenate([logps for _, (_, logps) in turns]) if turns else np.zeros((0, 1), dtype=np.float32)
    out = []
    for numbers, row in zip(layout, rows):
        trained = np.asarray(row.completion_mask) == 1
        index = np.asarray(numbers.old_log_probs, dtype=np.float64)[trained].astype(np.int64) - 1
        if (index < 0).any():
            raise RuntimeError("A trained token of a rollout row is no sampled token: μ's top-K cannot be placed.")
        ids, logps = all_ids[index], all_logps[index]
        if not np.array_equal(ids[:, 0], np.asarray(row.input_ids)[trained]):
            raise RuntimeError("μ's top-K lists are misaligned with the tokens of the rollout row.")
        fields = {f.name: getattr(row, f.name) for f in dataclasses.fields(TrainingSequence)}
        out.append(TopKTrainingSequence(**fields, topk_ids=ids, topk_logps=logps))
    return out


def behavior_topk(samples_per_row: list[list[dict[str, Any]]], batch: dict[str, torch.Tensor]):
    """μ's top-K of a packed micro-batch as `(ids, logps)` of shape `(rows, loss terms, K + 1)`, in each row's
    `token_index` order and padded to its width (−1 / −inf); `None` when no sample carries top-K.

    `TreeRow.pack` takes a sample's loss terms at its positions p ≥ 1 with `completion_mask[p] == 1`, samples in row
    order; each sample's lists (`metrics.behavior_topk`) follow its trained tokens in order, so they are laid out the
    same way. Raises when some samples carry top-K and others not, or when slot 0 is not the packed target token.
    """
    carried = [sample["metrics"].behavior_topk for row in samples_per_row for sample in row]
    if all(topk is None for topk in carried):
        return None
    if any(topk is None for topk in carried):
        raise RuntimeError("Some rollout samples carry μ's top-K and others do not; they cannot share a loss.")
    width = batch["token_index"].shape[-1]
    slots = carried[0][0].shape[-1]
    ids = torch.full((len(samples_per_row), width, slots), PAD_ID, dtype=torch.long)
    logps = torch.full((len(samples_per_row), width, slots), -math.inf, dtype=torch.float32)
    for r, row in enumerate(samples_per_row):
        row_ids, row_logps = [], []
        for sample in row:
            sample_ids, sample_logps = sample["metrics"].behavior_topk
            mask = np.asarray(sample["completion_mask"])
            skip = 1 if mask.size and mask[0] else 0  # position 0 predicts nothing, so it is never a loss term
            row_ids.append(sample_ids[skip:])
            row_logps.append(sample_logps[skip:])
        row_ids_t = torch.as_tensor(np.concatenate(row_ids), dtype=torch.long)
        terms = int((batch["token_index"][r] >= 0).sum())
        if row_ids_t.shape[0] != terms:
            raise RuntimeError(f"Row {r} has {terms} loss terms but μ's top-K for {row_ids_t.shape[0]} tokens.")
        targets = batch["shift_labels"][r][batch["token_index"][r][:terms]]
        if not torch.equal(row_ids_t[:, 0], targets):
            raise RuntimeError(f"μ's top-K lists of row {r} are misaligned with its packed target tokens.")
        ids[r, :terms] = row_ids_t
        logps[r, :terms] = torch.as_tensor(np.concatenate(row_logps), dtype=torch.float32)
    return ids, logps
