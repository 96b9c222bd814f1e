"""`ContextFit.budgets`: each prompt's `max_tokens` capped at the room left in the engine's context, counted, and a
prompt with no room ending its rollout inside the tool loop only. The engine-side behaviour (colocate, server, async,
on each vLLM version) is tested with real engines in the `-k outgrow` tests (docs/agents.md)."""

import pytest

from dppo_trl.trainers.trl116.context_fit import ContextFit


def test_budgets_cap_at_the_room_left_and_count_each_completion():
    fit = ContextFit(max_model_len=100)
    assert fit.budgets([10, 60, 99], [50, 50, 50], copies=4) == [50, 40, 1]
    assert (fit.clamped_turns, fit.ended_turns) == (8, 0)  # two prompts cut, four completions each
    assert fit.budgets([30], [None]) == [70]  # "up to the context" is the room itself, not a cut
    assert fit.clamped_turns == 8
    fit.reset()
    assert (fit.clamped_turns, fit.ended_turns) == (0, 0)


def test_no_room_raises_outside_the_tool_loop_and_ends_the_rollout_inside():
    fit = ContextFit(max_model_len=100)
    with pytest.raises(ValueError, match="A prompt of 100 tokens leaves no room .* context of 100 tokens"):
        fit.budgets([100], [8])
    with fit.tool_loop():
        assert fit.budgets([20, 100, 130], [8, 8, 8]) == [8, 0, 0]
        with pytest.raises(ValueError, match="A prompt of 100 tokens"):
            fit.budgets([100], [8], can_end=False)  # the colocated engine cannot be handed an empty turn
    assert fit.ended_turns == 2
    with pytest.raises(ValueError):
        fit.budgets([100], [8])  # the loop's span is over


def test_a_process_without_an_engine_counts_nothing_and_cannot_fit():
    fit = ContextFit()
    assert (fit.clamped_turns, fit.ended_turns) == (0, 0)
    with pytest.raises(RuntimeError, match="no engine context length"):
        fit.budgets([1], [1])
    with pytest.raises(ValueError, match="must be positive"):
        ContextFit(0)
