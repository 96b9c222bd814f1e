# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""How long-tailed are a model's sampled-token distributions on the sanity task? (issue 27)

The paper's case against the ratio (§4.2, Fig. 1) is about low-probability tokens. This script samples each model
on the sanity benchmark's prompts exactly as RL does (temperature 1, no top-k / top-p; the first 32 train problems,
16 completions each) and reports, over every sampled completion token: the share whose probability is below 0.1
(and 0.01), the histogram over `run.py`'s μ bins, the mean entropy of the full next-token distribution (nats), the
mean probability mass on tokens below 0.01, completion length, accuracy and format rate. Probabilities are the fp32
policy's at the sampled token (HF `generate` scores), i.e. π at the generating weights; the bf16 engine's μ differs
from it by about 10⁻³ per token (docs/results.md), far below these bins.

```bash
python benchmarks/sanity/token_tail.py --output benchmarks/sanity/results/token_tail.json
```

Prints one JSON object on stdout (and writes it to `--output`).
"""

from __future__ import annotations

import argparse
import os

import run  # this folder's `run.py`; sets up the offline environment

REPO_ROOT = run.REPO_ROOT
MODELS = ["examples/tiny_math_model", "examples/tiny_math_bpe_model"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated model folders (repository-relative)")
    p.add_argument("--data", default=run.DEFAULT_DATA)
    p.add_argument("--problems", type=int, default=32, help="the first N train problems (run.py's subset)")
    p.add_argument("--samples", type=int, default=16, help="completions per problem")
    p.add_argument("--max-new-tokens", type=int, default=16, help="run.py's max completion length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def token_stats(model_dir: str, rows: list[dict], args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_math.rewards import accuracy_reward, format_reward

    path = os.path.join(REPO_ROOT, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [r["prompt"] for r in rows for _ in range(args.samples)]
    truths = [str(r["ground_truth"]) for r in rows for _ in range(args.samples)]
    text = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    enc = tokenizer(text, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=args.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    sequences = out.sequences[:, enc["input_ids"].shape[1] :]
    logp = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # [B, T, V]; scores at T = 1 are the logits
    sampled = logp.gather(-1, sequences[:, : logp.shape[1], None]).squeeze(-1).exp()
    # Completion tokens up to and including the first end-of-turn token (what RL trains on).
    eos = set(model.generation_config.eos_token_id or []) | {tokenizer.eos_token_id}
    is_eos = torch.zeros_like(sequences, dtype=torch.bool)
    for e in eos:
        is_eos |= sequences == e
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
    mask = ~after_eos[:, : logp.shape[1]]
    probs = logp.exp()
    entropy = -(probs * logp).sum(-1)
    tail_mass = (probs * (probs < 0.01)).sum(-1)
    mu, ent, tail = sampled[mask], entropy[mask], tail_mass[mask]
    bins = torch.tensor(run.MU_BINS)
    hist = [int(((mu >= lo) & (mu < hi)).sum()) for lo, hi in zip(bins[:-1], bins[1:])]
    texts = tokenizer.batch_decode(sequences, skip_special_tokens=True)
    acc, fmt = accuracy_reward(texts, ground_truth=truths), format_reward(texts)
    return {
        "model": model_dir,
        "vocab_size": len(tokenizer),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "sampled_tokens": int(mask.sum()),
        "completion_tokens_mean": float(mask.sum(1).float().mean()),
        "share_mu_below_0.1": float((mu < 0.1).float().mean()),
        "share_mu_below_0.01": float((mu < 0.01).float().mean()),
        "mu_hist": {"bins": run.MU_BINS[:-1] + [1.0], "counts": hist},
        "entropy_mean_nats": float(ent.mean()),
        "entropy_median_nats": float(ent.median()),
        "tail_mass_below_0.01_mean": float(tail.mean()),
        "accuracy": sum(acc) / len(acc),
        "format": sum(fmt) / len(fmt),
    }


def main(argv: list[str] | None = None) -> dict:
    from dapo_math.data import load_dapo_math

    args = parse_args(argv)
    rows = list(load_dapo_math(args.data, split="train", max_samples=args.problems))
    report = {
        "benchmark": "token_tail",
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("output", "data")},
            "data": os.path.relpath(args.data, REPO_ROOT),
        },
        "models": [token_stats(m.strip(), rows, args) for m in args.models.split(",") if m.strip()],
    }
    return run._rounded(report)


if __name__ == "__main__":
    from dppo_dev.bench_env import emit_json, stdout_to_stderr

    with stdout_to_stderr():
        result = main()
    emit_json(result, parse_args().output)
