# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""
Asynchronous DPPO on DAPO-Math: `AsyncDPPOTrainer` (TRL's experimental `AsyncGRPOTrainer` + DPPO's trust region).

A rollout worker samples from a vLLM server while the trainer trains on samples up to `max_staleness` policy versions
old; DPPO's trust region is anchored on the server's μ, however stale (docs/async.md). Same data and rewards as
`train_dapo_math.py` (`examples/dapo_math/*`).

With no arguments it runs a CPU-sized version offline: it starts `python -m dppo_trl.backends.cpu.vllm_server` with the bundled
tiny Qwen3 on a free port, trains it on the bundled tiny math set, stops the server, and prints one summary line
(reward first/last, staleness, mask rates). A few minutes on 2 cores.

Preemption: with `--enable_jit_checkpoint true`, SIGTERM saves a complete checkpoint, stops the server this script
started and exits with code 143 without writing a final model; `--resume_from_checkpoint latest` (or a checkpoint
path) continues from the newest complete checkpoint in `--output_dir` (docs/faults.md).

```bash
python examples/train_dapo_math_async.py
# GPU: server on its own GPUs (see examples/recipes/async/qwen3_1.7b_base_dapo_math_async.yaml), trainer on the others
CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3-1.7B-Base --logprobs-mode processed_logprobs \
    --weight-transfer-config '{"backend":"nccl"}' --port 8000 &
CUDA_VISIBLE_DEVICES=1 python examples/train_dapo_math_async.py \
    --config examples/recipes/async/qwen3_1.7b_base_dapo_math_async.yaml
```
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl import TrlParser

from dapo_math.data import load_aime, load_dapo_math
from dapo_math.demo import TINY_ASYNC_RUN_DEFAULTS, TINY_MODEL_DIR, TINY_TEST_FILE, TINY_TRAIN_FILE
from dapo_math.evaluation import async_eval_callback
from dapo_math.plots import summarize_async_run
from dapo_math.rewards import accuracy_reward, format_reward
from dppo_trl import AsyncDPPOConfig, AsyncDPPOTrainer
from dppo_trl.cli.inputs import resolve_resume, resolve_reward_func
from dppo_trl.cli.server import load_tokenizer, start_cpu_server, stop_server

# The no-argument CPU run (applied only to options the user did not set), shared with `dppo-trl train-async`.
TINY_RUN_DEFAULTS = TINY_ASYNC_RUN_DEFAULTS


@dataclass
class AsyncScriptArguments:
    model_name_or_path: str = field(default=TINY_MODEL_DIR, metadata={"help": "Model to train (and to serve)."})
    dataset_name: str = field(default=TINY_TRAIN_FILE, metadata={"help": "DAPO-Math-17k id or a local file."})
    max_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training problems."})
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Rewards, as `dppo-trl train-async` takes them (TRL's bundled names or import paths). Default: "
            "`accuracy_reward` and `format_reward` of `dapo_math.rewards`, equally weighted."
        },
    )
    eval_dataset: str | None = field(
        default=TINY_TEST_FILE,
        metadata={
            "help": "Problems (`prompt`/`ground_truth`, a local file or Hub id) scored avg@k before and after "
            "training with the trained policy (transformers generation, so the server's lag does not enter the "
            "score); `none` skips it."
        },
    )
    eval_num_samples: int = field(default=4, metadata={"help": "k: completions per evaluation problem."})
    start_server: bool | None = field(
        default=None,
        metadata={
            "help": "Start `python -m dppo_trl.backends.cpu.vllm_server` for the model on a free local port (CPU). Default: yes "
            "without CUDA, no with it (start the server on its own GPUs and pass --vllm_server_base_url)."
        },
    )


def summarize(history: list[dict]) -> dict:
    """First/last reward, staleness and DPPO mask rates of a run's log history."""
    return summarize_async_run(history)


def evaluation_callback(trainer, script_args: AsyncScriptArguments, args: AsyncDPPOConfig):
    """avg@k on `--eval_dataset` at the start and the end of training, sampled as training samples (`None`: off)."""
    if not script_args.eval_dataset or script_args.eval_dataset.lower() == "none":
        return None
    name = os.path.splitext(os.path.basename(script_args.eval_dataset.rstrip("/")))[0]
    return async_eval_callback(
        trainer, {name: load_aime(script_args.eval_dataset)}, script_args.eval_num_samples, args
    )


def main(argv: list[str] | None = None, callbacks: list | None = None) -> dict:
    parser = TrlParser((AsyncScriptArguments, AsyncDPPOConfig))
    argv = sys.argv[1:] if argv is None else argv
    explicit = {a.split("=")[0].lstrip("-") for a in argv if a.startswith("--")}
    if not explicit & {"config", "model_name_or_path"}:
        # The CPU demo: its settings go in as command-line options, so the config validates them like any other.
        for key, value in TINY_RUN_DEFAULTS.items():
            if key not in explicit:
                argv = [*argv, f"--{key}", str(value)]
    script_args, training_args = parser.parse_args_and_config(argv)
    import torch

    start = script_args.start_server if script_args.start_server is not None else not torch.cuda.is_available()
    # `latest`/`true`: the newest complete checkpoint of --output_dir; a path must be a complete checkpoint.
    resume = resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir)
    dataset = load_dapo_math(script_args.dataset_name, max_samples=script_args.max_samples)
    dataset = dataset.remove_columns([c for c in dataset.column_names if c not in ("prompt", "ground_truth")])
    server = evaluation = None
    if start:
        log_path = os.path.join(training_args.output_dir, "vllm_server.log")
        server, training_args.vllm_server_base_url = start_cpu_server(script_args.model_name_or_path, log_path)
    try:
        trainer = AsyncDPPOTrainer(
            model=script_args.model_name_or_path,
            reward_funcs=[resolve_reward_func(name) for name in script_args.reward_funcs]
            if script_args.reward_funcs
            else [accuracy_reward, format_reward],
            args=training_args,
            train_dataset=dataset,
            processing_class=load_tokenizer(script_args.model_name_or_path),
            callbacks=callbacks,
        )
        evaluation = evaluation_callback(trainer, script_args, training_args)
        if evaluation is not None:
            trainer.add_callback(evaluation)
        # A SIGTERM under --enable_jit_checkpoint raises TrainingPreempted (exit 143) here, after its checkpoint:
        # the server is stopped below and no final model is saved.
        trainer.train(resume_from_checkpoint=resume)
        trainer.save_model(training_args.output_dir)
    finally:
        if server is not None:
            stop_server(server)
    summary = summarize(trainer.state.log_history)
    if evaluation is not None:
        summary["eval"] = evaluation.history  # [{"step": 0, "eval/test/avg@4": ...}, {"step": N, ...}]
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
