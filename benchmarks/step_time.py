"""
Wall-clock time per optimizer step: `DPPOTrainer` vs `GRPOTrainer` with a real colocated vLLM engine.

Both trainers train the same tiny Qwen3 (built by `dppo_dev.tiny_models.save_tiny_model` in a temporary folder) on the
same prompts, with the same seed, batch, group size, completion length and number of steps. GRPOTrainer runs with
`GRPOConfig` defaults, which include TRL's vLLM importance-sampling correction: every generation batch it recomputes
π_old with an extra no-grad forward pass. DPPOTrainer anchors on the engine's own log-probs μ and skips that pass.

Each trainer runs in its own subprocess (clean process state: one vLLM engine, one gloo group, a fresh MASTER_PORT
from 29760–29799). With `--rounds N` the runs are repeated in alternating order (GRPO, DPPO, DPPO, GRPO, …) and the
step times are pooled, so slow drift of a shared machine's load does not favour either trainer. A `TrainerCallback`
times each step from `on_step_begin` to `on_step_end` (generation, scoring, forward/backward and optimizer step); the
first `--warmup` steps of each run are reported separately and left out of the statistics.

The JSON also counts the policy's no-grad forward passes per generation batch (the π_old recompute inside
`_generate_and_score_completions`) for each trainer, and records the launcher and thread settings it ran with. With
`--steps-per-generation N --gradient-accumulation-steps M` the step times of a generation cycle (N / M optimizer
steps, one of which generates) are pooled: compare the means there, not the medians.

Prints one JSON object to stdout (library notices, and the workers' logs with `--verbose`, go to stderr):

    .venv/bin/python benchmarks/step_time.py [--steps 5 --warmup 1 --model-size small --divergence binary_tv]
"""

import os
import sys

# The repository root holds `dppo_dev` (scaffolding, not installed).
from dppo_dev.offline import set_offline_env

set_offline_env()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

TRAINERS = ("grpo", "dppo")
# Tiny Qwen3 shapes (vocab = the byte tokenizer's 259 ids). head_dim must be a size vLLM's CPU attention supports.
from dppo_dev.bench_env import (  # noqa: E402
    PROMPTS,
    emit_json,
    launcher,
    load_average,
    machine_info,
    stdout_to_stderr,
    thread_settings,
    versions,
)
from dppo_dev.tiny_models import QWEN3_SIZE_PRESETS  # noqa: E402

