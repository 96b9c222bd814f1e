# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""Fig. 6 for two vocabularies side by side: which tokens each method masks or clips, by μ bin (issue 27).

The paper (§4.2, Fig. 1 and 6) predicts that ratio clipping masks low-probability tokens far more often than a
divergence trust region does, and that this matters more the longer the vocabulary's tail. This script reads the
Fig. 6 histograms `compare.py` pooled for each model (every run's masked / kept sampled tokens per μ bin, summed over
seeds) and puts them side by side: per model and method, the share of sampled tokens masked (DPPO) or clipped (the
ratio baselines) with μ < 0.1 and with μ ≥ 0.1, and the low-μ gap, each ratio clip's share minus DPPO-TV's. Since
a longer tail also means more low-μ tokens, the masked low-μ tokens are also given as a share of *all* sampled
tokens, with the same gap. Whether the gap widens with the vocabulary is read off, not tested (docs/results.md, the
BPE study's plan).

```bash
python benchmarks/sanity/fig6_vocab.py \
    --compare "bytes (259)=benchmarks/sanity/results/mismatch_seeds100/compare.json" \
    --compare "BPE (8,192)=benchmarks/sanity/results/bpe_seeds40/compare.json" \
    --level noise=0.3 --output-dir benchmarks/sanity/results/fig6_vocab
```

Writes `fig6_vocab.json`, `fig6_vocab.md` and `fig6_vocab.png` to `--output-dir`; stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os

LOW_MU = 0.1  # the paper's "low-probability" tokens; a bin edge of run.MU_BINS
REFERENCE = "dppo_tv"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", action="append", required=True, help="LABEL=path/to/compare.json (one per model)")
    p.add_argument("--level", default="noise=0.3")
    p.add_argument("--methods", default="dppo_tv,grpo_clip,clip_higher")
    p.add_argument("--output-dir", required=True)
    return p.parse_args(argv)


def masked_shares(fig6: dict) -> dict:
    """Masked share of the sampled tokens below and above LOW_MU, and the share of sampled tokens below it."""
    edges = fig6["mu_bins"]
    low = [i for i in range(len(edges) - 1) if edges[i + 1] <= LOW_MU]
    high = [i for i in range(len(edges) - 1) if i not in low]

    def share(bins: list[int]) -> float | None:
        masked = sum(fig6["masked"][i] for i in bins)
        sampled = masked + sum(fig6["kept"][i] for i in bins)
        return masked / sampled if sampled else None

    total = sum(fig6["masked"]) + sum(fig6["kept"])
    low_sampled = sum(fig6["masked"][i] + fig6["kept"][i] for i in low)
    low_masked = sum(fig6["masked"][i] for i in low)
    return {
        "runs": fig6["n_runs"],
        "sampled_tokens": total,
        "sampled_share_low_mu": low_sampled / total if total else None,
        "masked_share_low_mu": share(low),
        "masked_share_high_mu": share(high),
        "low_mu_masked_of_all": low_masked / total if total else None,
        "masked_share_by_bin": fig6["masked_share"],
        "mu_bins": edges,
    }


def analyse(args: argparse.Namespace) -> dict:
    methods = args.methods.split(",")
    models = {}
    for spec in args.compare:
        label, path = spec.split("=", 1)
        with open(path, encoding="utf-8") as f:
            compare = json.load(f)
        cells = {}
        for method in methods:
            cell = compare["cells"].get(f"{args.level}|{method}")
            if cell is None or not cell.get("fig6"):
                raise SystemExit(f"{path}: no Fig. 6 histograms for {args.level} / {method}")
            cells[method] = masked_shares(cell["fig6"])
        reference = cells[REFERENCE]["masked_share_low_mu"]
        gaps = {m: cells[m]["masked_share_low_mu"] - reference for m in methods if m != REFERENCE}
        reference_of_all = cells[REFERENCE]["low_mu_masked_of_all"]
        gaps_of_all = {m: cells[m]["low_mu_masked_of_all"] - reference_of_all for m in methods if m != REFERENCE}
        models[label] = {
            "source": path,
            "status": compare.get("status"),
            "methods": cells,
            "low_mu_gap": gaps,
            "low_mu_gap_of_all": gaps_of_all,
        }
    return {"level": args.level, "low_mu_below": LOW_MU, "reference": REFERENCE, "models": models}


def format_table(result: dict) -> str:
    lines = [
        f"Fig. 6 by vocabulary at `{result['level']}`: share of sampled tokens masked (DPPO) or clipped (ratio), "
        f"μ < {result['low_mu_below']} and μ ≥ {result['low_mu_below']}; gap = that method's low-μ share minus "
        f"{result['reference']}'s; the last two columns count the masked low-μ tokens against all sampled tokens.",
        "",
        "| model | method | runs | sampled tokens | share with μ < 0.1 | masked, μ < 0.1 | masked, μ ≥ 0.1 | low-μ gap "
        "| low-μ masked, of all sampled | its gap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, model in result["models"].items():
        for method, c in model["methods"].items():
            gap, gap_of_all = model["low_mu_gap"].get(method), model["low_mu_gap_of_all"].get(method)
            lines.append(
                f"| {label} | {method} | {c['runs']} | {c['sampled_tokens']:,} | {c['sampled_share_low_mu']:.3f} | "
                f"{c['masked_share_low_mu']:.4f} | {c['masked_share_high_mu']:.4f} | "
                f"{'–' if gap is None else f'{gap:+.4f}'} | {c['low_mu_masked_of_all']:.4f} | "
                f"{'–' if gap_of_all is None else f'{gap_of_all:+.4f}'} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"].items())
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), sharey=True, squeeze=False)
    for ax, (label, model) in zip(axes[0], models):
        methods = list(model["methods"])
        width = 0.8 / len(methods)
        for j, method in enumerate(methods):
            c = model["methods"][method]
            shares = [s if s is not None else 0.0 for s in c["masked_share_by_bin"]]
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(shares))]
            ax.bar(xs, shares, width=width, label=method)
        edges = model["methods"][methods[0]]["mu_bins"]
        ax.set_xticks(range(len(edges) - 1))
        ax.set_xticklabels([f"{a:g}–{b:g}" for a, b in zip(edges[:-1], edges[1:])], rotation=45, fontsize=8)
        ax.set_title(f"{label}: {model['methods'][methods[0]]['runs']} runs per method", fontsize=10)
        ax.set_xlabel("μ of the sampled token")
    axes[0][0].set_ylabel("share masked or clipped")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Fig. 6 by vocabulary, {result['level']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = analyse(args)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "fig6_vocab.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.output_dir, "fig6_vocab.md"), "w", encoding="utf-8") as f:
        f.write(format_table(result))
    plot(result, os.path.join(args.output_dir, "fig6_vocab.png"))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
