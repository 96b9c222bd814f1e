# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""
Build the second bundled model: the tiny math Qwen3 on an 8k-token BPE vocabulary (issue 27).

```bash
python scripts/make_tiny_math_bpe_model.py        # writes examples/tiny_math_bpe_model/
```

**Tokenizer**: byte-level BPE trained with the `tokenizers` library on the task's own text
(`dppo_dev.tiny_bpe.task_corpus`: every bundled tiny-math problem, then 200,000 problems of the same form with
operands up to 9999, each with both completion formats), 8,192 tokens, ChatML specials at ids 0-2.

**Model**: the bundled tiny model's body (hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 32, intermediate 128)
on that vocabulary, with tied embeddings: 623,040 parameters, about 2.5 MB in fp32.

**Pretraining**: exactly `scripts/make_tiny_math_model.py`'s SFT (`dppo_dev.tiny_math.pretrain_tiny_math_model`) on
the same train split of `examples/data/tiny_math/`: noisy answers (correct with probability 0.6), `Answer: <n>` with
probability 0.5, 300 steps of batch 64, peak lr 3e-3 with a cosine decay, seed 0. Sampled accuracy, format rate,
final loss and seconds are written to `examples/tiny_math_bpe_model/pretraining.json`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_DIR = os.path.join(REPO_ROOT, "examples", "tiny_math_bpe_model")


@dataclass
class MakeTinyMathBpeArguments:
    """Options of `make_tiny_math_bpe_model.py`; the defaults reproduce the committed files."""

    output_dir: str = field(default=DEFAULT_MODEL_DIR, metadata={"help": "Where to save the pretrained model."})
    seed: int = field(default=0, metadata={"help": "Seed for the corpus, the split, the initialisation and the SFT."})
    vocab_size: int = field(default=8192, metadata={"help": "BPE vocabulary size, special tokens included."})
    corpus_problems: int = field(default=200_000, metadata={"help": "Random wide-operand problems in the corpus."})
    max_operand: int = field(default=9999, metadata={"help": "Largest operand of the corpus's random problems."})
    test_fraction: float = field(default=0.15, metadata={"help": "Share of problems held out (as the tiny model)."})
    steps: int = field(default=300, metadata={"help": "SFT optimizer steps."})
    batch_size: int = field(default=64, metadata={"help": "SFT batch size."})
    learning_rate: float = field(default=3e-3, metadata={"help": "Peak SFT learning rate (cosine decay to 0)."})
    label_accuracy: float = field(default=0.6, metadata={"help": "Probability that an SFT target answer is correct."})
    format_accuracy: float = field(
        default=0.5, metadata={"help": "Probability that an SFT target uses the `Answer: <n>` line."}
    )
    eval_samples: int = field(default=8, metadata={"help": "Samples per problem for the sanity check."})


def make_tiny_math_bpe_model(args: MakeTinyMathBpeArguments) -> dict:
    """Train the tokenizer, pretrain the model, sanity-check it by sampling, and save both; returns the summary."""
    import torch

    from dppo_dev.tiny_bpe import build_bpe_model, train_bpe_tokenizer
    from dppo_dev.tiny_math import make_tiny_math_problems, pretrain_tiny_math_model, sft_checks, split_problems

    start = time.time()
    tokenizer = train_bpe_tokenizer(args.vocab_size, args.corpus_problems, args.max_operand, args.seed)
    tokenizer_seconds = time.time() - start
    train, test = split_problems(make_tiny_math_problems(), test_fraction=args.test_fraction, seed=args.seed)
    model = build_bpe_model(tokenizer, seed=args.seed)
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
        "arguments": {k: v for k, v in asdict(args).items() if k != "output_dir"},
        "vocab_size": len(tokenizer),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "sft_final_loss": round(sft["final_loss"], 4),
        "tokenizer_seconds": round(tokenizer_seconds, 1),
        "seconds": round(time.time() - start, 1),
        "torch_threads": torch.get_num_threads(),
        **checks,
    }
    with open(os.path.join(args.output_dir, "pretraining.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(MakeTinyMathBpeArguments).parse_args_into_dataclasses(sys.argv[1:])
    print(json.dumps(make_tiny_math_bpe_model(args), indent=2))