MODEL_PRESETS = QWEN3_SIZE_PRESETS
PORTS = range(29760, 29800)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the statistics")
    parser.add_argument("--rounds", type=int, default=1, help="runs per trainer, in alternating order; times pooled")
    parser.add_argument("--divergence", default="binary_tv", choices=["binary_tv", "binary_kl", "topk_tv", "topk_kl"])
    parser.add_argument("--model-size", default="small", choices=list(MODEL_PRESETS))
    parser.add_argument("--completion-length", type=int, default=32, help="max_completion_length")
    parser.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size (completions/step)")
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt")
    parser.add_argument(
        "--steps-per-generation", type=int, default=None, help="steps_per_generation (default: TRL's, = GA)"
    )
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--num-iterations", type=int, default=1, help="num_iterations (TRL's μ in GRPO)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainers", default=",".join(TRAINERS), help="comma-separated subset of grpo,dppo")
    parser.add_argument("--output", type=Path, help="also write the JSON to this file")
    parser.add_argument("--verbose", action="store_true", help="forward the workers' logs to stderr")
    # Internal: run one trainer in this process and write its timings to --result-file.
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    if args.batch_size % args.num_generations:
        parser.error("--batch-size must be a multiple of --num-generations")
    if min(args.gradient_accumulation_steps, args.num_iterations, args.steps_per_generation or 1) < 1:
        parser.error("--steps-per-generation, --gradient-accumulation-steps and --num-iterations must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# Worker: one trainer, one engine, in its own process
# ---------------------------------------------------------------------------------------------------------------------


def ascii_reward(completions, **kwargs) -> list[float]:
    """Fraction of ASCII characters: varied rewards on a random byte-level model, so advantages are non-zero."""
    return [sum(ord(ch) < 128 for ch in text) / max(len(text), 1) for text in completions]


def _timed(fn, sink: list[float]):
    """`fn`, appending the wall-clock time of each call to `sink`."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

    return wrapper


def run_worker(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dppo_dev.tiny_models import build_byte_tokenizer
    from dppo_trl import DPPOConfig, DPPOTrainer
    from dppo_trl.backends.cpu.construction import trainer_construction_patches
    from dppo_trl.backends.cpu.engine import EngineOptions
    from dppo_trl.backends.cpu.weight_sync import bind_colocate_weight_sync

    class StepTimer(TrainerCallback):
        """Wall-clock time of each optimizer step, generation included (TRL generates inside `training_step`)."""

        def __init__(self):
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self._start = self._cpu_start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start, self._cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)
            self.cpu_times.append(time.process_time() - self._cpu_start)

    common = dict(
        output_dir=str(Path(args.result_file).parent / f"out-{args.worker}"),
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.completion_length,
        max_steps=args.warmup + args.steps,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        steps_per_generation=args.steps_per_generation,
        num_iterations=args.num_iterations,
        learning_rate=1e-5,
        seed=args.seed,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=args.completion_length + 64,
    )
    if args.worker == "dppo":
        config, trainer_cls = DPPOConfig(divergence=args.divergence, **common), DPPOTrainer
    else:
        config, trainer_cls = GRPOConfig(**common), GRPOTrainer

    micro_steps = (args.warmup + args.steps) * args.gradient_accumulation_steps
    repeats = -(-micro_steps * args.batch_size // args.num_generations // len(PROMPTS)) + 1
    dataset = Dataset.from_dict({"prompt": PROMPTS * repeats})
    timer = StepTimer()
    start = time.perf_counter()
    # DPPOTrainer sets up vLLM's CPU runtime itself; GRPOTrainer gets the same engine settings and weight sync here
    # (both steps do nothing off vLLM's CPU platform).
    with trainer_construction_patches(
        config.use_vllm, config.vllm_mode, EngineOptions.from_config(config), device=config.device
    ):
        trainer = trainer_cls(
            model=args.model_dir,
            reward_funcs=ascii_reward,
            args=config,
            train_dataset=dataset,
            processing_class=build_byte_tokenizer(),
            callbacks=[timer],
        )
    bind_colocate_weight_sync(trainer.vllm_generation)
    init_s = time.perf_counter() - start
    # Phase timings, one entry per generation batch: the engine call (TRL's log-prob extraction and DPPO's top-K
    # capture included), the weight sync before it (0 when the weights did not change) and the whole
    # generate-and-score, which for GRPO also holds the π_old recompute.
    generate_s: list[float] = []
    generate_and_score_s: list[float] = []
    sync_s: list[float] = []
    generate_and_score = _timed(trainer._generate_and_score_completions, generate_and_score_s)
    sync_weights = trainer.vllm_generation.sync_weights

    def generate_and_score_with_sync_bucket(*a, **kw):
        sync_s.append(0.0)
        return generate_and_score(*a, **kw)

    def timed_sync(*a, **kw):
        start = time.perf_counter()
        try:
            return sync_weights(*a, **kw)
        finally:
            sync_s[-1] += time.perf_counter() - start

    # No-grad forwards of the policy while a generation batch is scored (TRL's π_old recompute, or any other pass a
    # trainer adds there), one count per generation batch. The instance attribute shadows the class method, and
    # TRL calls it through `self`, so the parent's call sites see this wrapper too. A pass DPPOTrainer declines
    # returns no log-probs and ran no forward: it is not counted.
    forwards: list[int] = []
    scoring = [False]
    get_logps = trainer._get_per_token_logps_and_entropies

    def counted_get_logps(model, *a, **kw):
        result = get_logps(model, *a, **kw)
        if scoring[0] and not torch.is_grad_enabled() and model is trainer.model and result[0] is not None:
            forwards[-1] += 1
        return result

    def generate_and_score_counted(*a, **kw):
        forwards.append(0)
        scoring[0] = True
        try:
            return generate_and_score_with_sync_bucket(*a, **kw)
        finally:
            scoring[0] = False

    trainer.vllm_generation.generate = _timed(trainer.vllm_generation.generate, generate_s)
    trainer.vllm_generation.sync_weights = timed_sync
    trainer._get_per_token_logps_and_entropies = counted_get_logps
    trainer._generate_and_score_completions = generate_and_score_counted
    threads_at_start = thread_settings()
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start

    completion_lengths = [
        e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e
    ]
    result = dict(
        trainer=args.worker,
        trainer_class=type(trainer).__name__,
        step_times_s=timer.times,
        step_cpu_times_s=timer.cpu_times,
        generate_s=generate_s,
        generate_and_score_s=generate_and_score_s,
        sync_weights_s=sync_s,
        policy_forwards_per_generation=forwards,
        steps_per_generation=trainer.args.steps_per_generation,
        init_s=init_s,
        train_s=train_s,
        # Measured, not inferred from the config: TRL also recomputes π_old when gradient accumulation and
        # generation are misaligned, whatever the importance-sampling setting.
        recomputes_old_logps=any(forwards),
        mean_completion_length=statistics.fmean(completion_lengths) if completion_lengths else None,
        torch_threads=torch.get_num_threads(),
        # After the engine started (vLLM's CPU backend may change torch's thread count) and before training.
        threads_at_start=threads_at_start,
        threads_at_end=thread_settings(),
        launcher=launcher(),
    )
    Path(args.result_file).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------


def _free_port(used: set[int]) -> int:
    for port in PORTS:
        if port in used:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        used.add(port)
        return port
    raise RuntimeError(f"No free port in {PORTS.start}-{PORTS.stop - 1}")


def _count_parameters(model_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                total += math.prod(shape)
    return total


def _summary(times: list[float]) -> dict:
    return dict(
        median_s=statistics.median(times),
        mean_s=statistics.fmean(times),
        min_s=min(times),
        max_s=max(times),
    )


def _run_one(trainer: str, args: argparse.Namespace, model_dir: str, workdir: Path, port: int, index: int) -> dict:
    result_file = workdir / f"{trainer}-{index}.json"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        trainer,
        "--model-dir",
        model_dir,
        "--result-file",
        str(result_file),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--divergence",
        args.divergence,
        "--completion-length",
        str(args.completion_length),
        "--batch-size",
        str(args.batch_size),
        "--num-generations",
        str(args.num_generations),
        "--seed",
        str(args.seed),
        "--gradient-accumulation-steps",
        str(args.gradient_accumulation_steps),
        "--num-iterations",
        str(args.num_iterations),
    ]
    if args.steps_per_generation is not None:
        cmd += ["--steps-per-generation", str(args.steps_per_generation)]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Both trainers under one thread setting: without OMP_NUM_THREADS, DPPOTrainer's CPU colocate path trains with one
    # torch thread (dppo_trl.backends.cpu.threads.cpu_colocate_threads) while GRPOTrainer keeps torch's one per core, so the pair
    # would compare thread counts, not trainers. Unset, it is 1 (what `accelerate launch` sets); export it to choose.
    env.setdefault("OMP_NUM_THREADS", "1")
    repo_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall_s = time.perf_counter() - start
    if args.verbose or proc.returncode != 0:
        sys.stderr.write(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{trainer} worker failed with exit code {proc.returncode} (its log is above)")
    result = json.loads(result_file.read_text())
    result.update(wall_s=wall_s, master_port=port)
    return result


def _combine(runs: list[dict], warmup: int, steps_per_cycle: float) -> dict:
    timed = [t for run in runs for t in run["step_times_s"][warmup:]]
    cpu = [t for run in runs for t in run["step_cpu_times_s"][warmup:]]
    # Generation batches that fell in the warm-up steps (one per `steps_per_cycle` optimizer steps).
    gen_warmup = math.ceil(warmup / steps_per_cycle)
    gen = [t for run in runs for t in run["generate_s"][gen_warmup:]]
    gen_score = [t for run in runs for t in run["generate_and_score_s"][gen_warmup:]]
    sync = [t for run in runs for t in run["sync_weights_s"][gen_warmup:]]
    forwards = [n for run in runs for n in run["policy_forwards_per_generation"]]
    # Generate-and-score minus the engine call and the weight sync: rewards, advantages, padding and, for GRPO, the
    # π_old recompute.
    score = [b - a - c for a, b, c in zip(gen, gen_score, sync, strict=True)]
    out = _summary(timed)
    out.update(
        trainer_class=runs[0]["trainer_class"],
        recomputes_old_logps=runs[0]["recomputes_old_logps"],
        step_times_s=timed,
        # CPU time of the whole process (all threads) per step: less sensitive than wall-clock to other processes'
        # load, though OpenMP spin-waiting still inflates it on an oversubscribed machine.
        cpu_median_s=statistics.median(cpu),
        step_cpu_times_s=cpu,
        warmup_step_times_s=[t for run in runs for t in run["step_times_s"][:warmup]],
        generate_s=gen,
        sync_weights_s=sync,
        score_s=score,
        generate_median_s=statistics.median(gen),
        generate_and_score_median_s=statistics.median(gen_score),
        sync_weights_median_s=statistics.median(sync),
        score_median_s=statistics.median(score),
        mean_completion_length=statistics.fmean(
            r["mean_completion_length"] for r in runs if r["mean_completion_length"] is not None
        ),
        init_s=[r["init_s"] for r in runs],
        process_wall_s=[r["wall_s"] for r in runs],
        # No-grad policy forwards while scoring each generation batch (warm-up included: a count, not a time).
        policy_forwards_per_generation=max(forwards) if forwards else None,
        policy_forwards_per_generation_all=forwards,
        generations_per_run=[len(r["policy_forwards_per_generation"]) for r in runs],
        steps_per_generation=runs[0]["steps_per_generation"],
        torch_threads=runs[0]["torch_threads"],
        threads_at_start=runs[0]["threads_at_start"],
        threads_at_end=runs[0]["threads_at_end"],
        worker_launcher=runs[0]["launcher"],
    )
    return out


def _ratio(results: dict, key: str) -> float | None:
    if not {"dppo", "grpo"} <= set(results) or not results["grpo"][key]:
        return None
    return results["dppo"][key] / results["grpo"][key]


def measure(args: argparse.Namespace) -> dict:
    """Run each trainer in its own process (`--rounds` times) and put their timings together."""
    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    if not trainers or any(t not in TRAINERS for t in trainers):
        raise SystemExit(f"--trainers must be a subset of {','.join(TRAINERS)}")
    load_before = load_average()
    started = time.perf_counter()
    runs: dict[str, list[dict]] = {t: [] for t in trainers}
    used_ports: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="dppo-step-time-") as tmp:
        workdir = Path(tmp)
        from dppo_dev.tiny_models import save_tiny_model

        model_dir = save_tiny_model(workdir / "model", kind="qwen3", seed=args.seed, **MODEL_PRESETS[args.model_size])
        n_params = _count_parameters(model_dir)
        for round_index in range(args.rounds):
            # Alternate the order each round (A B, B A, ...) so load drift hits both trainers alike.
            order = trainers if round_index % 2 == 0 else trainers[::-1]
            for trainer in order:
                port = _free_port(used_ports)
                runs[trainer].append(_run_one(trainer, args, model_dir, workdir, port, round_index))

    steps_per_generation = args.steps_per_generation or args.gradient_accumulation_steps
    steps_per_cycle = steps_per_generation * args.num_iterations / args.gradient_accumulation_steps
    results = {t: _combine(r, args.warmup, steps_per_cycle) for t, r in runs.items()}
    report = {
        "benchmark": "step_time",
        "process_mode": "one subprocess per trainer run (fresh vLLM engine and MASTER_PORT each)",
        "trainers": results,
        "ratio_median_dppo_over_grpo": _ratio(results, "median_s"),
        "ratio_mean_dppo_over_grpo": _ratio(results, "mean_s"),
        # The least-disturbed step of each trainer: on a shared machine other load only ever adds time.
        "ratio_min_dppo_over_grpo": _ratio(results, "min_s"),
        "ratio_cpu_median_dppo_over_grpo": _ratio(results, "cpu_median_s"),
        # Per phase (medians): where the difference comes from.
        "ratio_generate_dppo_over_grpo": _ratio(results, "generate_median_s"),
        "ratio_score_dppo_over_grpo": _ratio(results, "score_median_s"),
        "policy_forwards_per_generation": {t: r["policy_forwards_per_generation"] for t, r in results.items()},
        "config": {
            "model_size": args.model_size,
            "model": dict(MODEL_PRESETS[args.model_size], vocab_size=259, parameters=n_params),
            "per_device_train_batch_size": args.batch_size,
            "num_generations": args.num_generations,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "steps_per_generation": steps_per_generation,
            "num_iterations": args.num_iterations,
            # With more than one, only one optimizer step of each cycle generates: compare mean step times.
            "optimizer_steps_per_generation": steps_per_cycle,
            "max_completion_length": args.completion_length,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "divergence": args.divergence,
            "seed": args.seed,
            "vllm_mode": "colocate",
            "grpo_config": "GRPOConfig defaults (vllm_importance_sampling_correction=True: recomputes π_old)",
            "dppo_config": "DPPOConfig defaults (anchor='behavior': μ from the engine, no recompute)",
        },
        "versions": versions(),
        "machine": machine_info(load_before),
        # How the driver was started and its thread environment (each worker's is under `trainers`).
        "launcher": launcher(),
        "threads": thread_settings(),
        "total_wall_s": time.perf_counter() - started,
    }
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        with stdout_to_stderr():
            run_worker(args)
        return {}
    with stdout_to_stderr():
        report = measure(args)
    emit_json(report, args.output)
    return report


if __name__ == "__main__":
    main()
