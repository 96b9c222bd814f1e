# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""
Build the bundled tiny tool-calling task and SFT the tiny Qwen3 agent that `examples/train_tool_agent.py` trains.

```bash
python scripts/make_tiny_agent_model.py            # writes examples/data/tiny_agent/ and examples/tiny_agent_model/
python scripts/make_tiny_agent_model.py --data_only
```

**Data** (`examples/data/tiny_agent/{train,test}.jsonl`): every `a*b` with 10 <= a <= b <= 99 (4,095 problems),
conversational prompt "What is 47*38?", answer column "1786". Shuffled with `random.Random(0)`; 200 go to
`test.jsonl` (the held-out split the example evaluates on), the rest to `train.jsonl`.

**Tokenizer**: `dppo_dev.tiny_agent.build_agent_tokenizer()`: the byte-level tokenizer, Qwen3's chat template read from
the installed TRL (`trl/chat_templates/qwen3.jinja`, so TRL recognises it), and 7 added tokens (Qwen3's tool tags and
the tool system prompt for `multiply`), 266 ids in all.

**Model**: `dppo_dev.tiny_models.build_tiny_model("qwen3", seed=0)` with hidden 128, 2 layers, 4 heads / 2 KV heads,
head_dim 32, intermediate 256, 1024 positions, untied embeddings (about 364k parameters, 1.5 MB in fp32).

**SFT**: episodes drawn afresh from a mixture (`dppo_dev.tiny_agent.SFT_MIXTURE`): a correct call then the answer
(50%), a malformed call (20%), a call with one wrong digit (15%), an answer without the tool (15%); loss on the
model's own turns only (not on the spliced tool turn); AdamW, peak lr 3e-3, warm-up then cosine, batch 16, one torch
thread (for reproducibility), seed 0. The rates the result reached on the held-out split (sampled at temperature 1
and greedy) are written to `examples/tiny_agent_model/pretraining.json`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA_DIR = os.path.join(REPO_ROOT, "examples", "data", "tiny_agent")
DEFAULT_MODEL_DIR = os.path.join(REPO_ROOT, "examples", "tiny_agent_model")
MODEL_SHAPE = dict(
    hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
    max_position_embeddings=1024,
)  # fmt: skip


@dataclass
class MakeTinyAgentArguments:
    """Options of `make_tiny_agent_model.py`; the defaults reproduce the committed files."""

    data_dir: str = field(default=DEFAULT_DATA_DIR, metadata={"help": "Where to write train.jsonl and test.jsonl."})
    output_dir: str = field(default=DEFAULT_MODEL_DIR, metadata={"help": "Where to save the SFT model."})
    data_only: bool = field(default=False, metadata={"help": "Only write the data set."})
    seed: int = field(default=0, metadata={"help": "Seed for the split, the initialisation and the SFT."})
    num_test: int = field(default=200, metadata={"help": "Problems held out in test.jsonl."})
    steps: int = field(default=300, metadata={"help": "SFT optimizer steps."})
    batch_size: int = field(default=16, metadata={"help": "SFT batch size."})
    learning_rate: float = field(default=3e-3, metadata={"help": "Peak SFT learning rate."})
    eval_problems: int = field(default=200, metadata={"help": "Held-out problems for the sanity check."})


def make_tiny_agent_data(data_dir: str = DEFAULT_DATA_DIR, seed: int = 0, num_test: int = 200) -> dict:
    """Write `train.jsonl` and `test.jsonl` to `data_dir`; returns their paths and sizes."""
    from dppo_dev.tiny_agent import make_agent_problems, split_problems
    from dppo_dev.tiny_math import write_jsonl

    train, test = split_problems(make_agent_problems(), num_test=num_test, seed=seed)
    return {
        "train": write_jsonl(train, os.path.join(data_dir, "train.jsonl")),
        "test": write_jsonl(test, os.path.join(data_dir, "test.jsonl")),
        "num_train": len(train),
        "num_test": len(test),
    }


def build_tiny_agent(args: MakeTinyAgentArguments):
    """SFT the tiny agent from scratch; returns `(model, tokenizer, sft_summary, train, test)` without saving."""
    import torch

    from dppo_dev.tiny_agent import build_agent_tokenizer, make_agent_problems, split_problems, train_agent_sft
    from dppo_dev.tiny_models import build_tiny_model

    torch.set_num_threads(1)  # one thread: the same arithmetic order on every run, and no oversubscription
    train, test = split_problems(make_agent_problems(), num_test=args.num_test, seed=args.seed)
    tokenizer = build_agent_tokenizer()
    model, _ = build_tiny_model("qwen3", seed=args.seed, vocab_size=len(tokenizer), **MODEL_SHAPE)
    sft = train_agent_sft(
        model,
        tokenizer,
        train,
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
    )
    return model, tokenizer, sft, train, test


def make_tiny_agent_model(args: MakeTinyAgentArguments) -> dict:
    """Write the data, SFT the agent, check it on the held-out split, and save it; returns the summary."""
    from dppo_dev.tiny_agent import rollout_stats, sample_episode_text

    data = make_tiny_agent_data(args.data_dir, seed=args.seed, num_test=args.num_test)
    if args.data_only:
        return data
    start = time.time()
    model, tokenizer, sft, _, test = build_tiny_agent(args)
    rows = test[: args.eval_problems]
    checks = {
        "test_t1": {k: round(v, 4) for k, v in rollout_stats(sample_episode_text(model, tokenizer, rows)).items()},
        "test_greedy": {
            k: round(v, 4)
            for k, v in rollout_stats(sample_episode_text(model, tokenizer, rows, temperature=0)).items()
        },
    }
    os.makedirs(args.output_dir, exist_ok=True)
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    summary = {
        "arguments": {k: v for k, v in asdict(args).items() if k not in ("data_dir", "output_dir")},
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "sft_final_loss": round(sft["final_loss"], 4),
        "seconds": round(time.time() - start, 1),
        **checks,
    }
    with open(os.path.join(args.output_dir, "pretraining.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return {**data, **summary}


if __name__ == "__main__":
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(MakeTinyAgentArguments).parse_args_into_dataclasses(sys.argv[1:])
    print(json.dumps(make_tiny_agent_model(args), indent=2))
