"""Curves and a one-line summary of a run, from its `trainer.state.log_history` (or the saved `log_history.json`).

`make_training_figure` draws two panels against the optimizer step:

1. **Learning**: reward, training accuracy (and the format reward), and the `eval/<name>/avg@k` evaluations.
2. **Trust region**: the share of completion tokens DPPO masks for A > 0 and A < 0 (`dppo/mask_ratio_pos_adv`,
   `dppo/mask_ratio_neg_adv`; for the `trust_region` baselines, the share their clip zeroes), the share of tokens whose
   ratio π/μ hit the cap (`dppo/ratio_capped_frac`), and, on the right axis, the mean |π − μ| of the sampled tokens
   (`dppo/mismatch_abs_mean`). When every step is logged, that mismatch is split in two: **fresh** steps (the first
   optimizer step on a rollout, whose log carries the rollout's reward: π differs from μ only by the engine's
   numerics) and **drifted** steps (the later steps on the same rollout: π has also moved by the updates since).
"""

from __future__ import annotations

import math
import os

__all__ = ["make_training_figure", "plot_training_curves", "split_fresh_drifted", "summarize_run", "summary_line"]

LEARNING_KEYS = ("reward", "rewards/accuracy_reward/mean", "rewards/format_reward/mean")
ACCURACY_KEY = "rewards/accuracy_reward/mean"
MISMATCH_KEY = "dppo/mismatch_abs_mean"
TRUST_REGION_RATES = {
    "dppo/mask_ratio_pos_adv": "masked, A > 0",
    "dppo/mask_ratio_neg_adv": "masked, A < 0",
    "dppo/ratio_capped_frac": "π/μ at the cap",
}


def _series(history: list[dict], key: str, entries: list[dict] | None = None) -> list[tuple[int, float]]:
    return [
        (e["step"], e[key])
        for e in (history if entries is None else entries)
        if isinstance(e.get(key), (int, float)) and math.isfinite(e[key])
    ]


def _eval_keys(history: list[dict]) -> list[str]:
    return sorted({k for e in history for k in e if k.startswith("eval/") and "/avg@" in k})


def split_fresh_drifted(history: list[dict]) -> tuple[list[dict], list[dict]] | None:
    """Training logs split into (fresh, drifted) steps, or None when the logs cannot tell them apart.

    A rollout's generation metrics (`reward`, ...) are logged with the optimizer step that generated it, so with
    one log per step (`logging_steps=1`) a log that has them is a fresh step and one without is a drifted step.
    With coarser logging, a log averages both kinds and no split is possible.
    """
    logs = [e for e in history if MISMATCH_KEY in e]
    steps = [e["step"] for e in logs]
    if len(logs) < 2 or any(b - a != 1 for a, b in zip(steps, steps[1:])):
        return None
    return [e for e in logs if "reward" in e], [e for e in logs if "reward" not in e]


