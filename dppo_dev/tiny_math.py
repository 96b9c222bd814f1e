"""A tiny arithmetic task in the DAPO-Math-17k schema, and the SFT that turns a random tiny Qwen3 into a weak solver.

Used by `scripts/make_tiny_math_model.py` (which builds the bundled `examples/data/tiny_math/` files and the committed
`examples/tiny_math_model/`) and by anything else that needs an RL task a CPU can learn in minutes.

The pretrained model must leave room for RL to climb, like a base model before RL: it often answers, but it is right
only part of the time at temperature 1.0, and it follows the `Answer:` instruction only part of the time. We get that
with *noisy* SFT targets, drawn afresh for every example:

- the answer is correct with probability `label_accuracy`, otherwise off by 1-3 (the correct answer stays the most
  likely one, which makes the RL signal informative);
- the completion uses DAPO's `Answer: <n>` line with probability `format_accuracy`, otherwise the free-form
  `The answer is <n>.`, which the strict DAPO reward scores 0 (as DAPO's own verifier would).

The format choice is one decision shared by every problem, so RL picks it up within tens of steps on a CPU; the
answer noise is what it keeps sharpening after that.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "ANSWER_INSTRUCTION",
    "TINY_MATH_SOURCE",
    "format_completion",
    "make_tiny_math_problems",
    "pretrain_tiny_math_model",
    "sample_accuracy",
    "split_problems",
    "write_jsonl",
]

TINY_MATH_SOURCE = "tiny_math"
# Mirrors (briefly) DAPO-Math-17k's instruction to end with an "Answer: ..." line.
ANSWER_INSTRUCTION = "Put the final answer after 'Answer:'."


def make_tiny_math_problems(max_first: int = 19, max_second: int = 9) -> list[dict]:
    """All `a+b` and `a-b` (a >= b) problems for 0 <= a <= max_first, 0 <= b <= max_second, in the DAPO schema.

    Rows look like DAPO-Math-17k rows: `prompt` is a one-message conversation, `reward_model.ground_truth` holds the
    answer, and `extra_info.index` a stable id. The order is deterministic.
    """
    rows = []
    for op in ("+", "-"):
        for a in range(max_first + 1):
            for b in range(max_second + 1):
                if op == "-" and a < b:
                    continue  # keep answers non-negative: a smaller answer vocabulary for the tiny model
                answer = a + b if op == "+" else a - b
                rows.append(
                    {
                        "data_source": TINY_MATH_SOURCE,
                        "prompt": [{"role": "user", "content": f"What is {a}{op}{b}? {ANSWER_INSTRUCTION}"}],
                        "ability": "MATH",
                        "reward_model": {"ground_truth": str(answer), "style": "rule-lang"},
                        "extra_info": {"index": f"{a}{op}{b}"},
                    }
                )
    return rows


def split_problems(rows: Sequence[dict], test_fraction: float = 0.15, seed: int = 0) -> tuple[list, list]:
    """Deterministic shuffled train/test split."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    n_test = max(1, int(round(len(rows) * test_fraction)))
    return rows[n_test:], rows[:n_test]


def write_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> str:
    """Write rows as JSON lines (one problem per line) and return the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def format_completion(answer: str, dapo_format: bool = True) -> str:
    """A completion of the tiny task: DAPO's answer line, or the free-form sentence the reward does not accept."""
    return f"Answer: {answer}" if dapo_format else f"The answer is {answer}."


def _noisy_answer(answer: int, label_accuracy: float, rng: random.Random) -> int:
    if rng.random() < label_accuracy:
        return answer
    # Off by 1-3 either way: plausible mistakes, never negative.
    wrong = answer + rng.choice([-3, -2, -1, 1, 2, 3])
    return wrong if wrong >= 0 else answer + rng.choice([1, 2, 3])


def _encode_example(tokenizer, prompt: list[dict], completion: str) -> tuple[list[int], list[int]]:
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = list(prompt_ids) + completion_ids
    labels = [-100] * len(prompt_ids) + completion_ids
    return input_ids, labels


