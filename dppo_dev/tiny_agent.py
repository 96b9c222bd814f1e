"""A tiny tool-calling task, and the SFT that turns a random tiny Qwen3 into an imperfect tool-using agent.

Used by `scripts/make_tiny_agent_model.py` (which builds the committed `examples/tiny_agent_model/` and
`examples/data/tiny_agent/`), by `examples/train_tool_agent.py` and by the agentic tests.

**Task.** "What is 47*38?" for two-digit factors. A two-layer model cannot multiply, so the answer is decided by the
`multiply` tool: the agent must call it with the right arguments, read the tool result, and answer `Answer: 1786`.

**Format.** The tokenizer is the byte-level one of `dppo_dev.tiny_models` with Qwen3's chat template, read from TRL's
installed package data (`trl/chat_templates/qwen3.jinja`), so TRL recognises it by exact string match: TRL attaches
its Qwen3 response parser (`add_response_schema`), `supports_tool_calling` holds, and the training (prefix-preserving)
variant TRL swaps in renders tool results exactly as the SFT data does. Tool calls are Qwen3's
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

**Imperfect on purpose.** The SFT targets are drawn afresh for each example from a mixture, so the model starts like a
base agent with room for RL:

- a well-formed call with the right arguments, then `Answer: <tool result>` after the tool response;
- a malformed call (broken JSON or a missing closing tag), which TRL's parser leaves as plain text, so no tool runs;
- a call with a wrong argument (one digit changed), which yields a wrong tool result and a wrong answer;
- an answer without the tool (a wrong guess near the product).

Every reply opens with Qwen3's empty thinking block (`<think>\n\n</think>\n\n`, see `THINK_PREFIX`).
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
import time
from collections.abc import Sequence
from importlib.resources import files

import torch

from dppo_dev.tiny_math import sft_step

__all__ = [
    "AGENT_SOURCE",
    "AGENT_TAG_TOKENS",
    "THINK_PREFIX",
    "SFT_MIXTURE",
    "agent_reward",
    "build_agent_tokenizer",
    "encode_episode",
    "make_agent_problems",
    "multiply",
    "qwen3_chat_template",
    "rollout_stats",
    "sample_episode_text",
    "split_problems",
    "train_agent_sft",
]

AGENT_SOURCE = "tiny_agent"
# Shares of the SFT mixture (they sum to 1): what the pretrained agent does before RL, roughly.
SFT_MIXTURE = {"correct": 0.5, "malformed": 0.2, "wrong_args": 0.15, "no_tool": 0.15}
_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)")


def multiply(a: int, b: int) -> int:
    """
    Multiply a by b.

    Args:
        a: first factor
        b: second factor
    """
    return a * b


def qwen3_chat_template() -> str:
    """Qwen3's chat template as bundled with the installed TRL (read, not copied, so TRL's exact match holds)."""
    return files("trl").joinpath("chat_templates", "qwen3.jinja").read_text(encoding="utf-8")


# Every reply opens with an empty thinking block, as Qwen3 writes one in thinking mode: TRL's training template renders
# past assistant turns with it, so a conversation re-rendered from messages (the async rollout worker does this each
# turn) reproduces the sampled tokens exactly.
THINK_PREFIX = "<think>\n\n</think>\n\n"
# Qwen3's tags, one token each (as in Qwen3's own vocabulary) so replies are short enough to learn on a CPU.
AGENT_TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def _tool_system_text(tokenizer) -> str:
    """The system text Qwen3's template renders for `tools=[multiply]` (its tool boilerplate and the tool schema)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[multiply], tokenize=False)
    head = "<|im_start|>system\n"
    if not rendered.startswith(head):
        raise RuntimeError(f"unexpected Qwen3 tool rendering: {rendered[:80]!r}")
    return rendered[len(head) : rendered.index("<|im_end|>")]


def build_agent_tokenizer():
    """The byte-level tokenizer of `dppo_dev.tiny_models` with Qwen3's chat template and a few added tokens.

    Added (non-special) tokens, after the 259 byte/ChatML ids: Qwen3's tool tags, and the whole tool system prompt
    for `tools=[multiply]` as ONE token. The rendered text is unchanged (TRL still matches the template); the prompt
    shrinks from ~700 byte tokens to ~25, which is what makes SFT and RL on it fit a 2-core CPU. Any other text,
    including a different tool schema, still tokenizes byte by byte.
    """
    from dppo_dev.tiny_models import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = qwen3_chat_template()
    tokenizer.add_tokens([*AGENT_TAG_TOKENS, _tool_system_text(tokenizer)])
    return tokenizer