def make_training_figure(history: list[dict], title: str | None = None):
    """A matplotlib `Figure` of the run (the learning panel, plus the trust-region panel when DPPO metrics were
    logged), or None if the history holds nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    learning = {k: _series(history, k) for k in (*LEARNING_KEYS, *_eval_keys(history))}
    learning = {k: v for k, v in learning.items() if v}
    rates = {k: _series(history, k) for k in TRUST_REGION_RATES}
    rates = {k: v for k, v in rates.items() if v}
    if not learning and not rates:
        return None

    panels = int(bool(learning)) + int(bool(rates))
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.9 * panels), sharex=True, squeeze=False)
    axes = list(axes[:, 0])
    axes[-1].set_xlabel("optimizer step")
    if title:
        fig.suptitle(title, fontsize=10)
    if learning:
        ax = axes.pop(0)
        for key, points in learning.items():
            ax.plot(*zip(*points), "o--" if key.startswith("eval/") else "-", label=key, markersize=4)
        ax.set_ylabel("reward / accuracy")
        if all(0 <= v <= 1 for points in learning.values() for _, v in points):
            ax.set_ylim(-0.02, 1.02)
        ax.set_title("learning", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    if rates:
        ax = axes.pop(0)
        for key, points in rates.items():
            ax.plot(*zip(*points), "-", label=TRUST_REGION_RATES[key], linewidth=1.2)
        ax.set_ylabel("share of completion tokens")
        ax.set_ylim(bottom=0)
        ax.set_title("trust region (mask rate, ratio cap) and policy mismatch |π − μ|", fontsize=9)
        ax.grid(alpha=0.3)
        mismatch = ax.twinx()
        split = split_fresh_drifted(history)
        if split is None:
            mismatch.plot(*zip(*_series(history, MISMATCH_KEY)), ":", color="black", label="mean |π − μ|")
        else:
            fresh, drifted = split
            for entries, style, label in ((fresh, "s", "fresh rollout"), (drifted, ".", "drifted (later steps)")):
                points = _series(history, MISMATCH_KEY, entries)
                if points:
                    mismatch.plot(*zip(*points), style, color="black", alpha=0.7, markersize=3.5,
                                  label=f"mean |π − μ|, {label}")  # fmt: skip
        mismatch.set_ylabel("mean |π − μ| (sampled token)")
        mismatch.set_ylim(bottom=0)
        handles = ax.get_legend_handles_labels()
        twin = mismatch.get_legend_handles_labels()
        # Below the panel: the per-step series fill the whole plot area.
        ax.legend(
            handles[0] + twin[0], handles[1] + twin[1], fontsize=7, ncol=3, loc="upper center",
            bbox_to_anchor=(0.5, -0.16),
        )  # fmt: skip
    for ax in fig.axes:
        ax.xaxis.set_tick_params(labelbottom=True)
    fig.tight_layout()
    return fig


def plot_training_curves(history: list[dict], path: str, title: str | None = None) -> str | None:
    """Save `make_training_figure` as a PNG at `path`; returns the path, or None if there was nothing to plot."""
    fig = make_training_figure(history, title=title)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize_run(history: list[dict]) -> dict:
    """The run's headline numbers: mean reward, first/last training accuracy, first/last evaluation, and the trust
    region's mean mask rate, peak mean |π − μ| (and its mean on fresh rollouts when every step was logged)."""
    train = [e for e in history if "reward" in e]
    summary: dict = {}
    if train:
        summary["mean_reward"] = _mean([e["reward"] for e in train])
        summary["accuracy_first"] = (train[0]["step"], train[0].get(ACCURACY_KEY, float("nan")))
        summary["accuracy_last"] = (train[-1]["step"], train[-1].get(ACCURACY_KEY, float("nan")))
    for key in _eval_keys(history):
        points = _series(history, key)
        summary.setdefault("eval", {})[key] = (points[0], points[-1])
    masks = [v for _, v in _series(history, "dppo/mask_ratio")]
    if masks:
        summary["mask_rate_mean"] = _mean(masks)
        summary["mask_rate_max"] = max(masks)
    mismatch = [v for _, v in _series(history, MISMATCH_KEY)]
    if mismatch:
        summary["mismatch_peak"] = max(mismatch)
        split = split_fresh_drifted(history)
        if split is not None:
            summary["mismatch_fresh_mean"] = _mean([v for _, v in _series(history, MISMATCH_KEY, split[0])])
            summary["mismatch_drifted_mean"] = _mean([v for _, v in _series(history, MISMATCH_KEY, split[1])])
    return summary


def summary_line(summary: dict) -> str:
    """`summarize_run`'s numbers as the line the recipe prints at the end."""
    parts = []
    if "mean_reward" in summary:
        (s0, a0), (s1, a1) = summary["accuracy_first"], summary["accuracy_last"]
        parts.append(f"Mean reward over training: {summary['mean_reward']:.3f}")
        parts.append(f"training accuracy: {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1})")
    for key, ((s0, v0), (s1, v1)) in summary.get("eval", {}).items():
        parts.append(f"{key.removeprefix('eval/')}: {v0:.3f} (step {s0}) -> {v1:.3f} (step {s1})")
    if "mask_rate_mean" in summary:
        parts.append(
            f"trust region: mean mask rate {summary['mask_rate_mean']:.2%} (max {summary['mask_rate_max']:.2%})"
        )
    if "mismatch_peak" in summary:
        text = f"peak mean |π-μ| {summary['mismatch_peak']:.4f}"
        if "mismatch_fresh_mean" in summary:
            text += (
                f" (mean: fresh rollouts {summary['mismatch_fresh_mean']:.4f}, "
                f"drifted steps {summary['mismatch_drifted_mean']:.4f})"
            )
        parts.append(text)
    return " | ".join(parts)


def summarize_async_run(history: list[dict]) -> dict:
    """First/last reward, staleness and DPPO mask rates of an asynchronous run's log history."""
    steps = [h for h in history if "dppo/mask_ratio" in h]
    if not steps:
        return {"steps": 0}
    stale_mask = [h[k] for h in steps for k in h if k.startswith("dppo/staleness_") and k.endswith("mask_ratio")]
    return {
        "steps": len(steps),
        "reward_first": steps[0].get("reward"),
        "reward_last": steps[-1].get("reward"),
        "staleness_mean": sum(h.get("sample/staleness_mean", 0.0) for h in steps) / len(steps),
        "staleness_max": max(h.get("sample/staleness_max", 0.0) for h in steps),
        "mask_ratio_mean": sum(h["dppo/mask_ratio"] for h in steps) / len(steps),
        "mask_ratio_max_by_staleness": max(stale_mask) if stale_mask else 0.0,
    }
