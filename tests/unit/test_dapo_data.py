"""DAPO-Math / AIME loaders on local fixtures in the Hub schemas (no network)."""

import json
import os

import pytest
from datasets import Dataset

from dapo_math.data import DAPO_PROMPT_TEMPLATE, load_aime, load_dapo_math, normalize_math_dataset


def _dapo_row(problem: str, answer: str, index: int) -> dict:
    # The DAPO-Math-17k Hub schema.
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem=problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lang"},
        "extra_info": {"index": f"uuid-{index}"},
    }


@pytest.fixture
def dapo_rows() -> list[dict]:
    # Three distinct problems, repeated like the Hub copy (each copy has its own extra_info.index).
    problems = [("What is 1+1?", "2"), ("Find x if 2x=6.", "3"), ("Compute 10/4.", "\\frac{5}{2}")]
    return [_dapo_row(p, a, i * 10 + r) for r in range(4) for i, (p, a) in enumerate(problems)]


def _write_jsonl(rows, path):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def test_jsonl_dedup_and_shape(dapo_rows, tmp_path):
    path = _write_jsonl(dapo_rows, tmp_path / "dapo.jsonl")
    ds = load_dapo_math(path)
    assert ds.column_names == ["prompt", "ground_truth"]
    assert len(ds) == 3
    assert ds[0]["prompt"][0]["role"] == "user" and "1+1" in ds[0]["prompt"][0]["content"]
    assert ds["ground_truth"] == ["2", "3", "\\frac{5}{2}"]  # first copies, original order
    assert len(load_dapo_math(path, dedup=False)) == 12
    assert len(load_dapo_math(path, max_samples=2)) == 2


@pytest.mark.parametrize("fmt", ["parquet", "json", "folder", "save_to_disk"])
def test_other_local_formats(dapo_rows, tmp_path, fmt):
    raw = Dataset.from_list(dapo_rows)
    if fmt == "parquet":
        source = str(tmp_path / "dapo.parquet")
        raw.to_parquet(source)
    elif fmt == "json":
        source = str(tmp_path / "dapo.json")
        with open(source, "w") as f:
            json.dump(dapo_rows, f)
    elif fmt == "folder":
        os.makedirs(tmp_path / "data")
        _write_jsonl(dapo_rows, tmp_path / "data" / "train.jsonl")
        _write_jsonl(dapo_rows[:3], tmp_path / "data" / "test.jsonl")
        source = str(tmp_path / "data")
        assert len(load_dapo_math(source, split="test")) == 3
    else:
        source = str(tmp_path / "saved")
        raw.save_to_disk(source)
    ds = load_dapo_math(source)
    assert len(ds) == 3 and ds.column_names == ["prompt", "ground_truth"]


def test_processed_copy_with_string_prompts():
    # Processed DAPO copies store the prompt as a string and the answer as `solution`.
    raw = Dataset.from_list([{"prompt": "What is 2+2?", "solution": "4"}, {"prompt": "What is 2+2?", "solution": "4"}])
    ds = normalize_math_dataset(raw, dedup=True)
    assert ds[0] == {"prompt": [{"role": "user", "content": "What is 2+2?"}], "ground_truth": "4"}
    assert len(ds) == 1


def test_aime_local_file(tmp_path):
    rows = [
        {"id": 60, "problem": "Find the remainder when 2^10 is divided by 1000.", "answer": "24", "year": 2024},
        {"id": 61, "problem": "How many ...?", "answer": 113, "year": 2024},  # integer answers become strings
    ]
    ds = load_aime(_write_jsonl(rows, tmp_path / "aime.jsonl"))
    assert ds["ground_truth"] == ["24", "113"]
    content = ds[0]["prompt"][0]["content"]
    assert "2^10" in content and 'after "Answer:"' in content  # wrapped in DAPO's instruction
    raw = load_aime(str(tmp_path / "aime.jsonl"), prompt_template=None)
    assert raw[0]["prompt"][0]["content"] == rows[0]["problem"]


def test_aime_question_column_and_dapo_schema_eval(tmp_path, dapo_rows):
    ds = load_aime(_write_jsonl([{"question": "Q?", "answer": "5"}], tmp_path / "aime25.jsonl"))
    assert ds[0]["ground_truth"] == "5" and "Q?" in ds[0]["prompt"][0]["content"]
    # Eval sets already in the DAPO schema keep their prompt untouched.
    ds = load_aime(_write_jsonl(dapo_rows[:2], tmp_path / "dapo_eval.jsonl"))
    assert ds[0]["prompt"] == dapo_rows[0]["prompt"]


def test_bundled_tiny_math_files():
    root = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "data", "tiny_math"
    )
    train = load_dapo_math(os.path.join(root, "train.jsonl"))
    test = load_dapo_math(os.path.join(root, "test.jsonl"))
    assert len(train) == 302 and len(test) == 53
    train_prompts = {row[0]["content"] for row in train["prompt"]}
    assert not train_prompts & {row[0]["content"] for row in test["prompt"]}  # no leakage


def test_bad_rows_raise(tmp_path):
    with pytest.raises(ValueError, match="ground truth"):
        normalize_math_dataset(Dataset.from_list([{"prompt": "x"}]))
    with pytest.raises(ValueError, match="Unsupported"):
        bad = tmp_path / "data.txt"
        bad.write_text("x")
        load_dapo_math(str(bad))
