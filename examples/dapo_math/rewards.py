"""Rule-based math rewards for DAPO-Math-style RL: final-answer accuracy (via `math-verify`) and answer format.

Both functions follow TRL's reward-function contract: `reward(completions, **dataset_columns) -> list[float]`, where a
completion is a plain string or, for conversational prompts, a list of message dicts. They never raise on model
output: garbage, empty, huge or unparsable answers score 0.0.

The answer is taken from the last `Answer: ...` line (DAPO-Math-17k asks for one) or, failing that, the last
`\\boxed{...}` (nested braces handled). Only that short answer string reaches the symbolic checker, whose work is
bounded by a length cap and a timeout, so a pathological 8k-token completion costs microseconds.
"""

from __future__ import annotations

import logging
import re
import threading
from functools import lru_cache

__all__ = [
    "accuracy_reward",
    "answers_match",
    "completion_text",
    "extract_boxed",
    "extract_final_answer",
    "format_reward",
]

logger = logging.getLogger(__name__)

# Answers longer than this are not sent to sympy (AIME/DAPO answers are integers; real answers are short).
MAX_ANSWER_CHARS = 256
# Only the tail of a completion can hold its final answer; scanning a bounded tail keeps extraction O(1) per sample.
MAX_TAIL_CHARS = 4096
VERIFY_TIMEOUT_SECONDS = 2

_ANSWER_LINE = re.compile(r"answer\s*[:：]\s*(.*)", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def completion_text(completion) -> str:
    """Text of a TRL completion: a string, or the concatenated content of a list of message dicts."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts = []
    try:
        for message in completion:
            content = message.get("content", "") if isinstance(message, dict) else message
            if isinstance(content, list):  # multimodal-style content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(content if isinstance(content, str) else str(content or ""))
    except (TypeError, AttributeError):
        return str(completion)
    return "".join(parts)


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), matching nested braces; None if there is none.

    An unbalanced last box (the completion was cut off) yields None rather than a truncated answer. `\\boxed 5`
    (no braces) yields "5".
    """
    matches = list(_BOXED.finditer(text))
    for match in reversed(matches):
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                if text[i] == "{":
                    depth += 1
                elif text[i] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1 : i]
            continue  # unbalanced: try an earlier, complete box
        token = re.match(r"[^\s$]+", text[start:])
        if token:
            return token.group(0)
    return None


def _clean(answer: str) -> str:
    answer = answer.strip()
    # Markdown and math delimiters around the answer line.
    answer = answer.strip("*").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) >= len(left) + len(right):
            answer = answer[len(left) : len(answer) - len(right)].strip()
    return answer.rstrip(".").strip()


def extract_final_answer(text: str) -> str | None:
    """The final answer of a completion: the last `Answer:` line, else the last `\\boxed{}`; None if neither.

    A box inside the answer line (`Answer: \\boxed{5}`) is unwrapped.
    """
    if not text:
        return None
    tail = text[-MAX_TAIL_CHARS:]
    lines = [m for m in _ANSWER_LINE.finditer(tail)]
    if lines:
        answer = lines[-1].group(1).split("\n", 1)[0]
        boxed = extract_boxed(answer)
        answer = _clean(boxed if boxed is not None else answer)
        if answer:
            return answer
    boxed = extract_boxed(tail)
    if boxed is not None and boxed.strip():
        return _clean(boxed)
    return None


def _normalize(answer: str) -> str:
    """Cheap textual normal form for a fast exact-match path (spaces, thousands separators, `\\text{}`, `\\!`)."""
    answer = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", answer)
    answer = re.sub(r"\\(?:left|right|displaystyle|!|,|;|\s)", "", answer)
    answer = answer.replace("dfrac", "frac").replace("tfrac", "frac").replace("^\\circ", "").replace("^{\\circ}", "")
    answer = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", answer)
    return re.sub(r"\s+", "", answer).rstrip(".").lower()


def _as_number(answer: str) -> float | None:
    if _NUMBER.fullmatch(answer):
        try:
            return float(answer)
        except ValueError:
            return None
    return None


def _symbolic_match(pred: str, truth: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # signal.alarm (math-verify's timeout) only works in the main thread; elsewhere the length cap is the bound.
    timeout = VERIFY_TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(f"\\boxed{{{truth}}}", extraction_config=config, parsing_timeout=timeout)
    guess = parse(f"\\boxed{{{pred}}}", extraction_config=config, parsing_timeout=timeout)
    if not gold or not guess:
        return False
    return bool(verify(gold, guess, timeout_seconds=timeout))


@lru_cache(maxsize=65536)
def answers_match(pred: str, truth: str) -> bool:
    """Whether an extracted answer equals the ground truth: textual, numeric, then symbolic (math-verify) checks."""
    pred_n, truth_n = _normalize(pred), _normalize(truth)
    if not pred_n or not truth_n:
        return False
    if pred_n == truth_n:
        return True
    pred_num, truth_num = _as_number(pred_n), _as_number(truth_n)
    if pred_num is not None and truth_num is not None:
        return abs(pred_num - truth_num) <= 1e-9 * max(1.0, abs(truth_num))
    if len(pred) > MAX_ANSWER_CHARS or len(truth) > MAX_ANSWER_CHARS:
        return False
    try:
        return _symbolic_match(pred, truth)
    except Exception:  # noqa: BLE001 - a reward must never crash training on odd model output
        logger.debug("math-verify failed on %r vs %r", pred, truth, exc_info=True)
        return False


def accuracy_reward(completions: list, ground_truth: list | None = None, **kwargs) -> list[float]:
    """1.0 when the completion's final answer (`Answer:` line or `\\boxed{}`) equals `ground_truth`, else 0.0.

    `ground_truth` is the dataset column of that name (see `dapo_math.data`); a DAPO-style `reward_model` column
    (`{"ground_truth": ...}`) is accepted as a fallback.
    """
    if ground_truth is None:
        reward_model = kwargs.get("reward_model")
        if reward_model is None:
            raise ValueError("accuracy_reward needs a `ground_truth` (or DAPO `reward_model`) dataset column")
        ground_truth = [rm.get("ground_truth") if isinstance(rm, dict) else rm for rm in reward_model]
    rewards = []
    for completion, truth in zip(completions, ground_truth):
        try:
            answer = extract_final_answer(completion_text(completion))
            ok = answer is not None and truth is not None and answers_match(answer, str(truth).strip())
        except Exception:  # noqa: BLE001 - never crash training on odd model output
            ok = False
        rewards.append(1.0 if ok else 0.0)
    return rewards


def format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion states a final answer (an `Answer:` line or a `\\boxed{}`), else 0.0."""
    rewards = []
    for completion in completions:
        try:
            ok = extract_final_answer(completion_text(completion)) is not None
        except Exception:  # noqa: BLE001
            ok = False
        rewards.append(1.0 if ok else 0.0)
    return rewards