def sft_step(model, encoded: Sequence[tuple[list[int], list[int]]], pad_id: int, optimizer, scheduler) -> float:
    """One SFT step on `(input ids, labels)` pairs, right-padded (positions explicit through the attention mask),
    gradient-clipped at 1.0; returns the loss."""
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in encoded])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in encoded])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in encoded])
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def pretrain_tiny_math_model(
    model,
    tokenizer,
    rows: Sequence[dict],
    steps: int = 1500,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    label_accuracy: float = 0.35,
    format_accuracy: float = 1.0,
    seed: int = 0,
    log_every: int = 100,
) -> dict:
    """SFT `model` in place on `rows` with noisy answers; returns a small training summary.

    Fresh noise is drawn for every sampled example, so the model learns the *distributions* (correct with probability
    `label_accuracy`, DAPO format with probability `format_accuracy`) rather than memorising one label per problem. Loss is on completion tokens only. AdamW
    with a cosine schedule; everything is seeded, so the same arguments give the same model on the same machine.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    problems = [(row["prompt"], int(row["reward_model"]["ground_truth"])) for row in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    pad_id = tokenizer.pad_token_id
    model.train()
    start, losses = time.time(), []
    for step in range(steps):
        batch = [rng.choice(problems) for _ in range(batch_size)]
        encoded = [
            _encode_example(
                tokenizer,
                prompt,
                format_completion(str(_noisy_answer(ans, label_accuracy, rng)), rng.random() < format_accuracy),
            )
            for prompt, ans in batch
        ]
        losses.append(sft_step(model, encoded, pad_id, optimizer, scheduler))
        if log_every and (step + 1) % log_every == 0:
            recent = sum(losses[-log_every:]) / len(losses[-log_every:])
            print(f"step {step + 1}/{steps}  loss {recent:.4f}  ({time.time() - start:.0f}s)", flush=True)
    model.eval()
    return {"steps": steps, "final_loss": sum(losses[-50:]) / len(losses[-50:]), "seconds": time.time() - start}


@torch.no_grad()
def sft_checks(model, tokenizer, train: Sequence[dict], test: Sequence[dict], eval_samples: int) -> dict[str, float]:
    """The figures a model builder records after SFT: accuracy and format rate at T = 1 on both splits, greedy
    accuracy on the train split."""
    checks = {}
    for name, rows in (("train", train), ("test", test)):
        result = sample_accuracy(model, tokenizer, rows, num_samples=eval_samples, temperature=1.0)
        checks[f"{name}_accuracy_t1"] = round(result["accuracy"], 4)
        checks[f"{name}_format_t1"] = round(result["format"], 4)
    greedy = sample_accuracy(model, tokenizer, train, num_samples=1, temperature=0.0)
    checks["train_accuracy_greedy"] = round(greedy["accuracy"], 4)
    return checks


def sample_accuracy(
    model,
    tokenizer,
    rows: Sequence[dict],
    num_samples: int = 4,
    temperature: float = 1.0,
    max_new_tokens: int = 16,
    seed: int = 0,
    batch_size: int = 128,
) -> dict:
    """Sample `num_samples` completions per problem and score them with `accuracy_reward` and `format_reward`.

    Returns mean accuracy, format rate, and a few example completions (for eyeballing).
    """
    from dapo_math.rewards import accuracy_reward, format_reward

    torch.manual_seed(seed)
    prompts = [row["prompt"] for row in rows for _ in range(num_samples)]
    truths = [str(row["reward_model"]["ground_truth"]) for row in rows for _ in range(num_samples)]
    texts = []
    for i in range(0, len(prompts), batch_size):
        chunk = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
            for p in prompts[i : i + batch_size]
        ]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        # Full-distribution sampling (no top-k/top-p), as in RL; temperature 0 means greedy.
        sampling = {"temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 else {}
        out = model.generate(
            **enc,
            **sampling,
            do_sample=temperature > 0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    acc = accuracy_reward(texts, ground_truth=truths)
    fmt = format_reward(texts)
    return {
        "accuracy": sum(acc) / len(acc),
        "format": sum(fmt) / len(fmt),
        "examples": list(zip(prompts[:4], texts[:4], truths[:4])),
    }
