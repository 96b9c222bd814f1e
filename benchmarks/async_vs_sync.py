"""Asynchronous vs synchronous DPPO on the same model, data, reward and vLLM server: throughput, staleness, mask rate.

Both variants train the bundled tiny math model on the bundled tiny math set for the same number of optimizer steps
with the same samples per step, against one `python -m dppo_trl.backends.cpu.vllm_server` process (started here):

- `sync`: `DPPOTrainer`, `vllm_mode="server"`, one generation batch per optimizer step (generation waits for the
  weights, training waits for generation);
- `async`: `AsyncDPPOTrainer`, TRL's rollout worker sampling while the trainer trains, samples up to `max_staleness`
  versions old.

stdout is exactly one JSON object (notices go to stderr); the exit status is non-zero if a variant fails.

```bash
python benchmarks/async_vs_sync.py               # 16 steps each, ~5-10 minutes on 2 shared cores
python benchmarks/async_vs_sync.py --steps 4     # smoke
```
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from dapo_math.data import load_dapo_math
from dapo_math.rewards import accuracy_reward, format_reward
from dapo_math.server import load_tokenizer, start_cpu_server, stop_server
from dppo_dev.bench_env import emit_json, launcher, load_average, stdout_to_stderr, thread_settings, versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL_DIR = os.path.join(ROOT, "examples", "tiny_math_model")
TINY_TRAIN_FILE = os.path.join(ROOT, "examples", "data", "tiny_math", "train.jsonl")


def _common(args, output_dir: str) -> dict:
    return dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        learning_rate=args.learning_rate,
        max_steps=args.steps,
        per_device_train_batch_size=args.samples_per_step,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        logging_steps=1,
        seed=0,
    )


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _summary(history: list[dict], steps: int, samples_per_step: int, train_s: float) -> dict:
    logs = [h for h in history if "dppo/mask_ratio" in h]
    return {
        "steps": len(logs),
        "train_s": round(train_s, 2),
        "samples_per_s": round(steps * samples_per_step / train_s, 3),
        "staleness_mean": _mean([h.get("sample/staleness_mean", 0.0) for h in logs]),
        "staleness_max": max((h.get("sample/staleness_max", 0.0) for h in logs), default=None),
        "mask_ratio_mean": _mean([h["dppo/mask_ratio"] for h in logs]),
        "mismatch_abs_mean": _mean([h.get("dppo/mismatch_abs_mean") for h in logs]),
        "reward_first": logs[0].get("reward") if logs else None,
        "reward_last": logs[-1].get("reward") if logs else None,
        "mask_ratio_by_staleness": {
            key.split("/")[1]: _mean([h.get(key) for h in logs])
            for key in sorted({k for h in logs for k in h if k.startswith("dppo/staleness_") and "mask" in k})
        },
    }


def run_sync(args, url: str, dataset, output_dir: str) -> dict:
    from dppo_trl import DPPOConfig, DPPOTrainer

    host, port = url.removeprefix("http://").split(":")
    config = DPPOConfig(
        **_common(args, output_dir),
        use_vllm=True,
        vllm_mode="server",
        vllm_server_host=host,
        vllm_server_port=int(port),
        steps_per_generation=1,
        delta_low=args.delta,
        delta_high=args.delta,
    )
    return _train(DPPOTrainer, config, args, dataset)


def _train(trainer_class, config, args, dataset) -> dict:
    """Train the tiny model with `trainer_class` under `config` and summarise the run (the same for both variants)."""
    trainer = trainer_class(
        model=TINY_MODEL_DIR,
        reward_funcs=[accuracy_reward, format_reward],
        args=config,
        train_dataset=dataset,
        processing_class=load_tokenizer(TINY_MODEL_DIR),
    )
    start = time.perf_counter()
    trainer.train()
    return _summary(trainer.state.log_history, args.steps, args.samples_per_step, time.perf_counter() - start)


def run_async(args, url: str, dataset, output_dir: str) -> dict:
    from dppo_trl import AsyncDPPOConfig, AsyncDPPOTrainer

    config = AsyncDPPOConfig(
        **_common(args, output_dir),
        vllm_server_base_url=url,
        max_staleness=args.max_staleness,
        token_budget=0,
        delta_low=args.delta,
        delta_high=args.delta,
    )
    return _train(AsyncDPPOTrainer, config, args, dataset)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--samples_per_step", type=int, default=32)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--max_staleness", type=int, default=4)
    parser.add_argument("--delta", type=float, default=0.15, help="δ_low = δ_high (binary TV)")
    parser.add_argument("--variants", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    args = parser.parse_args()
    # A SIGTERM (a timeout) unwinds through the `finally` blocks, so the server and its engine are stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    report = {
        "benchmark": "async_vs_sync",
        "model": "examples/tiny_math_model",
        "settings": {k: v for k, v in vars(args).items()},
        "load_average_start": load_average(),
        "versions": versions(),
        "variants": {},
    }
    failed = False
    with tempfile.TemporaryDirectory(prefix="dppo-async-bench-") as tmp, stdout_to_stderr():
        dataset = load_dapo_math(TINY_TRAIN_FILE)
        dataset = dataset.remove_columns([c for c in dataset.column_names if c not in ("prompt", "ground_truth")])
        server, url = start_cpu_server(TINY_MODEL_DIR, os.path.join(tmp, "server.log"))
        try:
            for name in args.variants:
                runner = run_sync if name == "sync" else run_async
                try:
                    report["variants"][name] = runner(args, url, dataset, os.path.join(tmp, name))
                except Exception as error:  # a failed variant is reported, and fails the run
                    traceback.print_exc()
                    report["variants"][name] = {"error": f"{type(error).__name__}: {error}"}
                    failed = True
        finally:
            stop_server(server)
    report["load_average_end"] = load_average()
    report["launcher"], report["threads"] = launcher(), thread_settings()
    emit_json(report, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
