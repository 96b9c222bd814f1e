# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""
Draw two or more runs of `train_dapo_math.py` on one plot, from their output folders (each has `log_history.json`).

```bash
# The CPU demo with DPPO (the default) and with GRPO's ratio clip on the same μ-anchored data path
python examples/train_dapo_math.py
python examples/train_dapo_math.py --trust_region grpo_clip --output_dir outputs/tiny-math-grpo-clip
python examples/compare_runs.py outputs/tiny-math-dppo outputs/tiny-math-grpo-clip
# -> outputs/compare_runs.png, and one summary line per run
```

Top panel: training accuracy (solid) and the evaluations' avg@k (markers). Bottom panel: the share of completion
tokens whose gradient the trust region zeroes (`dppo/mask_ratio`: DPPO's mask, or the baseline's clip) and, on the
right axis, the mean |π − μ| of the sampled tokens.
"""

from __future__ import annotations

import argparse
import json
import os

from dapo_math.plots import ACCURACY_KEY, MISMATCH_KEY, summarize_run, summary_line

MASK_KEY = "dppo/mask_ratio"


def load_history(run_dir: str) -> list[dict]:
    """The `log_history.json` a run saved in its output folder."""
    path = os.path.join(run_dir, "log_history.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: pass the `--output_dir` of a finished `train_dapo_math.py` run (it writes "
            "log_history.json at the end of training)."
        )
    with open(path) as f:
        return json.load(f)


def _points(history: list[dict], key: str) -> tuple[list, list]:
    pairs = [(e["step"], e[key]) for e in history if isinstance(e.get(key), (int, float))]
    return ([s for s, _ in pairs], [v for _, v in pairs]) if pairs else ([], [])


def make_comparison_figure(histories: dict[str, list[dict]]):
    """A two-panel matplotlib `Figure` comparing the runs in `{label: log_history}`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (learn, trust) = plt.subplots(2, 1, figsize=(8, 7.2), sharex=True)
    mismatch = trust.twinx()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, history) in enumerate(histories.items()):
        color = colors[i % len(colors)]
        learn.plot(*_points(history, ACCURACY_KEY), "-", color=color, label=f"{label}: training accuracy")
        for key in sorted({k for e in history for k in e if k.startswith("eval/") and "/avg@" in k}):
            learn.plot(*_points(history, key), "o--", color=color, markersize=4, label=f"{label}: {key}")
        trust.plot(*_points(history, MASK_KEY), "-", color=color, linewidth=1.2, label=f"{label}: tokens zeroed")
        steps, values = _points(history, MISMATCH_KEY)
        mismatch.plot(steps, values, ".", color=color, markersize=3, alpha=0.6, label=f"{label}: mean |π − μ|")
    learn.set_ylabel("accuracy")
    learn.set_ylim(-0.02, 1.02)
    learn.set_title("learning", fontsize=9)
    learn.legend(fontsize=7, loc="upper left")
    trust.set_ylabel("share of completion tokens zeroed")
    trust.set_ylim(bottom=0)
    mismatch.set_ylabel("mean |π − μ| (sampled token)")
    mismatch.set_ylim(bottom=0)
    trust.set_title("trust region (DPPO mask or ratio clip) and policy mismatch", fontsize=9)
    handles, labels = trust.get_legend_handles_labels()
    twin_handles, twin_labels = mismatch.get_legend_handles_labels()
    trust.legend(handles + twin_handles, labels + twin_labels, fontsize=7, loc="upper left")
    trust.set_xlabel("optimizer step")
    for ax in (learn, trust):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def compare_runs(run_dirs: list[str], output: str, labels: list[str] | None = None) -> dict[str, dict]:
    """Plot the runs into `output` (PNG) and return `{label: summarize_run(history)}`."""
    if len(run_dirs) < 2:
        raise ValueError(f"compare_runs needs at least two run folders, got {len(run_dirs)}.")
    labels = labels or [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    if len(labels) != len(run_dirs) or len(set(labels)) != len(labels):
        raise ValueError(f"--labels must give one distinct label per run folder ({len(run_dirs)}), got {labels}.")
    histories = {label: load_history(d) for label, d in zip(labels, run_dirs)}
    import matplotlib.pyplot as plt

    fig = make_comparison_figure(histories)
    os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return {label: summarize_run(history) for label, history in histories.items()}


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("run_dirs", nargs="+", help="Output folders of train_dapo_math.py runs (two or more).")
    parser.add_argument("--labels", nargs="+", help="One label per run (default: the folder names).")
    parser.add_argument(
        "--output", help="Where to save the PNG (default: compare_runs.png next to the first run's folder)."
    )
    args = parser.parse_args(argv)
    output = args.output or os.path.join(
        os.path.dirname(os.path.abspath(os.path.normpath(args.run_dirs[0]))), "compare_runs.png"
    )
    summaries = compare_runs(args.run_dirs, output, args.labels)
    for label, summary in summaries.items():
        print(f"{label}: {summary_line(summary)}")
    print(f"Saved the comparison to {output}")
    return summaries


if __name__ == "__main__":
    main()
