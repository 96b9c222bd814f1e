"""How far a bf16 LoRA run moves the frozen base weights through its vLLM weight syncs: TRL's in-place merge vs DPPO's
out-of-place one, in both trainers.

Each run trains the bundled tiny math model loaded in bf16 (`model_init_kwargs={"dtype": "bfloat16"}`, `bf16=True`)
with LoRA on q/k/v/o, syncing the merged weights to vLLM before every optimizer step, then compares every frozen
`base_layer` weight with the checkpoint loaded the same way:

- `sync`: `DPPOTrainer`, vLLM colocate (engine in bf16);
- `async`: `AsyncDPPOTrainer` against one `python -m dppo_trl.backends.cpu.vllm_server` (started here), a sync after
  every optimizer step.

`merge` picks the sync: `trl` restores TRL 1.16's own (`merge_adapter()` before the stream, `unmerge_adapter()`
after: what main ran before the out-of-place merge), `dppo` is the trainers' default (`dppo_trl.weights`). Per run:
`changed` (base tensors that differ from the checkpoint) of `total`, `max_abs_delta` (max |ΔW|), `rms_ratio`
(rms ΔW / rms W over all base tensors), the syncs that ran, and the mean |π − μ| TRL logs on the last step.

stdout is exactly one JSON object (notices go to stderr); the exit status is non-zero if a run fails.

```bash
python benchmarks/lora_drift.py                             # 12 steps, both trainers, both merges (~6 min)
python benchmarks/lora_drift.py --trainers sync --steps 4   # smoke
```
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import traceback

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch

from dapo_math.data import load_dapo_math
from dapo_math.rewards import accuracy_reward, format_reward
from dapo_math.server import load_tokenizer, start_cpu_server, stop_server
from dppo_dev.bench_env import emit_json, load_average, stdout_to_stderr, thread_settings, versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL_DIR = os.path.join(ROOT, "examples", "tiny_math_model")
TINY_TRAIN_FILE = os.path.join(ROOT, "examples", "data", "tiny_math", "train.jsonl")


def _common(args, output_dir: str) -> dict:
    from peft import LoraConfig

    return dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=True,
        model_init_kwargs={"dtype": "bfloat16"},
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        learning_rate=args.learning_rate,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        logging_steps=1,
        seed=0,
    ), LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def base_drift(model: torch.nn.Module) -> dict:
    """The frozen base weights of a trained `PeftModel` against the checkpoint, loaded in the same dtype."""
    from safetensors.torch import load_file

    checkpoint = load_file(os.path.join(TINY_MODEL_DIR, "model.safetensors"))
    changed, total, max_abs, delta_sq, base_sq = 0, 0, 0.0, 0.0, 0.0
    for name, param in model.named_parameters():
        if ".base_layer." not in name:
            continue
        key = name.removeprefix("base_model.model.").replace(".base_layer", "")
        reference = checkpoint[key].to(param.dtype)
        delta = (param.detach().float() - reference.float()).cpu()
        total += 1
        changed += int(not torch.equal(param.detach().cpu(), reference))
        max_abs = max(max_abs, delta.abs().max().item())
        delta_sq += delta.square().sum().item()
        base_sq += reference.float().square().sum().item()
    return {
        "changed": changed,
        "total": total,
        "max_abs_delta": max_abs,
        "rms_ratio": (delta_sq / base_sq) ** 0.5 if base_sq else None,
    }


def _last(history: list[dict], key: str) -> float | None:
    values = [entry[key] for entry in history if key in entry]
    return values[-1] if values else None


def run(trainer_name: str, merge: str, args, dataset, url: str | None, output_dir: str) -> dict:
    from dppo_trl import AsyncDPPOConfig, AsyncDPPOTrainer, DPPOConfig, DPPOTrainer

    common, lora = _common(args, output_dir)
    if trainer_name == "sync":
        config = DPPOConfig(**common, use_vllm=True, vllm_mode="colocate", vllm_cpu_dtype="bfloat16")
        trainer_class = DPPOTrainer
    else:
        config = AsyncDPPOConfig(**common, vllm_server_base_url=url, max_staleness=1, token_budget=0)
        trainer_class = AsyncDPPOTrainer
    trainer = trainer_class(
        model=TINY_MODEL_DIR,
        reward_funcs=[accuracy_reward, format_reward],
        args=config,
        train_dataset=dataset,
        processing_class=load_tokenizer(TINY_MODEL_DIR),
        peft_config=lora,
    )
    syncs = []
    if trainer_name == "sync":
        if merge == "trl":
            del trainer.vllm_generation._iter_named_params  # the instance's walk: TRL's class method is back
        walk = trainer.vllm_generation.sync_weights
        trainer.vllm_generation.sync_weights = lambda: (syncs.append(1), walk())[1]
    else:
        trainer._merges_lora_out_of_place = merge == "dppo"
        sync = trainer._sync_weight_merged
        trainer._sync_weight_merged = lambda t0: (syncs.append(1), sync(t0))[1]
    trainer.train()
    result = base_drift(trainer.model)
    result["syncs"] = len(syncs)
    result["last_mismatch_abs_mean"] = _last(trainer.state.log_history, "dppo/mismatch_abs_mean")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--trainers", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    parser.add_argument("--merges", nargs="+", default=["trl", "dppo"], choices=["trl", "dppo"])
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    report: dict = {
        "benchmark": "lora_drift",
        "model": "examples/tiny_math_model (bf16 weights, LoRA on q/k/v/o)",
        "settings": vars(args),
        "load_average_start": load_average(),
        "versions": versions(),
    }
    failed = False
    with tempfile.TemporaryDirectory(prefix="dppo-lora-drift-") as tmp, stdout_to_stderr():
        dataset = load_dapo_math(TINY_TRAIN_FILE)
        dataset = dataset.remove_columns([c for c in dataset.column_names if c not in ("prompt", "ground_truth")])
        server, url = None, None
        try:
            if "async" in args.trainers:
                server, url = start_cpu_server(TINY_MODEL_DIR, os.path.join(tmp, "server.log"))
            for trainer_name in args.trainers:
                report[trainer_name] = {}
                for merge in args.merges:
                    try:
                        output_dir = os.path.join(tmp, f"{trainer_name}-{merge}")
                        report[trainer_name][merge] = run(trainer_name, merge, args, dataset, url, output_dir)
                    except Exception as error:  # a failed run is reported, and fails the benchmark
                        traceback.print_exc()
                        report[trainer_name][merge] = {"error": f"{type(error).__name__}: {error}"}
                        failed = True
        finally:
            if server is not None:
                stop_server(server)
    report["load_average_end"] = load_average()
    report["threads"] = thread_settings()
    emit_json(report, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
