# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""
CPU-scale version of the paper's §5 sanity test (Qi et al., arXiv 2602.04879): RL-fine-tune a model on problems it
already solves sometimes, with bf16 rollouts (vLLM colocate) and an fp32 trainer, and compare trust regions.

```bash
python benchmarks/sanity/run.py --output-dir benchmarks/sanity/results          # the committed results
python benchmarks/sanity/run.py --quick --output-dir /tmp/sanity-quick           # smoke test (tests/)
python benchmarks/sanity/run.py --methods dppo_tv,grpo_clip --seeds 0,1 --steps 40
```

Every (method, seed) run trains the shipped tiny Qwen3 (`examples/tiny_math_model`) on a fixed subset of the bundled
tiny-math train split (its first 32 problems) for the same number of optimizer steps, with the same data order per
seed. The learning rate is deliberately high and each generation batch feeds 4 optimizer steps, so the policy drifts
from the engine's μ within a batch (the paper's off-policy setting): a stability test needs room to be unstable.
Runs are spread over `--workers` processes; each process runs its trainers one after another. Writes `results.json`
(per-step curves, final numbers, the Fig. 6 masked-token statistics), `tables.md` and PNG plots to `--output-dir`.
See docs/results.md for the settings, the scaling and the reading.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

from dppo_dev.offline import set_offline_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

set_offline_env()

from dppo_trl.core.registry import TRUST_REGIONS  # noqa: E402

DEFAULT_MODEL = os.path.join(REPO_ROOT, "examples", "tiny_math_model")
DEFAULT_DATA = os.path.join(REPO_ROOT, "examples", "data", "tiny_math", "train.jsonl")
PORT_BASE = 29800  # the benchmark's block: 29800-29899

# Method name -> DPPOConfig overrides. All share the μ-anchored data path; only the trust region differs: DPPO with
# each binary divergence (δ = 0.15 TV / 0.05 KL, the authors'), the recompute anchor (§5.2 control), then every
# baseline of `dppo_trl.core.registry.TRUST_REGIONS` (a baseline added there appears here by itself).
METHODS: dict[str, dict] = {
    "dppo_tv": {"divergence": "binary_tv"},
    "dppo_kl": {"divergence": "binary_kl"},
    "dppo_recompute": {"anchor": "recompute"},
    **{name: {"trust_region": name} for name in TRUST_REGIONS if name != "dppo"},
}
HEADLINE = ("dppo_tv", "grpo_clip", "pg_is")
CURVE_KEYS = {
    "accuracy": "rewards/accuracy_reward/mean",
    "reward": "reward",
    "mismatch_abs_mean": "dppo/mismatch_abs_mean",
    "mismatch_abs_max": "dppo/mismatch_abs_max",
    "mismatch_kl_mean": "dppo/mismatch_kl_mean",
    "mask_ratio": "dppo/mask_ratio",
    "entropy": "entropy",
    "ratio_max": "dppo/ratio_max",
}
# Collapse / efficiency criteria (stated in docs/results.md). Accuracy is smoothed over SMOOTH generation batches.
SMOOTH = 3
REACH_ACCURACY = 0.2  # about twice the shipped model's T = 1 accuracy on the 32-problem subset (0.09)
COLLAPSE_DROP = 0.2
MU_BINS = [0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 0.8, 0.95, 1.0000001]


