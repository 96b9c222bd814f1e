# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""Controlled-mismatch study: the sanity benchmark's trust regions against a growing train–inference mismatch.

The paper's central claim (Qi et al., arXiv 2602.04879, §5) is that ratio clipping mis-handles low-probability tokens
once engine and trainer disagree, and that DPPO's divergence trust region does not. At CPU scale the bf16 mismatch is
only ~1e-3 per token (docs/results.md), so this sweep *makes* the engine disagree: the weights synced into vLLM are
fake-quantized or perturbed by `mismatch.py` (research only, never a training option), while the trainer stays fp32
and μ is still captured from the engine as in every other run. Each level is run for every method and seed with
`run.py`'s own worker and criteria; the x-axis is the *fresh* mismatch each level produces (mean |π − μ| at the first
step after a generation, where π is still the generating weights), measured per run.

```bash
python benchmarks/sanity/sweep.py                                    # the committed sweep (docs/results.md)
python benchmarks/sanity/sweep.py --resume                           # finish an interrupted sweep
python benchmarks/sanity/sweep.py --quick --output-dir /tmp/sweep    # smoke test (tests/)
```

Writes `sweep.json` (settings, versions, model sha, command, every run's summary and compact curves), `sweep.csv`,
`sweep.md` and `sweep.png` (final accuracy and collapse rate against fresh mismatch, per method, seed bands) to
`--output-dir`. Each finished run's compact summary (the `runs` row of `sweep.json`, under 1 kB) is appended to
`OUTPUT_DIR/runs.jsonl` as soon as it finishes; that file is meant to be committed. `--resume` skips every run found
there or under `OUTPUT_DIR/runs/` (the full per-run files, not committed) and reruns failed ones, so a fresh clone
continues a sweep exactly where a committed `runs.jsonl` stopped. Seeds may be given as ranges (`--seeds 20-39`).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import run  # this folder's `run.py` (a script's folder is on its import path); sets up the offline environment
from mismatch import parse_level

from dppo_dev.bench_env import load_average, machine_info, versions

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = run.REPO_ROOT

DEFAULT_OUTPUT = os.path.join(HERE, "results", "mismatch_sweep")
# Calibrated on examples/tiny_math_model (docs/results.md): the bf16 engine alone gives a fresh mean |π − μ| of
# ~1e-3 (int8 and e4m3 on top barely add to it), relative noise 0.3 / 0.5 / 0.6 about 1e-2 / 3e-2 / 1e-1. The noise
# response is steep above 0.5: the engine's model breaks down around 0.7.
DEFAULT_LEVELS = "none,noise=0.3,noise=0.5,noise=0.6"
DEFAULT_METHODS = "dppo_tv,dppo_kl,grpo_clip,clip_higher,cispo,pg_is,dppo_recompute"
ANCHORED_ON_PI_OLD = {"dppo_recompute"}  # its logged |π − μ| is against the recomputed π_old, not the engine
PORT_BASE = 29950  # the sweep's block: 29950-29989 (run.py uses 29800-29899)
RECORD = "runs.jsonl"  # committed: one compact line per finished run (see the module docstring)
QUICK = {
    "levels": "none,noise=0.5",
    "methods": "dppo_tv,pg_is",
    "seeds": "0",
    "run_args": ["--quick"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default=DEFAULT_OUTPUT)
    p.add_argument("--levels", default=DEFAULT_LEVELS, help="comma-separated --mismatch specs (see mismatch.py)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated run.py methods")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds or ranges: 0,1,2 or 20-39")
    p.add_argument("--steps", type=int, default=64, help="optimizer steps per run (run.py's main run: 160)")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--mismatch-seed", type=int, default=0, help="seed of the noise pattern (one engine per level)")
    p.add_argument("--model", default=None, help="model folder (default: run.py's, examples/tiny_math_model)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--port-base", type=int, default=PORT_BASE)
    p.add_argument("--resume", action="store_true", help="keep finished runs in OUTPUT_DIR/runs, run the rest")
    p.add_argument("--reaggregate", action="store_true", help="redo the JSON/tables/plot from OUTPUT_DIR/runs")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: 2 levels x 2 methods x 1 seed (unless given), 2 steps"
    )
    args = p.parse_args(argv)
    args.run_args = ["--steps", str(args.steps), "--learning-rate", str(args.learning_rate)]
    model_args = ["--model", os.path.abspath(args.model)] if args.model else []
    args.run_args += model_args
    if args.quick:
        # The smoke test's levels, methods and seeds, unless given (the resume test picks its own).
        for key in ("levels", "methods", "seeds"):
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, QUICK[key])
        args.run_args = QUICK["run_args"] + model_args
    args.level_list = [lvl.strip() for lvl in args.levels.split(",") if lvl.strip()]
    for level in args.level_list:
        parse_level(level)  # a clear error before any worker starts
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.method_list if m not in run.METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {list(run.METHODS)}")
    args.seed_list = parse_seeds(args.seeds)
    return args


