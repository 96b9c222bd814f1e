"""The bundled CPU demo: where its tiny model and data are, and the settings of its no-argument runs.

Shared by `examples/train_dapo_math.py`, `examples/train_dapo_math_async.py` and the DAPO-Math recipe of the
`dppo-trl` command (`dapo_math.recipe`), so `python examples/train_dapo_math.py` and `dppo-trl train` run the same
demo. The paths point into the clone this package is installed from (editable, `dev/pyproject.toml`).
"""

from __future__ import annotations

import os

EXAMPLES_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL_DIR = os.path.join(EXAMPLES_DIR, "tiny_math_model")
TINY_TRAIN_FILE = os.path.join(EXAMPLES_DIR, "data", "tiny_math", "train.jsonl")
TINY_TEST_FILE = os.path.join(EXAMPLES_DIR, "data", "tiny_math", "test.jsonl")

# Settings of the no-argument CPU run. They apply only to the bundled tiny model, and only to options the user did
# not set (on the command line or in --config). They reproduce, at CPU size, the setting DPPO exists for: a vLLM
# engine samples in bf16 (`vllm_cpu_dtype`) while the trainer runs in fp32, and each rollout is split into 8
# optimizer steps (the authors' 8 mini-batches per rollout), so π drifts away from the engine's μ within a rollout
# and the trust region masks tokens. `--use_vllm false` runs the transformers-generation variant instead (no engine
# mismatch; μ is TRL's recompute of the generating weights). The real recipes live in examples/recipes/*.yaml.
TINY_RUN_DEFAULTS = {
    "output_dir": "outputs/tiny-math-dppo",
    "use_vllm": True,
    "vllm_mode": "colocate",
    "learning_rate": 3e-4,  # a 130k-parameter model needs a far larger step than an 8B one (1e-6)
    "lr_scheduler_type": "constant",
    "max_steps": 100,  # 12.5 rollouts
    "per_device_train_batch_size": 128,  # completions per optimizer step: 16 prompts x 8 samples
    "gradient_accumulation_steps": 1,
    "steps_per_generation": 8,  # a rollout of 128 prompts x 8 samples feeds 8 optimizer steps
    "num_generations": 8,
    "max_completion_length": 16,  # "Answer: 17" plus end-of-turn is 11 tokens
    "temperature": 1.0,
    "logging_steps": 1,  # per-step logs tell a rollout's first (fresh) step from the drifted ones
    "save_strategy": "no",
    "report_to": "none",
    "gradient_checkpointing": False,  # saves nothing on a model this small and costs time
    "seed": 42,
}
# The tiny model writes DAPO's "Answer:" line only half the time; a small format reward lets RL fix that first
# (accuracy requires the format), which is what makes the accuracy climb within a few minutes. The engine samples in
# bf16 where the CPU has it natively (`DPPOConfig.vllm_cpu_dtype="auto"`).
TINY_EVAL_DEFAULTS = {
    "math_eval_steps": 50,
    "math_eval_num_samples": 4,
    "format_reward_weight": 0.5,
    "vllm_cpu_dtype": "auto",
}

# The asynchronous no-argument CPU run (applied only to options the user did not set).
TINY_ASYNC_RUN_DEFAULTS = {
    "output_dir": "outputs/tiny-math-async-dppo",
    "learning_rate": 3e-4,  # a 130k-parameter model needs a far larger step than an 8B one (1e-6)
    "max_steps": 30,
    "per_device_train_batch_size": 32,  # samples per optimizer step (4 prompts x 8)
    "num_generations": 8,
    "max_completion_length": 16,
    "max_staleness": 4,
    "token_budget": 0,  # fixed sample count per micro-batch
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "gradient_checkpointing": False,
    "use_cpu": True,
    "bf16": False,
    "seed": 42,
}