def training_settings(args: argparse.Namespace) -> dict:
    """The DPPOConfig fields every run shares (the scaled-down §5 setting)."""
    return dict(
        use_cpu=True,
        bf16=False,  # trainer in fp32; the engine samples in bf16 (the paper's mismatch)
        use_vllm=True,
        vllm_cpu_dtype="bfloat16",
        vllm_mode="colocate",
        vllm_max_model_length=160,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        max_grad_norm=1.0,
        adam_beta2=0.999,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        steps_per_generation=args.steps_per_generation,
        num_iterations=1,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        scale_rewards="none",  # authors: GRPO advantage without std normalisation
        loss_type="dapo",
        ratio_cap=args.ratio_cap,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        shuffle_dataset=True,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Worker: runs a list of (method, seed) trainers in this process
# ---------------------------------------------------------------------------------------------------------------------
class MaskedTokenStats:
    """`trust_region_observers` hook: μ-probability / entropy of masked (keep == 0) vs kept tokens (paper Fig. 6)."""

    def __init__(self, trainer, steps_per_generation: int):
        self.trainer = trainer
        self.steps_per_generation = steps_per_generation
        self.sums = {k: 0.0 for k in ("n_masked", "n_kept", "mu_masked", "mu_kept", "ent_masked", "ent_kept")}
        self.hist_masked = [0] * (len(MU_BINS) - 1)
        self.hist_kept = [0] * (len(MU_BINS) - 1)
        self.masked_tokens: Counter = Counter()
        self.all_tokens: Counter = Counter()
        # |π − μ| at the first optimizer step after each generation, where π still equals the weights that
        # generated: this is the pure train–inference (fp32 vs bf16) mismatch, without policy drift.
        self.fresh_mismatch: list[tuple[int, float]] = []

    def __call__(self, view: dict) -> None:
        import torch

        if view["mode"] != "train":
            return
        valid = view["valid"].bool()
        keep = view["keep"].bool() & valid
        masked = ~view["keep"].bool() & valid
        mu_p = view["mu_logps"].float().exp()
        ent = view["entropies"].float() if view["entropies"] is not None else torch.zeros_like(mu_p)
        s = self.sums
        s["n_masked"] += masked.sum().item()
        s["n_kept"] += keep.sum().item()
        s["mu_masked"] += mu_p[masked].sum().item()
        s["mu_kept"] += mu_p[keep].sum().item()
        s["ent_masked"] += ent[masked].sum().item()
        s["ent_kept"] += ent[keep].sum().item()
        bins = torch.tensor(MU_BINS)
        for sel, hist in ((masked, self.hist_masked), (keep, self.hist_kept)):
            idx = torch.bucketize(mu_p[sel].clamp(max=1.0), bins, right=True) - 1
            for b, c in zip(*torch.unique(idx.clamp(0, len(hist) - 1), return_counts=True)):
                hist[int(b)] += int(c)
        ids = view["completion_ids"]
        if ids is not None:
            self.masked_tokens.update(ids[masked].tolist())
            self.all_tokens.update(ids[valid].tolist())
        step = self.trainer.state.global_step
        if step % self.steps_per_generation == 0 and valid.any():
            diff = (view["pi_logps"].float().exp() - mu_p).abs()[valid].mean().item()
            self.fresh_mismatch.append((step + 1, diff))

    def summary(self, tokenizer, top: int = 10) -> dict:
        s = self.sums

        def mean(num: str, den: str) -> float | None:
            return s[num] / s[den] if s[den] > 0 else None

        most = []
        for token_id, count in self.masked_tokens.most_common(top):
            most.append(
                {
                    "token_id": int(token_id),
                    "token": tokenizer.decode([int(token_id)]),
                    "masked": int(count),
                    "seen": int(self.all_tokens[token_id]),
                    "masked_frac": count / self.all_tokens[token_id] if self.all_tokens[token_id] else None,
                }
            )
        return {
            "n_masked": int(s["n_masked"]),
            "n_kept": int(s["n_kept"]),
            "masked_frac": s["n_masked"] / max(s["n_masked"] + s["n_kept"], 1),
            "mu_prob_masked": mean("mu_masked", "n_masked"),
            "mu_prob_kept": mean("mu_kept", "n_kept"),
            "entropy_masked": mean("ent_masked", "n_masked"),
            "entropy_kept": mean("ent_kept", "n_kept"),
            "mu_bins": MU_BINS[:-1] + [1.0],
            "mu_hist_masked": self.hist_masked,
            "mu_hist_kept": self.hist_kept,
            "most_masked_tokens": most,
            "fresh_mismatch": self.fresh_mismatch,
        }


def run_one(method: str, seed: int, args: argparse.Namespace, port: int) -> dict:
    """Train one (method, seed) and return its curves, final numbers and masked-token statistics."""
    import torch
    from transformers import AutoTokenizer

    from dapo_math.data import load_dapo_math
    from dapo_math.rewards import accuracy_reward
    from dppo_trl import DPPOConfig, DPPOTrainer

    os.environ["MASTER_PORT"] = str(port)
    torch.manual_seed(seed)
    dataset = load_dapo_math(args.data, split="train", max_samples=args.max_train_samples)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    mismatch = getattr(args, "mismatch", "none")
    engine_fields: dict = {}
    weight_mismatch = None
    if mismatch != "none":
        # Research-only (see mismatch.py): the engine samples from perturbed copies of the trainer's weights and/or
        # computes differently (fp8 KV cache, another engine dtype); the engine part applies while TRL builds it.
        from mismatch import engine_config_fields, install_weight_mismatch, parse_level

        weight_mismatch, engine_mismatch = parse_level(mismatch, seed=getattr(args, "mismatch_seed", 0))
        # The induced mismatch is the experiment: the weight-sync check would report it at every generation.
        engine_fields = {**engine_config_fields(engine_mismatch), "sync_mismatch_action": "off"}
    with tempfile.TemporaryDirectory() as tmp:
        settings = {**training_settings(args), **METHODS[method], **engine_fields}
        config = DPPOConfig(output_dir=tmp, seed=seed, data_seed=seed, **settings)
        trainer = DPPOTrainer(
            model=args.model,
            reward_funcs=[accuracy_reward],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        stats = MaskedTokenStats(trainer, args.steps_per_generation)
        trainer.trust_region_observers.append(stats)
        if weight_mismatch is not None and not weight_mismatch.off:
            install_weight_mismatch(trainer, weight_mismatch)
        start = time.time()
        trainer.train()
        seconds = time.time() - start
        history = trainer.state.log_history
        engine_dtype = str(trainer.vllm_generation.llm.llm_engine.model_config.dtype)
        kv_cache_dtype = str(trainer.vllm_generation.llm.llm_engine.vllm_config.cache_config.cache_dtype)
        trainer_dtype = str(next(trainer.model.parameters()).dtype)
        del trainer  # frees the engine before the next run in this process
    curves = {}
    for name, key in CURVE_KEYS.items():
        curves[name] = [[e["step"], float(e[key])] for e in history if key in e and e[key] is not None]
    return {
        "method": method,
        "seed": seed,
        "config": METHODS[method],
        "mismatch": getattr(args, "mismatch", "none"),
        "train_seconds": round(seconds, 1),
        "engine_dtype": engine_dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "trainer_dtype": trainer_dtype,
        "curves": curves,
        "fig6": stats.summary(tokenizer),
    }


def worker(spec_path: str) -> None:
    """Entry point of a worker process: run each (method, seed) of the spec, write each result as it finishes."""
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(spec["threads"])
    failed = 0
    for job in spec["jobs"]:
        started = time.time()
        # A job may override shared settings (the mismatch sweep runs several `--mismatch` levels in one pool).
        args = argparse.Namespace(**{**spec["args"], **job.get("args", {})})
        try:
            result = run_one(job["method"], job["seed"], args, job["port"])
        except Exception as err:  # noqa: BLE001 - one failed run must not lose the others
            import traceback

            traceback.print_exc()
            result = {"method": job["method"], "seed": job["seed"], "error": f"{type(err).__name__}: {err}"}
            failed += 1
        result["wall_seconds"] = round(time.time() - started, 1)
        # Written whole, then renamed: a sweep reading finished runs while this worker goes on never sees half a file.
        with open(job["out"] + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(job["out"] + ".tmp", job["out"])
        print(f"[sanity] {job['method']} seed={job['seed']} done in {result['wall_seconds']}s", flush=True)
    if failed:
        sys.exit(1)  # keeps this worker's log (tracebacks) next to the results


# ---------------------------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------------------------
def _smoothed(points: list[list[float]], window: int = SMOOTH) -> list[tuple[int, float]]:
    out = []
    for i in range(len(points)):
        chunk = points[max(0, i - window + 1) : i + 1]
        out.append((int(points[i][0]), sum(v for _, v in chunk) / len(chunk)))
    return out


def run_summary(result: dict) -> dict:
    """Final numbers of one run: final/peak/initial accuracy, steps to REACH_ACCURACY, collapse, peak mismatch."""
    acc = result["curves"]["accuracy"]
    smooth = _smoothed(acc)
    final = smooth[-1][1] if smooth else float("nan")
    peak = max((v for _, v in smooth), default=float("nan"))
    initial = acc[0][1] if acc else float("nan")
    reach = next((s for s, v in smooth if v >= REACH_ACCURACY), None)
    mismatch = [v for _, v in result["curves"]["mismatch_abs_mean"]]
    mismatch_max = [v for _, v in result["curves"]["mismatch_abs_max"]]
    fresh = [v for _, v in result["fig6"]["fresh_mismatch"]]
    mask = [v for _, v in result["curves"]["mask_ratio"]]
    entropy = [v for _, v in result["curves"]["entropy"]]
    return {
        "initial_accuracy": initial,
        "final_accuracy": final,
        "peak_accuracy": peak,
        "steps_to_reach": reach,
        # Collapse: the smoothed accuracy ends COLLAPSE_DROP below its peak, or below half of where it started
        # (the second case catches runs that fall to 0 before they ever climb).
        "collapsed": bool(smooth) and final < max(peak - COLLAPSE_DROP, 0.5 * initial),
        "peak_mismatch_abs_mean": max(mismatch, default=float("nan")),
        "peak_mismatch_abs_max": max(mismatch_max, default=float("nan")),
        "peak_fresh_mismatch": max(fresh, default=float("nan")),
        "mean_mask_ratio": sum(mask) / len(mask) if mask else float("nan"),
        "final_entropy": entropy[-1] if entropy else float("nan"),
    }


def aggregate(results: list[dict]) -> dict:
    """Per method: the runs' summaries and mean / min / max of the final numbers over seeds."""
    methods: dict[str, dict] = {}
    for result in results:
        if "error" in result:
            methods.setdefault(result["method"], {"runs": []})["runs"].append(result)
            continue
        result["summary"] = run_summary(result)
        methods.setdefault(result["method"], {"runs": []})["runs"].append(result)
    for entry in methods.values():
        ok = [r for r in entry["runs"] if "summary" in r]
        if not ok:
            continue
        stats = {}
        for key in (
            "final_accuracy",
            "peak_accuracy",
            "initial_accuracy",
            "peak_mismatch_abs_mean",
            "peak_fresh_mismatch",
            "mean_mask_ratio",
            "final_entropy",
        ):
            values = [r["summary"][key] for r in ok]
            stats[key] = {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}
        reach = [r["summary"]["steps_to_reach"] for r in ok]
        stats["steps_to_reach"] = reach
        stats["collapsed_runs"] = sum(r["summary"]["collapsed"] for r in ok)
        stats["n_seeds"] = len(ok)
        fig6 = _merge_fig6([r["fig6"] for r in ok])
        entry["stats"] = stats
        entry["fig6"] = fig6
    return methods


def _merge_fig6(parts: list[dict]) -> dict:
    n_m = sum(p["n_masked"] for p in parts)
    n_k = sum(p["n_kept"] for p in parts)

    def weighted(key: str, count: str) -> float | None:
        total = sum(p[count] for p in parts)
        if total == 0:
            return None
        return sum((p[key] or 0.0) * p[count] for p in parts) / total

    tokens: dict[str, dict] = {}
    for p in parts:
        for t in p["most_masked_tokens"]:
            entry = tokens.setdefault(t["token"], {"token": t["token"], "masked": 0, "seen": 0})
            entry["masked"] += t["masked"]
            entry["seen"] += t["seen"]
    most = sorted(tokens.values(), key=lambda t: -t["masked"])[:10]
    for t in most:
        t["share_of_masked"] = t["masked"] / n_m if n_m else None
    return {
        "n_masked": n_m,
        "n_kept": n_k,
        "masked_frac": n_m / max(n_m + n_k, 1),
        "mu_prob_masked": weighted("mu_prob_masked", "n_masked"),
        "mu_prob_kept": weighted("mu_prob_kept", "n_kept"),
        "entropy_masked": weighted("entropy_masked", "n_masked"),
        "entropy_kept": weighted("entropy_kept", "n_kept"),
        "mu_bins": parts[0]["mu_bins"],
        "mu_hist_masked": [sum(p["mu_hist_masked"][i] for p in parts) for i in range(len(parts[0]["mu_hist_masked"]))],
        "mu_hist_kept": [sum(p["mu_hist_kept"][i] for p in parts) for i in range(len(parts[0]["mu_hist_kept"]))],
        "most_masked_tokens": most,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------------------------
PANELS = (
    ("accuracy", "training accuracy (rollouts)"),
    ("mismatch_abs_mean", "mean |π − μ| (solid: every step; dotted: fresh rollout)"),
    ("mask_ratio", "masked / clipped token fraction"),
    ("entropy", "policy entropy"),
)


def _points(run: dict, key: str) -> list:
    # The fresh (pure bf16-vs-fp32) mismatch is recorded by the observer, not by the trainer's logger.
    return run["fig6"]["fresh_mismatch"] if key == "mismatch_fresh" else run["curves"][key]


def _binned(points: list, bin_size: int) -> dict[int, float]:
    """Average per-step points over each generation batch (`bin_size` steps), keyed by the batch's last step."""
    bins: dict[int, list[float]] = {}
    for step, value in points:
        bins.setdefault((int(step) - 1) // bin_size, []).append(value)
    return {(b + 1) * bin_size: sum(v) / len(v) for b, v in bins.items()}


def _band(runs: list[dict], key: str, bin_size: int = 1) -> tuple[list, list, list, list]:
    """Mean / min / max over seeds at the (binned) steps every seed logged."""
    series = [_binned(_points(r, key), bin_size) for r in runs]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    values = [[s[t] for s in series] for t in steps]
    return steps, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def _save_small(fig, path: str) -> None:
    """Save at 80 dpi as a 64-colour palette PNG: a few tens of kB instead of a few hundred, for the repository."""
    import matplotlib.pyplot as plt
    from PIL import Image

    fig.savefig(path, dpi=80)
    plt.close(fig)
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=64)
    small.save(path, optimize=True)


def plot_curves(methods: dict, names: list[str], path: str, title: str, bin_size: int = 1) -> str:
    """2x2 panels (accuracy, mismatch, mask rate, entropy); per-step curves averaged per generation batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    cmap = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    for i, name in enumerate(names):
        runs = [r for r in methods.get(name, {}).get("runs", []) if "curves" in r]
        if not runs:
            continue
        for ax, (key, label) in zip(axes.flat, PANELS):
            # Accuracy is logged once per generation already; binning aligns every panel on generation batches.
            steps, mean, lo, hi = _band(runs, key, bin_size)
            if not steps:
                continue
            ax.plot(steps, mean, color=cmap(i), lw=1.4, label=f"{name} (n={len(runs)})")
            if len(runs) > 1:
                ax.fill_between(steps, lo, hi, color=cmap(i), alpha=0.18, lw=0)
            ax.set_title(label, fontsize=10)
            if key == "mismatch_abs_mean":
                steps, mean, _, _ = _band(runs, "mismatch_fresh", bin_size)
                ax.plot(steps, mean, color=cmap(i), lw=0.9, ls=":")
    for ax in axes.flat:
        ax.set_xlabel(f"optimizer step (mean over each {bin_size}-step generation batch)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    axes[0, 1].set_yscale("log")
    axes[0, 0].legend(fontsize=7, ncol=2 if len(names) > 6 else 1)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save_small(fig, path)
    return path


def plot_fig6(methods: dict, names: list[str], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in names if methods.get(n, {}).get("fig6")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    x = range(len(names))
    for ax, (key, label) in zip(
        axes, (("mu_prob", "μ(y_t) of the token"), ("entropy", "policy entropy at the token"))
    ):
        masked = [methods[n]["fig6"][f"{key}_masked"] for n in names]
        kept = [methods[n]["fig6"][f"{key}_kept"] for n in names]
        ax.bar([i - 0.2 for i in x], [v if v is not None else 0 for v in masked], 0.4, label="masked / clipped")
        ax.bar([i + 0.2 for i in x], [v if v is not None else 0 for v in kept], 0.4, label="kept")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_title(f"mean {label}", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=2, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    _save_small(fig, path)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default=os.path.join(REPO_ROOT, "benchmarks", "sanity", "results"))
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {list(METHODS)}")
    p.add_argument("--seeds", default="0,1,2", help="seeds of the headline methods " + str(HEADLINE))
    p.add_argument("--other-seeds", default="0", help="seeds of the non-headline methods")
    p.add_argument("--steps", type=int, default=160, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=32, help="completions per optimizer step")
    p.add_argument("--num-generations", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--steps-per-generation", type=int, default=4, help="optimizer steps per generation batch")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--ratio-cap", type=float, default=1e4, help="C for DPPO (authors: 1e4, effectively off)")
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--max-train-samples", type=int, default=32, help="fixed subset: the first N train problems")
    p.add_argument(
        "--mismatch",
        default="none",
        help="research only: perturb the engine's weights or computation (mismatch.py), e.g. noise=0.5 or kv=fp8",
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--workers", type=int, default=2, help="parallel worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--port-base", type=int, default=PORT_BASE, help="first MASTER_PORT (one per run, 50 at most)")
    p.add_argument("--keep-logs", action="store_true", help="keep the workers' logs (always kept on failure)")
    p.add_argument("--reaggregate", action="store_true", help="redo tables/plots from OUTPUT_DIR/results.json")
    p.add_argument("--quick", action="store_true", help="tiny smoke-test settings (2 methods, 1 seed, 2 steps)")
    p.add_argument("--worker-spec", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.methods = "dppo_tv,grpo_clip" if args.methods == ",".join(METHODS) else args.methods
        args.seeds, args.other_seeds = "0", "0"
        args.steps, args.batch_size, args.num_generations, args.steps_per_generation = 2, 8, 4, 1
        args.max_train_samples = 16
    return args


def plan_jobs(args: argparse.Namespace, tmp: str) -> list[dict]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {list(METHODS)}")
    jobs = []
    for method in methods:
        seeds = args.seeds if method in HEADLINE else args.other_seeds
        for seed in (int(s) for s in seeds.split(",") if s.strip()):
            jobs.append({"method": method, "seed": seed})
    for i, job in enumerate(jobs):
        job["port"] = args.port_base + i % 50
        job["out"] = os.path.join(tmp, f"{job['method']}-{job['seed']}.json")
    return jobs


def train_all(args: argparse.Namespace) -> tuple[list[dict], int]:
    """Run every (method, seed) job over `args.workers` processes; returns the per-run results and the worker count."""
    shared = {k: v for k, v in vars(args).items() if k not in ("worker_spec", "reaggregate", "keep_logs")}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = plan_jobs(args, tmp)
        # Alternating assignment spreads each method's seeds over the workers.
        n_workers = max(1, min(args.workers, len(jobs)))
        procs = []
        for w in range(n_workers):
            spec = os.path.join(tmp, f"worker{w}.json")
            with open(spec, "w") as f:
                json.dump({"args": shared, "threads": args.threads, "jobs": jobs[w::n_workers]}, f)
            log_path = os.path.join(args.output_dir, f"worker{w}.log")
            log = open(log_path, "w")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker-spec", spec]
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, log_path))
        for proc, log, log_path in procs:
            proc.wait()
            log.close()
            if proc.returncode == 0 and not args.keep_logs:
                os.remove(log_path)  # kept only when a worker failed, for the traceback
        results = []
        for job in jobs:
            if os.path.exists(job["out"]):  # a run that raised still writes its error here
                with open(job["out"]) as f:
                    results.append(json.load(f))
            else:
                results.append({"method": job["method"], "seed": job["seed"], "error": "worker produced no result"})
    return results, n_workers


def report(results: list[dict], output_dir: str, header: dict) -> dict:
    """Aggregate the runs, draw the PNGs, write `results.json` and `tables.md`; returns the JSON object."""
    methods = aggregate(results)
    names = [m for m in METHODS if m in methods]
    bin_size = header.get("settings", {}).get("steps_per_generation", 1)
    plots = {
        "curves_headline": plot_curves(
            methods,
            [n for n in names if n in HEADLINE] or names,
            os.path.join(output_dir, "curves_headline.png"),
            "headline methods: mean, band = min/max over seeds",
            bin_size,
        ),
        "curves_all": plot_curves(
            methods,
            names,
            os.path.join(output_dir, "curves_all.png"),
            "all methods (band = min/max where n > 1)",
            bin_size,
        ),
        "fig6": plot_fig6(methods, names, os.path.join(output_dir, "fig6_masked_tokens.png")),
    }
    for entry in methods.values():
        for run in entry["runs"]:
            for key, value in list(run.get("summary", {}).items()):
                if isinstance(value, float) and math.isnan(value):
                    run["summary"][key] = None
    out = {
        **header,
        "criteria": {"smooth_generations": SMOOTH, "reach_accuracy": REACH_ACCURACY, "collapse_drop": COLLAPSE_DROP},
        "methods": methods,
        "plots": {k: os.path.basename(v) for k, v in plots.items()},
    }
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        # One line per method keeps the committed file small but diffable.
        f.write("{\n")
        items = [(k, v) for k, v in out.items() if k != "methods"]
        for key, value in items:
            f.write(f"{json.dumps(key)}: {json.dumps(_rounded(value))},\n")
        f.write('"methods": {\n')
        entries = list(out["methods"].items())
        for i, (name, entry) in enumerate(entries):
            comma = "," if i < len(entries) - 1 else ""
            f.write(f"{json.dumps(name)}: {json.dumps(_rounded(entry), separators=(',', ':'))}{comma}\n")
        f.write("}\n}\n")
    tables = format_table(methods) + "\n\n" + format_fig6_table(methods)
    with open(os.path.join(output_dir, "tables.md"), "w") as f:
        f.write(tables + "\n")
    print(tables)
    return out


def _file_sha256(path: str) -> str | None:
    """Fingerprint of the weights the results came from (the committed model may be rebuilt later)."""
    import hashlib

    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _rounded(value):
    """Floats to 5 significant digits (curves are noisy far above that), recursively."""
    if isinstance(value, float):
        return float(f"{value:.5g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker_spec:
        worker(args.worker_spec)
        return {}
    os.makedirs(args.output_dir, exist_ok=True)
    if args.reaggregate:
        # Recompute summaries, tables and plots from a finished `results.json` (e.g. after changing a criterion).
        with open(os.path.join(args.output_dir, "results.json")) as f:
            previous = json.load(f)
        results = [r for entry in previous["methods"].values() for r in entry["runs"]]
        for run in results:
            run.pop("summary", None)
        header = {k: previous[k] for k in ("command", "settings", "machine", "wall_seconds") if k in previous}
        return report(results, args.output_dir, header)
    if not os.path.isdir(args.model):
        raise SystemExit(f"model folder {args.model} not found (build it with scripts/make_tiny_math_model.py)")
    start = time.time()
    results, n_workers = train_all(args)
    wall = time.time() - start
    header = {
        "command": " ".join(
            ["python", os.path.relpath(__file__, REPO_ROOT), *(sys.argv[1:] if argv is None else argv)]
        ),
        "settings": {
            **training_settings(args),
            "model": os.path.relpath(args.model, REPO_ROOT),
            "data": os.path.relpath(args.data, REPO_ROOT),
            "max_train_samples": args.max_train_samples,
            "headline_seeds": args.seeds,
            "other_seeds": args.other_seeds,
            "engine_dtype": "bfloat16",
            "mismatch": args.mismatch,
            "model_sha256": _file_sha256(os.path.join(args.model, "model.safetensors")),
        },
        "machine": {"cpus": os.cpu_count(), "workers": n_workers, "threads_per_worker": args.threads},
        "wall_seconds": round(wall, 1),
    }
    out = report(results, args.output_dir, header)
    print(f"[sanity] wall time {wall:.0f}s; results in {args.output_dir}")
    return out


def format_table(methods: dict) -> str:
    """Markdown table of the headline numbers."""
    rows = [
        "| method | seeds | final acc (mean [min, max]) | first-generation acc | steps to "
        f"{REACH_ACCURACY:.0%} | collapsed | peak mean abs(π−μ) | mean mask/clip rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in METHODS:
        entry = methods.get(name)
        if not entry:
            continue
        stats = entry.get("stats")
        if not stats:
            rows.append(f"| {name} | – | failed: {entry['runs'][0].get('error', '?')} | | | | | |")
            continue
        fa = stats["final_accuracy"]
        reach = ", ".join("–" if r is None else str(r) for r in stats["steps_to_reach"])
        rows.append(
            f"| {name} | {stats['n_seeds']} | {fa['mean']:.3f} [{fa['min']:.3f}, {fa['max']:.3f}] | "
            f"{stats['initial_accuracy']['mean']:.3f} | {reach} | {stats['collapsed_runs']}/{stats['n_seeds']} | "
            f"{stats['peak_mismatch_abs_mean']['max']:.4f} | {stats['mean_mask_ratio']['mean']:.4f} |"
        )
    return "\n".join(rows)


def format_fig6_table(methods: dict) -> str:
    """Markdown table of the paper's Fig. 6 view: what each method masks / clips."""

    def f(value: float | None) -> str:
        return "–" if value is None else f"{value:.3f}"

    rows = [
        "| method | masked/clipped tokens | μ(y) masked | μ(y) kept | entropy masked | entropy kept | "
        "most-masked tokens (share of masked) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in METHODS:
        fig6 = methods.get(name, {}).get("fig6")
        if not fig6:
            continue
        tokens = ", ".join(f"`{t['token']!r}` ({t['share_of_masked']:.0%})" for t in fig6["most_masked_tokens"][:5])
        rows.append(
            f"| {name} | {fig6['n_masked']} ({fig6['masked_frac']:.2%}) | {f(fig6['mu_prob_masked'])} | "
            f"{f(fig6['mu_prob_kept'])} | {f(fig6['entropy_masked'])} | {f(fig6['entropy_kept'])} | {tokens or '–'} |"
        )
    return "\n".join(rows)


def stdout_summary(out: dict, output_dir: str) -> dict:
    """The one JSON object printed on stdout: where the results are, each method's statistics and failed runs."""
    return {
        "benchmark": "sanity",
        "output_dir": output_dir,
        "files": {"results": "results.json", "tables": "tables.md", **out.get("plots", {})},
        "wall_seconds": out.get("wall_seconds"),
        "methods": {name: _rounded(entry["stats"]) for name, entry in out.get("methods", {}).items()},
        "failed_runs": [
            {"method": r.get("method"), "seed": r.get("seed"), "error": r["error"]}
            for entry in out.get("methods", {}).values()
            for r in entry["runs"]
            if "error" in r
        ],
    }


if __name__ == "__main__":
    from dppo_dev.bench_env import emit_json, stdout_to_stderr

    # Tables and progress go to stderr (the tables also to `tables.md`); stdout is one JSON object.
    with stdout_to_stderr():
        result = main()
    if result:
        summary = stdout_summary(result, parse_args().output_dir)
        emit_json(summary)
        sys.exit(1 if summary["failed_runs"] else 0)
