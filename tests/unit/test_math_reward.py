"""Math rewards: answer extraction, equivalence, TRL's completion shapes, and robustness to garbage."""

import pytest

from dapo_math.rewards import (
    accuracy_reward,
    answers_match,
    completion_text,
    extract_boxed,
    extract_final_answer,
    format_reward,
)

CORRECT = [
    ("Answer: 7", "7"),
    ("Some work\nanswer: 7.", "7"),
    ("Answer: $7$", "7"),
    ("**Answer:** 7", "7"),
    ("Answer: \\boxed{7}", "7"),
    ("So the result is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("Answer: 1/2", "\\frac12"),
    ("Answer: \\dfrac{3}{4}", "\\frac{3}{4}"),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}"),
    ("Answer: 1,000", "1000"),
    ("Answer: 5 \\text{ cm}", "5"),
    ("Answer: 30^\\circ", "30"),
    ("\\boxed{{a}^{2}}", "a^2"),
    ("\\boxed{x^{2}+\\frac{1}{2}} is it", "x^2+1/2"),
    ("\\boxed{3} at first, but\nAnswer: 4", "4"),
    ("Answer: 012", "12"),
    ("Answer: -3", "-3"),
    ("Answer: \\pi*2", "2\\pi"),
    ("\\boxed 7", "7"),
    ("Answer: (1, 2)", "(1,2)"),
    ("Answer：7", "7"),  # full-width colon
    ("x" * 200_000 + "\nAnswer: 7", "7"),
]

WRONG = [
    ("Answer: 8", "7"),
    ("", "7"),
    ("\\boxed{7", "7"),  # cut-off box
    ("}}}{{{\\boxed{", "7"),
    ("日本語 Answer: 七", "7"),
    ("Answer: " + "(" * 5000, "7"),
    ("Answer: 7\nAnswer: 8", "7"),  # the last answer counts
    ("The answer is 7", "7"),  # DAPO's format asks for `Answer:`; no `\boxed{}` either
    ("Answer: \\frac{1}{", "\\frac{1}{2}"),
    ("\x00\x01\x02 Answer: \ud800", "7"),
]


@pytest.mark.parametrize("completion,truth", CORRECT)
def test_correct_answers_score_one(completion, truth):
    assert accuracy_reward([completion], ground_truth=[truth]) == [1.0]


@pytest.mark.parametrize("completion,truth", WRONG)
def test_wrong_or_garbage_answers_score_zero(completion, truth):
    assert accuracy_reward([completion], ground_truth=[truth]) == [0.0]


def test_nested_braces_and_unbalanced_boxes():
    assert extract_boxed("\\boxed{\\frac{a}{b^{2}}}") == "\\frac{a}{b^{2}}"
    assert extract_boxed("\\boxed{1} then \\boxed{\\{2\\}}") is not None
    assert extract_boxed("first \\boxed{5} then cut \\boxed{6") == "5"  # falls back to the last complete box
    assert extract_boxed("no box here") is None
    assert extract_final_answer("Answer: \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_final_answer("   ") is None


def test_conversational_and_plain_completions():
    conversational = [[{"role": "assistant", "content": "Answer: 7"}]]
    parts = [[{"role": "assistant", "content": [{"type": "text", "text": "Answer: 7"}]}]]
    assert accuracy_reward(conversational, ground_truth=["7"]) == [1.0]
    assert accuracy_reward(parts, ground_truth=["7"]) == [1.0]
    assert completion_text(None) == ""
    # DAPO rows carry the truth in `reward_model`; accepted when no `ground_truth` column exists.
    assert accuracy_reward(["Answer: 7"], reward_model=[{"ground_truth": "7", "style": "rule-lang"}]) == [1.0]


def test_non_string_inputs_never_crash():
    assert accuracy_reward([None, 5, {"content": "Answer: 3"}, ["Answer: 3"]], ground_truth=["3", None, 3, "3"]) == [
        0.0,
        0.0,
        1.0,
        1.0,
    ]
    assert format_reward([None, 5, "Answer: 1", "\\boxed{2}", "nothing", [{"content": "Answer: x"}]]) == [
        0.0,
        0.0,
        1.0,
        1.0,
        0.0,
        1.0,
    ]


def test_pathological_expression_is_bounded():
    # Parsing/verifying such towers can hang sympy; the timeout turns it into a plain 0.
    assert accuracy_reward(["Answer: 10^{10^{10^{10^{10}}}}"], ground_truth=["7"]) == [0.0]
    assert not answers_match("a" * 10_000, "7")


def test_missing_ground_truth_column_is_an_error():
    with pytest.raises(ValueError, match="ground_truth"):
        accuracy_reward(["Answer: 1"])