def parse_seeds(spec: str) -> list[int]:
    """`0,1,5-7` -> [0, 1, 5, 6, 7] (ranges inclusive, order kept, repeats dropped)."""
    seeds: list[int] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        for seed in range(int(lo), int(hi or lo) + 1):
            if seed not in seeds:
                seeds.append(seed)
    return seeds


def run_settings(args: argparse.Namespace) -> argparse.Namespace:
    """run.py's settings for every job of the sweep (its defaults, plus steps and lr, or its --quick)."""
    return run.parse_args(args.run_args)


def settings_id(args: argparse.Namespace) -> str:
    """Fingerprint of everything a run's result depends on besides (level, method, seed): the record refuses to mix."""
    settings = run_settings(args)
    key = {
        **run.training_settings(settings),
        "mismatch_seed": args.mismatch_seed,
        "data": os.path.relpath(settings.data, REPO_ROOT),
        "max_train_samples": settings.max_train_samples,
        "model_sha256": run._file_sha256(os.path.join(settings.model, "model.safetensors")),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _key(row: dict) -> tuple[str, str, int]:
    return row["level"], row["method"], int(row["seed"])


def read_record(path: str, sid: str) -> dict:
    """(level, method, seed) -> row of the committed record; a later line for the same run wins (a retried failure)."""
    record = {}
    if not os.path.exists(path):
        return record
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            entry = json.loads(line)
            if entry.pop("settings_id") != sid:
                raise SystemExit(
                    f"[sweep] {path}:{n} was written with other settings (steps, lr, model, data or mismatch seed) "
                    "than this command's; continue it with its own settings or choose another --output-dir."
                )
            record[_key(entry)] = entry
    return record


def job_row(job: dict) -> dict | None:
    """A finished job's row, from its full per-run file (None while a worker is still writing it)."""
    try:
        with open(job["out"]) as f:
            result = json.load(f)
    except json.JSONDecodeError:  # a worker of an older run.py writing in place; it is read again later
        return None
    if "error" in result:
        return {"level": job["level"], "method": job["method"], "seed": job["seed"], "error": result["error"]}
    return run_row(result, job["level"])


def sync_record(jobs: list[dict], path: str, sid: str, record: dict) -> None:
    """Append every job whose per-run file exists and whose row the record lacks (or holds only as a failure)."""
    with open(path, "a") as f:
        for job in jobs:
            key = (job["level"], job["method"], job["seed"])
            if not os.path.exists(job["out"]) or (key in record and "error" not in record[key]):
                continue
            row = job_row(job)
            if row is None:
                continue
            # The machine goes with the row: runs are deterministic on one machine, not across machines.
            row = run._rounded({**row, "platform": platform.platform()})
            if key in record and record[key] == row:
                continue
            record[key] = row
            f.write(json.dumps({"settings_id": sid, **record[key]}, separators=(",", ":")) + "\n")
            f.flush()


def _run_file(runs_dir: str, level: str, method: str, seed: int) -> str:
    return os.path.join(runs_dir, f"{level.replace('=', '')}__{method}__{seed}.json")


def plan_jobs(args: argparse.Namespace, runs_dir: str) -> list[dict]:
    """Seed-major order: if the sweep is cut short, the finished part has whole seeds of every level and method."""
    jobs = []
    for seed in args.seed_list:
        for level in args.level_list:
            for method in args.method_list:
                jobs.append(
                    {
                        "method": method,
                        "seed": seed,
                        "level": level,
                        "args": {"mismatch": level, "mismatch_seed": args.mismatch_seed},
                        "out": _run_file(runs_dir, level, method, seed),
                    }
                )
    for i, job in enumerate(jobs):
        job["port"] = args.port_base + i % 40
    return jobs


def train(args: argparse.Namespace, jobs: list[dict], log_dir: str, on_progress=None) -> None:
    """Run `jobs` on `args.workers` run.py worker processes; prints progress (and calls `on_progress`) as runs finish."""
    settings = {k: v for k, v in vars(run_settings(args)).items() if k not in ("worker_spec", "reaggregate")}
    if not jobs:
        return
    n_workers = max(1, min(args.workers, len(jobs)))
    os.makedirs(log_dir, exist_ok=True)
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for w in range(n_workers):
            spec = os.path.join(tmp, f"worker{w}.json")
            with open(spec, "w") as f:
                json.dump({"args": settings, "threads": args.threads, "jobs": jobs[w::n_workers]}, f)
            log = open(os.path.join(log_dir, f"worker{w}.log"), "a")
            cmd = [sys.executable, os.path.join(HERE, "run.py"), "--worker-spec", spec]
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        reported = 0
        while any(proc.poll() is None for proc, _ in procs):
            time.sleep(5 if args.quick else 30)
            done = sum(os.path.exists(job["out"]) for job in jobs)
            if done != reported:
                reported = done
                if on_progress is not None:
                    on_progress()
                elapsed = time.time() - start
                eta = elapsed / done * (len(jobs) - done)
                print(
                    f"[sweep] {done}/{len(jobs)} runs done, {elapsed / 60:.1f} min elapsed, ~{eta / 60:.0f} min left, "
                    f"load {load_average()}",
                    flush=True,
                )
        for _, log in procs:
            log.close()


# ---------------------------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------------------------
def _fresh_steps(result: dict) -> set[int]:
    return {int(step) for step, _ in result["fig6"]["fresh_mismatch"]}


def run_row(result: dict, level: str) -> dict:
    """One run's line of the sweep: run.py's summary plus the fresh mismatch this level produced."""
    summary = run.run_summary(result)
    fresh = [v for _, v in result["fig6"]["fresh_mismatch"]]
    fresh_steps = _fresh_steps(result)
    fresh_max = [v for s, v in result["curves"]["mismatch_abs_max"] if int(s) in fresh_steps]
    clip = [v for _, v in result["curves"]["mask_ratio"]]
    return {
        "level": level,
        "method": result["method"],
        "seed": result["seed"],
        "final_accuracy": summary["final_accuracy"],
        "peak_accuracy": summary["peak_accuracy"],
        "initial_accuracy": summary["initial_accuracy"],
        "collapsed": summary["collapsed"],
        # First generation: the pure engine-vs-trainer gap of this level on the starting weights.
        "fresh_mismatch_first": fresh[0] if fresh else None,
        "fresh_mismatch_median": statistics.median(fresh) if fresh else None,
        "fresh_mismatch_max_token": max(fresh_max) if fresh_max else None,
        "peak_mismatch_abs_mean": summary["peak_mismatch_abs_mean"],
        "mean_mask_ratio": sum(clip) / len(clip) if clip else None,
        # Fig. 6: sampled tokens the trust region masked / kept, by μ bin (run.MU_BINS), over the whole run.
        "mu_hist_masked": result["fig6"]["mu_hist_masked"],
        "mu_hist_kept": result["fig6"]["mu_hist_kept"],
        "final_entropy": summary["final_entropy"],
        "train_seconds": result.get("train_seconds"),
        "curves": {
            "accuracy": result["curves"]["accuracy"],
            "fresh_mismatch": result["fig6"]["fresh_mismatch"],
        },
    }


def _stats(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def aggregate(
    args: argparse.Namespace, jobs: list[dict], record: dict | None = None
) -> tuple[list[dict], dict, dict, list[dict]]:
    """Rows per run, cells per (level, method), each level's calibrated fresh mismatch, and the missing jobs.

    A job's row comes from its per-run file, else from the committed `record`.
    """
    rows, missing = [], []
    record = record or {}
    for job in jobs:
        key = (job["level"], job["method"], job["seed"])
        row = job_row(job) if os.path.exists(job["out"]) else None
        if row is not None:
            rows.append(row)
        elif key in record:
            rows.append(record[key])
        else:
            missing.append({k: job[k] for k in ("level", "method", "seed")})
    levels = {}
    for level in args.level_list:
        # The engine-vs-trainer gap of a level: μ-anchored runs only (π_old-anchored ones log drift, not the engine).
        first = [
            r["fresh_mismatch_first"]
            for r in rows
            if r["level"] == level and "error" not in r and r["method"] not in ANCHORED_ON_PI_OLD
        ]
        median = [
            r["fresh_mismatch_median"]
            for r in rows
            if r["level"] == level and "error" not in r and r["method"] not in ANCHORED_ON_PI_OLD
        ]
        levels[level] = {"fresh_mismatch_first": _stats(first), "fresh_mismatch_median": _stats(median)}
    cells = {}
    for level in args.level_list:
        for method in args.method_list:
            runs = [r for r in rows if r["level"] == level and r["method"] == method]
            ok = [r for r in runs if "error" not in r]
            if not runs:
                continue
            cells[f"{level}|{method}"] = {
                "level": level,
                "method": method,
                "n_runs": len(ok),
                "n_failed": len(runs) - len(ok),
                "seeds": [r["seed"] for r in ok],
                "final_accuracy": _stats([r["final_accuracy"] for r in ok]),
                "initial_accuracy": _stats([r["initial_accuracy"] for r in ok]),
                "collapsed": sum(r["collapsed"] for r in ok),
                "collapse_rate": sum(r["collapsed"] for r in ok) / len(ok) if ok else None,
                "fresh_mismatch_median": _stats([r["fresh_mismatch_median"] for r in ok]),
                "mean_mask_ratio": _stats([r["mean_mask_ratio"] for r in ok]),
            }
    return rows, cells, levels, missing


def format_table(args: argparse.Namespace, cells: dict, levels: dict) -> str:
    def f(stats: dict | None, fmt: str = ".3f") -> str:
        return "–" if stats is None else f"{stats['mean']:{fmt}} [{stats['min']:{fmt}}, {stats['max']:{fmt}}]"

    lines = [
        "| level | fresh mean abs(π−μ), first generation | method | runs | final acc (mean [min, max]) | collapsed | "
        "first-generation acc | mean mask/clip rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for level in args.level_list:
        calib = levels[level]["fresh_mismatch_first"]
        for method in args.method_list:
            cell = cells.get(f"{level}|{method}")
            if not cell:
                continue
            x = "–" if calib is None else f"{calib['mean']:.2e}"
            failed = f" (+{cell['n_failed']} failed)" if cell["n_failed"] else ""
            lines.append(
                f"| {level} | {x} | {method} | {cell['n_runs']}{failed} | {f(cell['final_accuracy'])} | "
                f"{cell['collapsed']}/{cell['n_runs']} | {f(cell['initial_accuracy'])} | "
                f"{f(cell['mean_mask_ratio'], '.4f')} |"
            )
    return "\n".join(lines)


def write_csv(rows: list[dict], path: str) -> None:
    keys = [k for k in (rows[0] if rows else {}) if k != "curves"] or ["level", "method", "seed", "error"]
    keys += [k for k in ("error",) if k not in keys]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(row)


def plot(args: argparse.Namespace, rows: list[dict], levels: dict, path: str) -> str:
    """Final accuracy (mean, min–max band over seeds) and collapse rate against each level's fresh mismatch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_of = {
        lvl: v["fresh_mismatch_first"]["mean"] for lvl, v in levels.items() if v["fresh_mismatch_first"] is not None
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    cmap = plt.get_cmap("tab10")
    for i, method in enumerate(args.method_list):
        xs, mean, lo, hi, rate = [], [], [], [], []
        for level in args.level_list:
            finals = [
                r["final_accuracy"] for r in rows if r["level"] == level and r["method"] == method and "error" not in r
            ]
            if level not in x_of or not finals:
                continue
            collapsed = [
                r["collapsed"] for r in rows if r["level"] == level and r["method"] == method and "error" not in r
            ]
            xs.append(x_of[level])
            mean.append(sum(finals) / len(finals))
            lo.append(min(finals))
            hi.append(max(finals))
            rate.append(sum(collapsed) / len(collapsed))
        if not xs:
            continue
        style = {
            "color": cmap(i),
            "marker": "o",
            "ms": 3.5,
            "lw": 1.4,
            "ls": "--" if method in ANCHORED_ON_PI_OLD else "-",
        }
        axes[0].plot(xs, mean, label=method, **style)
        axes[0].fill_between(xs, lo, hi, color=cmap(i), alpha=0.12, lw=0)
        # Small horizontal offsets keep overlapping collapse rates readable.
        axes[1].plot([x * (1 + 0.04 * (i - 3)) for x in xs], rate, label=method, **style)
    for ax, title in zip(
        axes,
        (
            "final training accuracy (mean; band = min/max over seeds)",
            "collapse rate (fraction of seeds)",
        ),
    ):
        ax.set_xscale("log")
        ax.set_xlabel(
            "fresh mismatch: mean |π − μ| per token at the first generation (engine vs fp32 trainer)", fontsize=8
        )
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    for level, x in x_of.items():
        axes[0].annotate(
            level, (x, 0), xytext=(0, 2), textcoords="offset points", fontsize=7, rotation=90, va="bottom"
        )
    axes[1].set_ylim(-0.05, 1.05)
    axes[0].legend(fontsize=7)
    counts = [
        sum(1 for r in rows if r["level"] == lvl and r["method"] == m and "error" not in r)
        for lvl in args.level_list
        for m in args.method_list
    ]
    lo, hi = min(counts, default=0), max(counts, default=0)
    fig.suptitle(
        f"controlled train–inference mismatch sweep ({lo if lo == hi else f'{lo}–{hi}'} seeds per point)", fontsize=10
    )
    fig.tight_layout()
    run._save_small(fig, path)
    return path


def report(args: argparse.Namespace, jobs: list[dict], header: dict, record: dict | None = None) -> dict:
    rows, cells, levels, missing = aggregate(args, jobs, record)
    out_dir = args.output_dir
    png = plot(args, rows, levels, os.path.join(out_dir, "sweep.png"))
    table = format_table(args, cells, levels)
    failed = [r for r in rows if "error" in r]
    status = "complete" if not missing and not failed else f"partial: {len(missing)} missing, {len(failed)} failed"
    out = {
        **header,
        "status": status,
        "n_runs_planned": len(jobs),
        "n_runs_finished": len(rows) - len(failed),
        "missing": missing,
        "criteria": {
            "smooth_generations": run.SMOOTH,
            "collapse_drop": run.COLLAPSE_DROP,
            "collapsed": "smoothed final accuracy < max(peak - collapse_drop, 0.5 x first-generation accuracy)",
            "fresh_mismatch": "mean |π − μ| of the sampled tokens at the first optimizer step after each generation",
        },
        "levels": levels,
        "cells": cells,
        "plot": os.path.basename(png),
        "runs": rows,
    }
    with open(os.path.join(out_dir, "sweep.json"), "w") as f:
        # One line per run keeps the committed file diffable.
        f.write("{\n")
        for key, value in out.items():
            if key == "runs":
                continue
            f.write(f"{json.dumps(key)}: {json.dumps(run._rounded(value))},\n")
        f.write('"runs": [\n')
        for i, row in enumerate(rows):
            comma = "," if i < len(rows) - 1 else ""
            f.write(json.dumps(run._rounded(row), separators=(",", ":")) + comma + "\n")
        f.write("]\n}\n")
    write_csv(rows, os.path.join(out_dir, "sweep.csv"))
    with open(os.path.join(out_dir, "sweep.md"), "w") as f:
        f.write(f"Status: {status}.\n\n{table}\n")
    print(table)
    print(f"[sweep] {status}; results in {out_dir}")
    return out


def make_header(args: argparse.Namespace, command: str, previous: dict, load_before, wall: float | None) -> dict:
    """Command, settings, versions and machine of the sweep (what `sweep.json` needs to be reproduced)."""
    settings = run_settings(args)
    earlier = previous.get("wall_seconds", 0)
    return {
        "command": previous.get("command", command),
        "resumed_with": [*previous.get("resumed_with", []), command] if previous else [],
        "settings": {
            **run.training_settings(settings),
            "levels": args.level_list,
            "methods": args.method_list,
            "seeds": args.seed_list,
            "mismatch_seed": args.mismatch_seed,
            "engine_dtype": "bfloat16",
            "model": os.path.relpath(settings.model, REPO_ROOT),
            "data": os.path.relpath(settings.data, REPO_ROOT),
            "max_train_samples": settings.max_train_samples,
            "model_sha256": run._file_sha256(os.path.join(settings.model, "model.safetensors")),
        },
        "versions": versions(),
        "machine": machine_info(load_before, workers=args.workers, threads_per_worker=args.threads),
        # A header rebuilt by --reaggregate has no wall time: the total stays unknown after a resume.
        "wall_seconds": None if wall is None or earlier is None else round(earlier + wall, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    runs_dir = os.path.join(args.output_dir, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    jobs = plan_jobs(args, runs_dir)
    # The header (command, resumptions, wall time) sits next to the record so that it is committed with it.
    header_path = os.path.join(args.output_dir, "header.json")
    old_header_path = os.path.join(runs_dir, "header.json")  # where sweeps before the record kept it
    record_path, sid = os.path.join(args.output_dir, RECORD), settings_id(args)
    record = read_record(record_path, sid)
    argv = sys.argv[1:] if argv is None else argv
    command = " ".join(["python", os.path.relpath(__file__, REPO_ROOT), *argv])
    if args.reaggregate:
        sync_record(jobs, record_path, sid, record)
        for path in (header_path, old_header_path):
            if os.path.exists(path):
                with open(path) as f:
                    return report(args, jobs, json.load(f), record)
        # The sweep was stopped (or is still running): its header was never written, so rebuild it (no wall time)
        # and keep it next to the record, so that the settings and versions are committed with the runs.
        sweep_command = " ".join(
            ["python", os.path.relpath(__file__, REPO_ROOT), *(a for a in argv if a != "--reaggregate")]
        )
        header = make_header(args, sweep_command, {}, None, None)
        with open(header_path, "w") as f:
            json.dump(header, f, indent=1)
        return report(args, jobs, header, record)
    if not args.resume:
        if any((job["level"], job["method"], job["seed"]) in record for job in jobs):
            raise SystemExit(
                f"[sweep] {record_path} already holds runs of this sweep: pass --resume to continue it, or choose "
                "another --output-dir."
            )
        for job in jobs:
            if os.path.exists(job["out"]):
                os.remove(job["out"])
    sync_record(jobs, record_path, sid, record)

    def finished(job: dict) -> bool:
        row = record.get((job["level"], job["method"], job["seed"]))
        return row is not None and "error" not in row

    for job in jobs:  # --resume reruns failed runs
        if not finished(job) and os.path.exists(job["out"]):
            os.remove(job["out"])
    todo = [job for job in jobs if not finished(job)]
    previous = {}
    for path in (header_path, old_header_path):
        if args.resume and not previous and os.path.exists(path):
            with open(path) as f:
                previous = json.load(f)
    load_before = load_average()
    start = time.time()
    print(f"[sweep] {len(todo)} of {len(jobs)} runs to do on {args.workers} workers", flush=True)
    train(args, todo, os.path.join(args.output_dir, "logs"), lambda: sync_record(todo, record_path, sid, record))
    sync_record(jobs, record_path, sid, record)
    header = make_header(args, command, previous, load_before, time.time() - start)
    with open(header_path, "w") as f:
        json.dump(header, f)
    return report(args, jobs, header, record)


if __name__ == "__main__":
    # Tables and progress go to stderr (the table also to `sweep.md`); stdout is one JSON object.
    from dppo_dev.bench_env import emit_json, stdout_to_stderr

    with stdout_to_stderr():
        result = main()
    emit_json(
        {
            "benchmark": "mismatch_sweep",
            "output_dir": parse_args().output_dir,
            "files": {"results": "sweep.json", "table": "sweep.md", "csv": "sweep.csv", "plot": result.get("plot")},
            **{k: v for k, v in result.items() if k in ("status", "n_runs_planned", "n_runs_finished", "missing")},
            "failed_runs": [
                {"level": r.get("level"), "method": r.get("method"), "seed": r.get("seed"), "error": r["error"]}
                for r in result.get("runs", [])
                if "error" in r
            ],
            "cells": run._rounded(result.get("cells")),
        }
    )
    sys.exit(0 if result.get("status") == "complete" else 1)
