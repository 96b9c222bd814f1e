# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""
Train a tool-calling agent with DPPO: `DPPOTrainer(tools=...)` (sync, the default) or `AsyncDPPOTrainer` (`--async`).

With no arguments it runs offline on CPU: the bundled tiny agent (`examples/tiny_agent_model`, built by
`scripts/make_tiny_agent_model.py`) learns to answer "What is 47*38?" through a `multiply` tool, with TRL's multi-turn
tool loop, vLLM colocate sampling and top-K DPPO (`divergence=topk_tv`, μ's top-K lists placed per turn). Before and
after training it runs the held-out split (`examples/data/tiny_agent/test.jsonl`) with the real tool, sampled at the
training temperature, and reports task accuracy, tool-call rate, malformed-call rate and mean assistant turns. It writes
`summary.json` and a PNG (learning + DPPO's trust-region panel) to the output directory and prints one JSON line.

```bash
python examples/train_tool_agent.py
python examples/train_tool_agent.py --divergence binary_tv
python examples/train_tool_agent.py --async   # AsyncDPPOTrainer against a CPU vLLM server it starts
# GPU (unverified): Qwen3-1.7B with the calculator tool
python examples/train_tool_agent.py --config examples/recipes/agents/qwen3_1.7b_calculator_agent.yaml
```
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
TINY_AGENT_DIR = os.path.join(EXAMPLES_DIR, "tiny_agent_model")
TRAIN_FILE = os.path.join(EXAMPLES_DIR, "data", "tiny_agent", "train.jsonl")
TEST_FILE = os.path.join(EXAMPLES_DIR, "data", "tiny_agent", "test.jsonl")

# The no-argument CPU runs (applied only to options the user did not set).
COMMON_DEFAULTS = {
    "learning_rate": 3e-4,  # a 364k-parameter model takes a far larger step than a 1.7B one (1e-3 collapsed here)
    "max_steps": 96,
    "per_device_train_batch_size": 32,  # 4 prompts x 8 completions per optimizer step
    "num_generations": 8,
    "max_completion_length": 128,  # call (~64 tokens with the empty thinking block) + tool turn (~26) + answer (~19)
    "max_tool_calling_iterations": 2,
    "temperature": 1.0,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
    "bf16": False,
    "seed": 0,
}
SYNC_DEFAULTS = {
    **COMMON_DEFAULTS,
    "output_dir": "outputs/tool-agent-dppo",
    "steps_per_generation": 4,  # 4 optimizer steps per rollout: π moves away from μ, the trust region acts
    "beta": 0.0,
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_max_model_length": 256,
    "divergence": "topk_tv",
    "divergence_top_k": 4,
    "log_completions": False,
}
ASYNC_DEFAULTS = {
    **COMMON_DEFAULTS,
    "output_dir": "outputs/tool-agent-async-dppo",
    "max_steps": 16,  # ~15 s per step on 2 CPU cores (the worker and the trainer share them)
    "divergence": "binary_tv",  # top-K in async is the async trainer's own work (docs/agents.md)
    "max_staleness": 4,
    "token_budget": 0,
    "gradient_checkpointing": False,
}


@dataclass
class ToolAgentArguments:
    """Options of `train_tool_agent.py` besides the trainer's config."""

    model_name_or_path: str = field(default=TINY_AGENT_DIR, metadata={"help": "Model (and tokenizer) to train."})
    train_file: str = field(default=TRAIN_FILE, metadata={"help": "JSON lines with `prompt` and `answer`."})
    test_file: str = field(default=TEST_FILE, metadata={"help": "Held-out JSON lines, evaluated before and after."})
    eval_problems: int = field(default=200, metadata={"help": "Held-out problems to evaluate (0: skip)."})
    eval_max_new_tokens: int = field(default=80, metadata={"help": "Tokens per assistant turn in evaluation."})
    use_async: bool = field(
        default=False,
        metadata={"aliases": ["--async"], "help": "Train with AsyncDPPOTrainer against a vLLM server."},
    )
    start_server: bool | None = field(
        default=None,
        metadata={"help": "With --async: start a CPU vLLM server for the model (default: yes without CUDA)."},
    )


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def evaluate(model, tokenizer, rows: list[dict], args: ToolAgentArguments, temperature: float, max_tool_calls: int):
    """Task accuracy, tool-call rate, malformed-call rate and mean turns on `rows`, with the real tool."""
    import torch

    from dppo_dev.tiny_agent import rollout_stats, sample_episode_text

    was_training = model.training
    model.eval()
    with torch.no_grad():
        records = sample_episode_text(
            model,
            tokenizer,
            rows,
            temperature=temperature,
            max_new_tokens=args.eval_max_new_tokens,
            max_tool_calls=max_tool_calls,
        )
    model.train(was_training)
    return {k: round(v, 4) for k, v in rollout_stats(records).items()}


def _parse(argv: list[str]):
    from trl import TrlParser

    from dppo_trl import AsyncDPPOConfig, DPPOConfig

    use_async = "--async" in argv or "--use_async" in argv
    config_class, defaults = (AsyncDPPOConfig, ASYNC_DEFAULTS) if use_async else (DPPOConfig, SYNC_DEFAULTS)
    explicit = {a.split("=")[0].lstrip("-") for a in argv if a.startswith("--")}
    if "config" not in explicit:
        for key, value in defaults.items():
            if key not in explicit:
                argv = [*argv, f"--{key}", str(value)]
    return TrlParser((ToolAgentArguments, config_class)).parse_args_and_config(argv)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args, training_args = _parse(argv)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dppo_dev.tiny_agent import agent_reward, multiply

    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    train = Dataset.from_list(_read_jsonl(script_args.train_file))
    test_rows = _read_jsonl(script_args.test_file)[: script_args.eval_problems]
    max_tool_calls = training_args.max_tool_calling_iterations or 1
    summary: dict = {"trainer": "AsyncDPPOTrainer" if script_args.use_async else "DPPOTrainer"}
    summary["divergence"] = training_args.divergence
    if test_rows:
        base = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path, dtype=torch.float32)
        summary["before"] = evaluate(
            base, tokenizer, test_rows, script_args, training_args.temperature, max_tool_calls
        )
        del base

    server = None
    if script_args.use_async:
        from dapo_math.server import start_cpu_server, stop_server
        from dppo_trl import AsyncDPPOTrainer as trainer_class

        start_server = (
            script_args.start_server if script_args.start_server is not None else not torch.cuda.is_available()
        )
        if start_server:
            log_path = os.path.join(training_args.output_dir, "vllm_server.log")
            server, training_args.vllm_server_base_url = start_cpu_server(script_args.model_name_or_path, log_path)
    else:
        from dppo_trl import DPPOTrainer as trainer_class
    try:
        trainer = trainer_class(
            model=script_args.model_name_or_path,
            reward_funcs=agent_reward,
            args=training_args,
            train_dataset=train,
            processing_class=tokenizer,
            tools=[multiply],
        )
        trainer.train()
    finally:
        if server is not None:
            stop_server(server)

    history = trainer.state.log_history
    if test_rows:
        # A fresh copy with the trained weights: the async trainer's model runs TRL's packed tree attention, which
        # `generate` cannot use.
        trained = AutoModelForCausalLM.from_pretrained(
            script_args.model_name_or_path, dtype=torch.float32, attn_implementation="sdpa"
        )
        trained.load_state_dict(trainer.accelerator.unwrap_model(trainer.model).state_dict())
        summary["after"] = evaluate(
            trained, tokenizer, test_rows, script_args, training_args.temperature, max_tool_calls
        )
    steps = [h for h in history if "dppo/mask_ratio" in h]
    summary["steps"] = len(steps)
    rollouts = [h["reward"] for h in history if "reward" in h]
    if steps:
        summary["reward_first"], summary["reward_last"] = rollouts[0], rollouts[-1]
        summary["mask_ratio_mean"] = round(sum(h["dppo/mask_ratio"] for h in steps) / len(steps), 5)
    summary["seconds"] = round(time.time() - start, 1)
    os.makedirs(training_args.output_dir, exist_ok=True)
    from dapo_math.plots import plot_training_curves

    title = f"{summary['trainer']} ({training_args.divergence}) on the tiny tool task"
    summary["plot"] = plot_training_curves(history, os.path.join(training_args.output_dir, "tool_agent.png"), title)
    with open(os.path.join(training_args.output_dir, "summary.json"), "w") as f:
        json.dump({**summary, "log_history": history}, f, indent=2)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