def make_agent_problems(low: int = 10, high: int = 99) -> list[dict]:
    """Every `a*b` with `low <= a <= b <= high`, as conversational rows with the answer in `answer` (a string)."""
    rows = []
    for a in range(low, high + 1):
        for b in range(a, high + 1):
            rows.append({"prompt": [{"role": "user", "content": f"What is {a}*{b}?"}], "answer": str(a * b)})
    return rows


def split_problems(rows: Sequence[dict], num_test: int = 200, seed: int = 0) -> tuple[list, list]:
    """Deterministic shuffled train/test split with `num_test` held-out problems."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows[num_test:], rows[:num_test]


def _final_text(completion) -> str:
    """The text of the last assistant message (conversational completions) or the completion itself."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role") == "assistant":
            content = message.get("content") or ""
            return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)
    return ""


def agent_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the final assistant message says `Answer: <the product>`, else 0.0 (TRL reward-function signature)."""
    rewards = []
    for completion, truth in zip(completions, answer, strict=True):
        match = _ANSWER_RE.search(_final_text(completion))
        rewards.append(1.0 if match is not None and match.group(1) == str(truth) else 0.0)
    return rewards


def _call_text(a: int, b: int) -> str:
    return "<tool_call>\n" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}) + "\n</tool_call>"


def _malformed_call_text(a: int, b: int, rng: random.Random) -> str:
    good = _call_text(a, b)
    kind = rng.randrange(3)
    if kind == 0:  # unbalanced JSON
        return good.replace("}}", "}", 1)
    if kind == 1:  # no closing tag
        return good.replace("\n</tool_call>", "")
    return good.replace('"arguments"', "arguments")  # unquoted key


def _wrong_digit(n: int, rng: random.Random) -> int:
    digits = list(str(n))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0")]
    digits[i] = rng.choice(choices)
    return int("".join(digits))


def _suffix_text(tokenizer, template: str, result: str) -> str:
    """The text TRL splices after a tool call: the tool turn and the next assistant header.

    Rendered the way TRL's `_get_tool_suffix_ids` does (with and without the tool message, cut after the EOS that
    closes the assistant turn), so SFT sees exactly the tokens RL will.
    """
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 1, "b": 2}}}
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    kwargs = dict(tokenize=False, chat_template=template)
    before = tokenizer.apply_chat_template(history, **kwargs)
    after = tokenizer.apply_chat_template(
        history + [{"role": "tool", "name": "multiply", "content": result}], add_generation_prompt=True, **kwargs
    )
    cut = before.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)
    if after[:cut] != before[:cut]:
        raise RuntimeError("chat template is not prefix-preserving around a tool result")
    return after[cut:]


def encode_episode(tokenizer, template: str, prompt_ids: list[int], a: int, b: int, kind: str, rng) -> tuple:
    """Token ids and labels (-100 outside the model's own turns) of one SFT episode of the given mixture `kind`."""
    eos = [tokenizer.eos_token_id]

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def reply(text: str) -> list[int]:
        return enc(THINK_PREFIX + text) + eos

    if kind == "no_tool":
        guess = a * b + rng.choice([-1, 1]) * rng.randint(1, max(2, a * b // 10))
        turns = [reply(f"Answer: {guess}")]
    elif kind == "malformed":
        turns = [reply(_malformed_call_text(a, b, rng))]
    else:
        ca, cb = (
            (a, b)
            if kind == "correct"
            else ((_wrong_digit(a, rng), b) if rng.random() < 0.5 else (a, _wrong_digit(b, rng)))
        )
        result = str(ca * cb)
        turns = [
            reply(_call_text(ca, cb)),
            enc(_suffix_text(tokenizer, template, result)),
            reply(f"Answer: {result}"),
        ]
    input_ids, labels = list(prompt_ids), [-100] * len(prompt_ids)
    for i, ids in enumerate(turns):
        input_ids += ids
        labels += [-100] * len(ids) if i == 1 else ids  # the spliced tool turn is not the model's
    return input_ids, labels


def train_agent_sft(
    model,
    tokenizer,
    rows: Sequence[dict],
    steps: int = 300,
    batch_size: int = 16,
    learning_rate: float = 3e-3,
    mixture: dict[str, float] | None = None,
    seed: int = 0,
    log_every: int = 50,
) -> dict:
    """SFT `model` in place on episodes drawn from `mixture`; returns a short summary. Seeded and deterministic."""
    from trl.chat_template_utils import get_training_chat_template

    mixture = dict(SFT_MIXTURE if mixture is None else mixture)
    kinds, weights = list(mixture), list(mixture.values())
    template = get_training_chat_template(tokenizer)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    prompts = {}
    for row in rows:
        prompts[row["prompt"][0]["content"]] = tokenizer.apply_chat_template(
            row["prompt"], tools=[multiply], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    parsed = [
        (row["prompt"][0]["content"], *map(int, re.findall(r"\d+", row["prompt"][0]["content"]))) for row in rows
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    pad_id = tokenizer.pad_token_id
    model.train()
    start, losses = time.time(), []
    for step in range(steps):
        batch = []
        for _ in range(batch_size):
            question, a, b = rng.choice(parsed)
            kind = rng.choices(kinds, weights)[0]
            batch.append(encode_episode(tokenizer, template, prompts[question], a, b, kind, rng))
        losses.append(sft_step(model, batch, pad_id, optimizer, scheduler))
        if log_every and (step + 1) % log_every == 0:
            recent = sum(losses[-log_every:]) / len(losses[-log_every:])
            print(f"step {step + 1}/{steps}  loss {recent:.4f}  ({time.time() - start:.0f}s)", flush=True)
    model.eval()
    tail = losses[-min(50, len(losses)) :]
    return {"steps": steps, "final_loss": sum(tail) / len(tail), "seconds": time.time() - start}


@torch.no_grad()
def _generate(model, tokenizer, ids_list: list[list[int]], temperature: float, max_new_tokens: int) -> list[list[int]]:
    width = max(len(ids) for ids in ids_list)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in ids_list])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in ids_list])
    sampling = {"temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 else {}
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=temperature > 0,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
        **sampling,
    )
    result = []
    for row in out[:, width:].tolist():
        row = row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row
        result.append([t for t in row if t != pad])
    return result


def sample_episode_text(
    model,
    tokenizer,
    rows: Sequence[dict],
    temperature: float = 1.0,
    max_new_tokens: int = 80,
    seed: int = 0,
    max_tool_calls: int = 1,
    tool=multiply,
) -> list[dict]:
    """Run each row's episode with transformers generation and the real tool, the way TRL's tool loop does.

    Up to `max_tool_calls` tool rounds: a reply with a parsed call gets the tool result spliced after it (or TRL's
    error message when the tool raises) and the row generates again. Returns one record per row: the first reply's
    text, whether a tool ran, the number of assistant turns, the final reply's content and the reward. Used by the
    build script's sanity check, the rebuild test (greedy with `temperature=0`) and `examples/train_tool_agent.py`.
    """
    from trl.chat_template_utils import add_response_schema, get_training_chat_template, parse_response

    if getattr(tokenizer, "response_template", None) is None:
        tokenizer = add_response_schema(copy.deepcopy(tokenizer))  # TRL's Qwen3 parser, as its trainers attach
    torch.manual_seed(seed)
    template = get_training_chat_template(tokenizer)
    inputs = [
        tokenizer.apply_chat_template(r["prompt"], tools=[tool], add_generation_prompt=True, return_dict=False)
        for r in rows
    ]
    records = [{"first": None, "tool_called": False, "turns": 0, "final": ""} for _ in rows]
    active = list(range(len(rows)))
    for round_index in range(max_tool_calls + 1):
        replies = _generate(model, tokenizer, [inputs[i] for i in active], temperature, max_new_tokens)
        still_calling = []
        for i, ids in zip(active, replies, strict=True):
            message = parse_response(tokenizer, ids, prefix=inputs[i], tools=[tool])
            record = records[i]
            record["turns"] += 1
            if record["first"] is None:
                record["first"] = tokenizer.decode(ids)
            record["final"] = message.get("content") or ""
            calls = message.get("tool_calls") or []
            if calls and round_index < max_tool_calls:
                record["tool_called"] = True
                try:
                    result = str(tool(**calls[0]["function"]["arguments"]))
                except Exception as error:  # wrong argument names, or the tool failed: TRL reports the error
                    result = str({"error": str(error)})
                suffix = tokenizer(_suffix_text(tokenizer, template, result), add_special_tokens=False)["input_ids"]
                inputs[i] = inputs[i] + ids + suffix
                still_calling.append(i)
        active = still_calling
        if not active:
            break
    rewards = agent_reward([r["final"] for r in records], [r["answer"] for r in rows])
    for record, reward in zip(records, rewards, strict=True):
        record["reward"] = reward
    return records


def rollout_stats(records: Sequence[dict]) -> dict:
    """Accuracy, tool-call rate, malformed-call rate (a first reply with a `<tool_call>` tag that did not parse) and
    mean assistant turns of episode records."""
    n = max(1, len(records))
    malformed = sum(1 for r in records if not r["tool_called"] and "<tool_call>" in r["first"])
    return {
        "accuracy": sum(r["reward"] for r in records) / n,
        "tool_call_rate": sum(r["tool_called"] for r in records) / n,
        "malformed_rate": malformed / n,
        "mean_turns": sum(r.get("turns", 1) for r in records) / n,
    }
