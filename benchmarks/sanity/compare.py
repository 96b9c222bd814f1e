# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""Pool mismatch sweeps' seeds and test the trust regions' collapse rates (docs/results.md, issue 21).

Reads one or more `sweep.json` files written by `sweep.py` (the committed 5-seed sweep and the runs that add seeds
to it), pools their runs per (level, method) and reports, per cell: collapsed / N with an exact Clopper–Pearson 95%
interval, final accuracy mean ± standard error, and steps to a smoothed 20% accuracy (`run.py`'s REACH_ACCURACY).
Then the analysis fixed before the runs: at each level, the reference method's collapse count against each method
of `--against`, Fisher's exact test, two-sided, with Holm–Bonferroni adjusted p over every comparison of the call
(`--secondary` methods get raw p only). Only seeds that finished for every method of a level are used, so each
comparison is on the same seeds.

```bash
python benchmarks/sanity/compare.py \\
    --sweeps benchmarks/sanity/results/mismatch_sweep/sweep.json benchmarks/sanity/results/mismatch_seeds/sweep.json \\
    --levels none,noise=0.3 --output-dir benchmarks/sanity/results/mismatch_seeds
```

Writes `compare.json`, `compare.md` and `compare.png` to `--output-dir`; stdout is one JSON object (the tests and the
cells), notices go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import run  # this folder's `run.py` (a script's folder is on its import path); sets up the offline environment
from stats import clopper_pearson, fisher_exact, holm, mcnemar_exact, mean_se, newcombe_diff

HERE = os.path.dirname(os.path.abspath(__file__))

METHODS = "dppo_tv,dppo_kl,grpo_clip,clip_higher,pg_is"
P4_RATIO = 0.7  # P4: DPPO reaches the accuracy threshold in at most this fraction of clip_higher's steps
MARGIN = 0.15  # issue 27's pre-registered margin: "no difference larger than 15 points" needs the CI inside ±0.15
Z95 = 1.959963984540054
ROUNDING = 1e-4  # far above what rounding the stored accuracies (multiples of 1/384 or so) to 5 digits can move


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweeps", nargs="+", required=True, help="sweep.json files (or runs.jsonl records) to pool")
    p.add_argument("--levels", required=True, help="comma-separated levels to analyse")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--reference", default="dppo_tv")
    p.add_argument("--against", default="grpo_clip,clip_higher,pg_is", help="the primary comparisons (Holm family)")
    p.add_argument("--secondary", default="dppo_kl", help="also compared with --against, raw p only")
    p.add_argument("--test-levels", default=None, help="levels to test (default: every level; the others: cells only)")
    p.add_argument("--margin", type=float, default=MARGIN, help="equivalence margin of the collapse-rate difference")
    p.add_argument(
        "--target-seeds", type=int, default=None, help="planned seeds per arm: fewer is reported as interim"
    )
    p.add_argument("--seed-blocks", default="", help="also report these seed blocks apart, e.g. 0-19,20-99")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    args.seed_blocks = [b.strip() for b in args.seed_blocks.split(",") if b.strip()]
    args.test_levels = args.test_levels or args.levels
    for key in ("levels", "methods", "against", "secondary", "test_levels"):
        setattr(args, key, [x.strip() for x in getattr(args, key).split(",") if x.strip()])
    if not set(args.test_levels) <= set(args.levels):
        raise SystemExit(f"--test-levels {args.test_levels} must be among --levels {args.levels}")
    return args


def steps_to_reach(row: dict) -> int | None:
    """First step whose smoothed accuracy reaches run.REACH_ACCURACY (None: never), as `run.run_summary` counts it."""
    return next((s for s, v in run._smoothed(row["curves"]["accuracy"]) if v >= run.REACH_ACCURACY), None)


def collapse_margin(row: dict) -> float:
    """Smoothed final accuracy minus the collapse threshold, from the row's stored accuracy curve (< 0: collapsed).

    The *smoothed* final accuracy (mean of the last `run.SMOOTH` generations) is compared, as `run.run_summary`
    does, not the last generation alone: a run at 0 for two generations that bounces once at the end collapsed.
    """
    acc = row["curves"]["accuracy"]
    smooth = run._smoothed(acc)
    if not smooth:
        return 0.0
    final, peak = smooth[-1][1], max(v for _, v in smooth)
    return final - max(peak - run.COLLAPSE_DROP, 0.5 * acc[0][1])


def collapsed_from_curve(row: dict) -> bool:
    """The collapse criterion recounted from the row's stored (rounded) accuracy curve."""
    return collapse_margin(row) < 0


def pool_runs(paths: list[str]) -> tuple[dict, list[dict]]:
    """(level, method, seed) -> run row over every sweep; a seed present twice must agree (it is the same run)."""
    pooled, sources = {}, []
    for path in paths:
        with open(path) as f:
            if path.endswith(".jsonl"):  # a sweep's committed record (sweep.py's runs.jsonl): one run per line
                sweep = {"runs": [json.loads(line) for line in f if line.strip()]}
            else:
                sweep = json.load(f)
        sources.append({"path": os.path.relpath(path, run.REPO_ROOT), "command": sweep.get("command")})
        for row in sweep["runs"]:
            if "error" in row:
                print(f"[compare] skipping failed run {row['level']} {row['method']} {row['seed']}", file=sys.stderr)
                continue
            key = (row["level"], row["method"], row["seed"])
            # Stored curves are rounded to 5 significant digits; within ROUNDING of the threshold the stored flag,
            # computed from the unrounded curve, decides (a final exactly at half the start is not a collapse).
            margin = collapse_margin(row)
            if abs(margin) > ROUNDING and (margin < 0) != bool(row["collapsed"]):
                raise SystemExit(f"[compare] {key} in {path}: the stored collapse flag disagrees with its curve.")
            if key in pooled and pooled[key]["final_accuracy"] != row["final_accuracy"]:
                raise SystemExit(f"[compare] {key} appears in two sweeps with different results; pool disjoint seeds.")
            pooled[key] = row
    return pooled, sources


def common_seeds(pooled: dict, level: str, methods: list[str]) -> list[int]:
    per_method = [{s for (lvl, m, s) in pooled if lvl == level and m == method} for method in methods]
    return sorted(set.intersection(*per_method)) if per_method else []


def cell(rows: list[dict]) -> dict:
    n = len(rows)
    collapsed = sum(bool(r["collapsed"]) for r in rows)
    lo, hi = clopper_pearson(collapsed, n)
    mean, se = mean_se([r["final_accuracy"] for r in rows])
    reach = [steps_to_reach(r) for r in rows]
    reached = [s for s in reach if s is not None]
    fresh = [r["fresh_mismatch_first"] for r in rows if r.get("fresh_mismatch_first") is not None]
    # Fig. 6 (rows recorded with sweep.py's μ histograms): masked / kept sampled tokens per μ bin, summed over seeds.
    with_hist = [r for r in rows if "mu_hist_masked" in r]
    fig6 = None
    if with_hist:
        masked = [sum(col) for col in zip(*(r["mu_hist_masked"] for r in with_hist))]
        kept = [sum(col) for col in zip(*(r["mu_hist_kept"] for r in with_hist))]
        fig6 = {
            "mu_bins": run.MU_BINS[:-1] + [1.0],
            "n_runs": len(with_hist),
            "masked": masked,
            "kept": kept,
            "masked_share": [m / (m + k) if m + k else None for m, k in zip(masked, kept)],
            "sampled_share": [(m + k) / max(1, sum(masked) + sum(kept)) for m, k in zip(masked, kept)],
        }
    return {
        "n": n,
        "collapsed": collapsed,
        "collapse_rate": collapsed / n,
        "collapse_ci95_clopper_pearson": [lo, hi],
        "final_accuracy_mean": mean,
        "final_accuracy_se": se,
        "reached_20pct": len(reached),
        "steps_to_20pct_median": statistics.median(reached) if reached else None,
        "steps_to_20pct": reach,
        "fresh_mismatch_first_mean": sum(fresh) / len(fresh) if fresh else None,
        "seeds": [r["seed"] for r in rows],
        "fig6": fig6,
    }


def decide(test: dict, margin: float) -> str:
    """The pre-registered reading of one primary comparison (docs/results.md, issue 27)."""
    lo, hi = test["rate_difference_ci95_newcombe"]
    if test["p_holm"] < 0.05:
        return "DPPO-TV less stable" if test["rate_difference"] > 0 else "DPPO-TV more stable"
    if -margin <= lo and hi <= margin:
        return f"no difference larger than {margin:g}"
    return "undecided"


def analyse(args: argparse.Namespace, pooled: dict) -> dict:
    cells, seeds_used = {}, {}
    for level in args.levels:
        seeds = common_seeds(pooled, level, args.methods)
        seeds_used[level] = seeds
        if not seeds:
            print(f"[compare] level {level}: no seed finished for every method", file=sys.stderr)
            continue
        for method in args.methods:
            cells[f"{level}|{method}"] = cell([pooled[(level, method, s)] for s in seeds])

    def compare(level: str, a: str, b: str) -> dict | None:
        ca, cb = cells.get(f"{level}|{a}"), cells.get(f"{level}|{b}")
        if ca is None or cb is None:
            return None
        # Seeds paired across methods (same data order and initial weights): the discordant ones for McNemar.
        only_a = sum(
            pooled[(level, a, s)]["collapsed"] and not pooled[(level, b, s)]["collapsed"] for s in ca["seeds"]
        )
        only_b = sum(
            pooled[(level, b, s)]["collapsed"] and not pooled[(level, a, s)]["collapsed"] for s in ca["seeds"]
        )
        se = [c["final_accuracy_se"] for c in (ca, cb)]
        acc_diff = ca["final_accuracy_mean"] - cb["final_accuracy_mean"]
        half = None if None in se else Z95 * (se[0] ** 2 + se[1] ** 2) ** 0.5
        return {
            "level": level,
            "method": a,
            "against": b,
            "collapsed": [ca["collapsed"], ca["n"]],
            "against_collapsed": [cb["collapsed"], cb["n"]],
            "p_two_sided": fisher_exact(ca["collapsed"], ca["n"], cb["collapsed"], cb["n"]),
            "rate_difference": ca["collapse_rate"] - cb["collapse_rate"],
            "rate_difference_ci95_newcombe": list(newcombe_diff(ca["collapsed"], ca["n"], cb["collapsed"], cb["n"])),
            "final_accuracy_difference": acc_diff,
            "final_accuracy_difference_ci95": None if half is None else [acc_diff - half, acc_diff + half],
            "paired_discordant": [only_a, only_b],
            "mcnemar_p": mcnemar_exact(only_a, only_b),
        }

    primary = [c for lvl in args.test_levels for b in args.against if (c := compare(lvl, args.reference, b))]
    for c, p_adj in zip(primary, holm([c["p_two_sided"] for c in primary])):
        c["p_holm"] = p_adj
        c["significant_holm_0.05"] = p_adj < 0.05
        c["decision"] = decide(c, args.margin)
    secondary = [
        c for lvl in args.test_levels for a in args.secondary for b in args.against if (c := compare(lvl, a, b))
    ]
    p4 = {}
    for level in args.levels:
        ref, ch = cells.get(f"{level}|{args.reference}"), cells.get(f"{level}|clip_higher")
        if ref and ch and ref["steps_to_20pct_median"] is not None and ch["steps_to_20pct_median"] is not None:
            ratio = ref["steps_to_20pct_median"] / ch["steps_to_20pct_median"]
            p4[level] = {"ratio_of_medians": ratio, "holds": ratio <= P4_RATIO}
        else:
            p4[level] = {"ratio_of_medians": None, "holds": None}
    return {"seeds_used": seeds_used, "cells": cells, "primary_tests": primary, "secondary_tests": secondary, "p4": p4}


def analyse_blocks(args: argparse.Namespace, pooled: dict) -> dict:
    """The same analysis on each seed block alone (e.g. runs from two machines), descriptive."""
    from sweep import parse_seeds

    blocks = {}
    for block in args.seed_blocks:
        keep = set(parse_seeds(block))
        sub = {k: v for k, v in pooled.items() if k[2] in keep}
        blocks[block] = analyse(args, sub)
    return blocks


def format_tables(args: argparse.Namespace, result: dict) -> str:
    lines = [
        "| level | method | N | collapsed | 95% CI (Clopper–Pearson) | final acc mean ± s.e. | reached 20% | "
        "median steps to 20% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for level in args.levels:
        for method in args.methods:
            c = result["cells"].get(f"{level}|{method}")
            if not c:
                continue
            lo, hi = c["collapse_ci95_clopper_pearson"]
            se = "–" if c["final_accuracy_se"] is None else f"{c['final_accuracy_se']:.3f}"
            med = "–" if c["steps_to_20pct_median"] is None else f"{c['steps_to_20pct_median']:g}"
            lines.append(
                f"| {level} | {method} | {c['n']} | {c['collapsed']}/{c['n']} | [{lo:.2f}, {hi:.2f}] | "
                f"{c['final_accuracy_mean']:.3f} ± {se} | {c['reached_20pct']}/{c['n']} | {med} |"
            )
    lines += [
        "",
        "| level | comparison | collapsed | Fisher p (two-sided) | Holm p | rate difference [95% Newcombe] | "
        "final acc difference [95%] | paired McNemar p (discordant) | reading |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in result["primary_tests"] + result["secondary_tests"]:
        holm_p = f"{t['p_holm']:.3g}" if "p_holm" in t else "– (secondary)"
        lo, hi = t["rate_difference_ci95_newcombe"]
        acc = t["final_accuracy_difference_ci95"]
        acc = "–" if acc is None else f"{t['final_accuracy_difference']:+.3f} [{acc[0]:+.3f}, {acc[1]:+.3f}]"
        lines.append(
            f"| {t['level']} | {t['method']} vs {t['against']} | {t['collapsed'][0]}/{t['collapsed'][1]} vs "
            f"{t['against_collapsed'][0]}/{t['against_collapsed'][1]} | {t['p_two_sided']:.3g} | {holm_p} | "
            f"{t['rate_difference']:+.2f} [{lo:+.2f}, {hi:+.2f}] | {acc} | {t['mcnemar_p']:.3g} "
            f"({t['paired_discordant'][0]} vs {t['paired_discordant'][1]}) | {t.get('decision', '–')} |"
        )
    fig6 = [(k, c["fig6"]) for k, c in result["cells"].items() if c.get("fig6")]
    if fig6:
        bins = run.MU_BINS[:-1] + [1.0]
        heads = [f"μ {lo:g}–{hi:g}" for lo, hi in zip(bins[:-1], bins[1:])]
        lines += ["", "Fig. 6: share of sampled tokens masked or clipped, by μ bin (summed over seeds):", ""]
        lines += ["| level | method | runs | " + " | ".join(heads) + " |", "|---|---|---|" + "---|" * len(heads)]
        for key, f in fig6:
            level, method = key.split("|")
            shares = " | ".join("–" if v is None else f"{v:.4f}" for v in f["masked_share"])
            lines.append(f"| {level} | {method} | {f['n_runs']} | {shares} |")
    for block, sub in result.get("blocks", {}).items():
        lines += ["", f"Seeds {block} alone (descriptive):", "", "| level | comparison | collapsed | Fisher p |"]
        lines.append("|---|---|---|---|")
        for t in sub["primary_tests"]:
            lines.append(
                f"| {t['level']} | {t['method']} vs {t['against']} | {t['collapsed'][0]}/{t['collapsed'][1]} vs "
                f"{t['against_collapsed'][0]}/{t['against_collapsed'][1]} | {t['p_two_sided']:.3g} |"
            )
    return "\n".join(lines)


def plot(args: argparse.Namespace, result: dict, path: str) -> str:
    """Collapse rate (Clopper–Pearson 95% bars) and final accuracy (± s.e.) per method, one group per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.0))
    cmap = plt.get_cmap("tab10")
    width = 0.8 / max(1, len(args.methods))
    for i, method in enumerate(args.methods):
        xs, rate, err, acc, acc_err = [], [], [[], []], [], []
        for j, level in enumerate(args.levels):
            c = result["cells"].get(f"{level}|{method}")
            if not c:
                continue
            lo, hi = c["collapse_ci95_clopper_pearson"]
            xs.append(j + (i - (len(args.methods) - 1) / 2) * width)
            rate.append(c["collapse_rate"])
            err[0].append(c["collapse_rate"] - lo)
            err[1].append(hi - c["collapse_rate"])
            acc.append(c["final_accuracy_mean"])
            acc_err.append(c["final_accuracy_se"] or 0.0)
        axes[0].bar(xs, rate, width, yerr=err, color=cmap(i), label=method, capsize=2, error_kw={"lw": 0.8})
        axes[1].bar(xs, acc, width, yerr=acc_err, color=cmap(i), label=method, capsize=2, error_kw={"lw": 0.8})
    for ax, title in zip(axes, ("collapse rate (bars: Clopper–Pearson 95%)", "final training accuracy (mean ± s.e.)")):
        labels = []
        for level in args.levels:
            n = result["seeds_used"].get(level, [])
            ref = result["cells"].get(f"{level}|{args.reference}")
            x = (
                ""
                if not ref or ref["fresh_mismatch_first_mean"] is None
                else f"\n{ref['fresh_mismatch_first_mean']:.1e}"
            )
            labels.append(f"{level}{x}\nN={len(n)}")
        ax.set_xticks(range(len(args.levels)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.tick_params(labelsize=8)
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        "mismatch sweep, pooled seeds (level, fresh mean |π − μ| at the first generation, seeds)", fontsize=10
    )
    fig.tight_layout()
    run._save_small(fig, path)
    return path


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    pooled, sources = pool_runs(args.sweeps)
    result = analyse(args, pooled)
    if args.seed_blocks:
        result["blocks"] = {
            b: {k: v for k, v in sub.items() if k in ("seeds_used", "primary_tests")}
            for b, sub in analyse_blocks(args, pooled).items()
        }
    n_min = min((len(s) for s in result["seeds_used"].values()), default=0)
    if args.target_seeds and n_min < args.target_seeds:
        # The pre-registered reading is taken once, at the planned N; an interim table shows it only as "at this N".
        for t in result["primary_tests"]:
            t["decision_at_this_n"], t["decision"] = t["decision"], "none (interim)"
    if args.target_seeds:
        result["status"] = (
            f"final: {n_min} seeds per arm"
            if n_min >= args.target_seeds
            else f"interim: {n_min} of {args.target_seeds} planned seeds per arm; decides nothing"
        )
    os.makedirs(args.output_dir, exist_ok=True)
    argv = sys.argv[1:] if argv is None else argv
    out = {
        "command": " ".join(["python", os.path.relpath(__file__, run.REPO_ROOT), *argv]),
        "sources": sources,
        "analysis": {
            "outcome": "collapsed (sweep.py / run.py criterion)",
            "test": "Fisher's exact test, two-sided; Holm–Bonferroni over the primary comparisons",
            "interval": "Clopper–Pearson exact 95%",
            "difference_interval": "Newcombe hybrid score 95% (method 10) of the collapse-rate difference; "
            "final accuracy difference ± 1.96 √(s.e.₁² + s.e.₂²)",
            "decided": f"Holm p < 0.05, or the 95% Newcombe interval inside ±{args.margin:g}",
            "reference": args.reference,
            "against": args.against,
            "secondary": args.secondary,
            "test_levels": args.test_levels,
            "reach_accuracy": run.REACH_ACCURACY,
            "p4": f"median steps to {run.REACH_ACCURACY:g} of {args.reference} <= {P4_RATIO} x clip_higher's",
        },
        **result,
        "plot": os.path.basename(plot(args, result, os.path.join(args.output_dir, "compare.png"))),
    }
    with open(os.path.join(args.output_dir, "compare.json"), "w") as f:
        json.dump(run._rounded(out), f, indent=1)
        f.write("\n")
    tables = format_tables(args, result)
    with open(os.path.join(args.output_dir, "compare.md"), "w") as f:
        status = f"Status: {result['status']}.\n\n" if "status" in result else ""
        f.write(f"`{out['command']}`\n\n{status}{tables}\n")
    print(tables, file=sys.stderr)
    keys = ("primary_tests", "secondary_tests", "p4", "seeds_used", "status")
    print(json.dumps(run._rounded({k: out[k] for k in keys if k in out})))
    return out


if __name__ == "__main__":
    main()
