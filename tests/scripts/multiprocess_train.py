"""One rank of a multi-process DPPO run, launched by `tests/system/test_multiprocess.py` (torchrun / accelerate launch).

Each rank trains the same tiny model on its share of the batch and writes `<out>/rank<R>.json`:

- `distributed_type`, `world_size`, `rank`: what accelerate actually set up;
- `log_history`: the trainer's logged (rank-reduced) metrics, one entry per step;
- `local`: one record per loss call with this rank's own per-token sums (tokens, masked tokens, positive-advantage
  tokens, |π − μ| maximum), taken through `DPPOTrainer.trust_region_observers` — the values before any reduction;
- `params`: checksums of the full parameters after training (ZeRO-3 parameters are gathered first), so ranks and
  the starting point can be compared;
- `zero3`: for DeepSpeed runs, how many parameters are partitioned and this rank's local element count.

Usage: `torchrun --nproc_per_node 2 --master_port P tests/scripts/multiprocess_train.py --model M --out DIR
[--vllm] [--zero3] [--steps-per-generation N] [--max-steps N]`.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import math
import os

from dppo_dev.offline import set_offline_env

set_offline_env()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from dppo_dev.tiny_models import build_byte_tokenizer  # noqa: E402
from dppo_trl import DPPOConfig, DPPOTrainer  # noqa: E402

PROMPTS = ["1+1=", "2+3=", "4+4=", "5+1=", "7+2=", "3+3=", "6+2=", "8+1="]


def ascii_reward(completions, **kwargs) -> list[float]:
    """Fraction of ASCII characters: a random byte-level model gets varied rewards, so advantages are non-zero."""
    return [sum(ord(ch) < 128 for ch in text) / max(len(text), 1) for text in completions]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="saved model folder (vLLM colocate reloads it by name)")
    parser.add_argument("--out", required=True, help="folder for rank<R>.json")
    parser.add_argument("--vllm", action="store_true", help="generate with vLLM colocate (one engine per rank)")
    parser.add_argument(
        "--zero3", action="store_true", help="launched by `accelerate launch` with a DeepSpeed ZeRO-3 config"
    )
    parser.add_argument("--steps-per-generation", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--delta", type=float, default=None, help="δ_low = δ_high (default: the config's)")
    parser.add_argument(
        "--watchdog", type=float, default=0, help="seconds after which to print every thread's stack and exit"
    )
    return parser.parse_args()


def build_config(args: argparse.Namespace) -> DPPOConfig:
    values = dict(
        output_dir=os.path.join(args.out, "trainer"),
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        logging_steps=1,
        seed=0,
        steps_per_generation=args.steps_per_generation,
        gradient_checkpointing=False,
        sync_mismatch_action="raise",  # each sync checked over every rank's fresh tokens (one collective)
    )
    if args.delta is not None:
        values.update(delta_low=args.delta, delta_high=args.delta)
    if args.vllm:
        values.update(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64)
    if args.zero3:
        # accelerate builds a DeepSpeed engine only off its CPU path, and without a GPU it needs the backend named or
        # it sizes the batch for one process (see examples/recipes/accelerate/zero3_cpu.yaml).
        values.update(use_cpu=False, ddp_backend="gloo")
    else:
        values.update(use_cpu=True)
    return DPPOConfig(**values)


def _gathered(model, is_zero3: bool):
    if not is_zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


def param_checksums(model, is_zero3: bool) -> dict[str, float]:
    """Sum and sum of squares of every full parameter (in float64), keyed by name."""
    with _gathered(model, is_zero3):
        return {
            name: [float(p.detach().double().sum()), float(p.detach().double().square().sum())]
            for name, p in model.named_parameters()
        }


def zero3_partitioning(model) -> dict:
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_numel")]
    return {
        "partitioned_params": len(partitioned),
        "total_params": sum(1 for _ in model.parameters()),
        "ds_numel": sum(int(p.ds_numel) for p in partitioned),
        "local_numel": sum(p.numel() for p in partitioned),
    }


def main() -> None:
    args = parse_args()
    if args.watchdog > 0:
        # A collective that one rank never joins hangs forever; the stacks say which call it was.
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    config = build_config(args)
    trainer = DPPOTrainer(
        model=args.model,
        reward_funcs=ascii_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=build_byte_tokenizer(),
    )
    state = trainer.accelerator.state
    is_zero3 = trainer.is_deepspeed_enabled

    local = []

    def record(view: dict) -> None:
        valid = view["valid"]
        mismatch = (view["pi_logps"].exp() - view["mu_logps"].exp()).abs()
        local.append(
            {
                "mode": view["mode"],
                "global_step": trainer.state.global_step,
                "tokens": int(valid.sum()),
                "masked": float(((1.0 - view["keep"]) * valid).sum()),
                "pos": int((valid & (view["advantages"] > 0)).sum()),
                "mismatch_abs_max": float(torch.where(valid, mismatch, torch.zeros_like(mismatch)).max()),
            }
        )

    trainer.trust_region_observers.append(record)
    zero3 = zero3_partitioning(trainer.model) if is_zero3 else None
    before = param_checksums(trainer.model, is_zero3)
    trainer.train()
    after = param_checksums(trainer.accelerator.unwrap_model(trainer.model), is_zero3)

    result = {
        "rank": state.process_index,
        "world_size": state.num_processes,
        "distributed_type": str(state.distributed_type),
        "backend": state.backend,
        "log_history": trainer.state.log_history,
        "local": local,
        "params_before": before,
        "params": after,
        "zero3": zero3,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{state.process_index}.json"), "w") as f:
        json.dump(result, f, allow_nan=True)
    assert all(math.isfinite(e.get("loss", 0.0)) for e in trainer.state.log_history)


if __name__ == "__main__":
    main()
