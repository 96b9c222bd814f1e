"""Loaders for DAPO-Math-17k (training) and AIME 2024/2025 (evaluation), normalised to TRL's GRPO input shape.

Every loader returns a `datasets.Dataset` with two columns:

- `prompt`: a conversation, `[{"role": "user", "content": ...}]` (TRL applies the chat template);
- `ground_truth`: the reference answer as a string, forwarded by TRL to reward functions as a keyword argument
  (see `dapo_math.rewards.accuracy_reward`).

Sources can be a Hub dataset id or a local file (`.json`, `.jsonl`, `.parquet`) or folder (data files named by split,
or a `save_to_disk` folder), so everything is testable offline.
"""

from __future__ import annotations

from datasets import Dataset

from dppo_trl.cli.inputs import drop_repeated_prompts, load_local_or_hub

__all__ = [
    "AIME_DATASETS",
    "DAPO_MATH_DATASET",
    "DAPO_PROMPT_TEMPLATE",
    "load_aime",
    "load_dapo_math",
    "load_math_dataset",
    "normalize_math_dataset",
]

DAPO_MATH_DATASET = "BytedTsinghua-SIA/DAPO-Math-17k"
# Hub copies with `problem`/`answer` columns; override with a local file when the Hub is unreachable.
AIME_DATASETS = {"aime24": "HuggingFaceH4/aime_2024", "aime25": "yentinglin/aime_2025"}

# DAPO-Math-17k's own instruction wording (its prompts already contain it); applied to raw AIME problems so that
# evaluation asks for the answer exactly the way training did.
DAPO_PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

_PROBLEM_COLUMNS = ("problem", "question", "Problem", "Question")
_ANSWER_COLUMNS = ("ground_truth", "answer", "solution", "Answer")


def load_math_dataset(name_or_path: str, split: str = "train", config_name: str | None = None) -> Dataset:
    """Load a raw dataset split from the Hub or from a local file/folder (the `dppo-trl` command's loader)."""
    return load_local_or_hub(name_or_path, split=split, config_name=config_name)


def _prompt_messages(example: dict, prompt_template: str | None) -> list[dict]:
    prompt = example.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    if isinstance(prompt, str) and prompt:
        return [{"role": "user", "content": prompt}]
    for column in _PROBLEM_COLUMNS:
        if example.get(column):
            problem = str(example[column])
            text = prompt_template.format(problem=problem) if prompt_template else problem
            return [{"role": "user", "content": text}]
    raise ValueError(f"Row has no prompt or problem column: {sorted(example)}")


def _ground_truth(example: dict) -> str:
    reward_model = example.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return str(reward_model["ground_truth"]).strip()
    for column in _ANSWER_COLUMNS:
        if example.get(column) is not None:
            return str(example[column]).strip()
    raise ValueError(f"Row has no ground truth (reward_model.ground_truth/answer/solution): {sorted(example)}")


def normalize_math_dataset(
    dataset: Dataset,
    prompt_template: str | None = None,
    dedup: bool = False,
    max_samples: int | None = None,
    num_proc: int | None = None,
) -> Dataset:
    """Map any supported schema to `prompt` (conversation) + `ground_truth` (string), optionally deduplicated.

    Supported rows: DAPO (`prompt` messages + `reward_model.ground_truth`), processed DAPO copies (`prompt` string +
    `solution`), and problem/answer sets such as AIME (`problem` or `question` + `answer`; `prompt_template` wraps
    the problem). Deduplication keeps the first row of each distinct prompt text, in the original order.
    """

    def convert(example: dict) -> dict:
        return {"prompt": _prompt_messages(example, prompt_template), "ground_truth": _ground_truth(example)}

    dataset = dataset.map(convert, remove_columns=dataset.column_names, num_proc=num_proc)
    if dedup:
        # The Hub copy of DAPO-Math-17k repeats every problem ~100 times; keep the first copy of each.
        dataset = drop_repeated_prompts(dataset)
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    return dataset


def load_dapo_math(
    name_or_path: str = DAPO_MATH_DATASET,
    split: str = "train",
    dedup: bool = True,
    max_samples: int | None = None,
    config_name: str | None = None,
    num_proc: int | None = None,
) -> Dataset:
    """DAPO-Math-17k (Hub id or local file/folder in its schema) as `prompt` + `ground_truth`, deduplicated.

    `max_samples` applies after deduplication.
    """
    raw = load_math_dataset(name_or_path, split=split, config_name=config_name)
    return normalize_math_dataset(raw, dedup=dedup, max_samples=max_samples, num_proc=num_proc)


def load_aime(
    name_or_path: str,
    split: str = "train",
    prompt_template: str | None = DAPO_PROMPT_TEMPLATE,
    max_samples: int | None = None,
    config_name: str | None = None,
) -> Dataset:
    """An AIME-style eval set (`problem`/`answer` columns, or DAPO schema) as `prompt` + `ground_truth`.

    `name_or_path` may be a key of `AIME_DATASETS` ("aime24", "aime25"), a Hub id or a local file/folder. Raw
    problems are wrapped in `prompt_template` (DAPO's instruction by default); rows that already carry a `prompt`
    are used as they are.
    """
    name_or_path = AIME_DATASETS.get(name_or_path, name_or_path)
    raw = load_math_dataset(name_or_path, split=split, config_name=config_name)
    return normalize_math_dataset(raw, prompt_template=prompt_template, max_samples=max_samples)
