# Copyright 2026 The dppo-trl Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""
A short DPPO training run of a randomly initialised, Qwen3-shaped model with transformers generation, for each
divergence × `use_liger_kernel` setting, one fresh subprocess per run (Liger patches modules process-wide).

`--size 100m` (the GPU check): Qwen3's vocabulary (151,936, tied embeddings), hidden 512, 8 layers — about 103M
parameters — in bf16 mixed precision on CUDA. `--size tiny`: the test-suite model, for a smoke run on CPU. Two
optimizer steps per generation batch (`steps_per_generation = 2`), so the second is off-policy and top-K DPPO takes
μ's top-K from the recomputed generating weights. The reward scores completion token ids (the byte tokenizer cannot
decode ids above 258), so groups have reward variance and the policy moves.

Reports per run: losses, grad norms, DPPO metrics of every step, whether all are finite, whether the weights moved,
wall time per optimizer step and the peak CUDA memory. Prints one JSON object to stdout (notices go to stderr) and
exits 1 unless every run finished with finite values and moved the weights (a run that raised counts as failed).

    python benchmarks/gpu_train.py                       # 100m on CUDA: binary_tv, topk_tv × liger off, on
    python benchmarks/gpu_train.py --size tiny --device cpu --liger off --steps 2
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {
    "100m": dict(
        vocab_size=151936,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1536,
        tie_word_embeddings=True,
    ),
    "tiny": dict(),
}
STEP_KEYS = ("loss", "grad_norm", "entropy", "dppo/mask_ratio", "dppo/divergence_mean", "dppo/mismatch_abs_mean")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="100m", help="model size preset")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--divergences", default="binary_tv,topk_tv", help="comma-separated DPPO divergences")
    parser.add_argument("--liger", default="off,on", help="comma-separated use_liger_kernel settings (off, on)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size (completions)")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=64, help="max_completion_length")
    parser.add_argument("--top-k", type=int, default=20, help="divergence_top_k of the top-K runs")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # "<divergence>:<off|on>", in a fresh process
    return parser.parse_args(argv)


def _id_reward(completions, completion_ids, **kwargs):
    """Mean token id, scaled: continuous, so completions of one group get different rewards."""
    return [sum(ids) / (max(len(ids), 1) * 151936.0) for ids in completion_ids]


def run_worker(args) -> dict:
    import torch
    from datasets import Dataset

    from dppo_dev.offline import set_offline_env
    from dppo_dev.tiny_models import save_tiny_model
    from dppo_trl import DPPOConfig, DPPOTrainer

    set_offline_env()
    divergence, liger = args.worker.split(":")
    cuda = args.device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(os.path.join(tmp, "model"), kind="qwen3", **SIZES[args.size])
        prompts = [f"{a}+{b}=" for a in range(8) for b in range(8)]
        config = DPPOConfig(
            output_dir=os.path.join(tmp, "out"),
            use_cpu=not cuda,
            bf16=cuda,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=1,
            seed=0,
            learning_rate=1e-4,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            num_generations=args.num_generations,
            steps_per_generation=2,
            max_completion_length=args.completion_length,
            divergence=divergence,
            divergence_top_k=args.top_k,
            use_liger_kernel=liger == "on",
        )
        trainer = DPPOTrainer(
            model=model_dir,
            reward_funcs=_id_reward,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
        )
        params = sum(p.numel() for p in trainer.model.parameters())
        before = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer.train()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        after = [p for p in trainer.model.parameters() if p.requires_grad]
        moved = any(not torch.equal(a.detach(), b) for a, b in zip(after, before, strict=True))
    steps = [{k: e[k] for k in STEP_KEYS if k in e} for e in trainer.state.log_history if "loss" in e]
    values = [v for step in steps for v in step.values()]
    return {
        "run": args.worker,
        "parameters": params,
        "steps": steps,
        "all_finite": bool(values) and all(math.isfinite(v) for v in values),
        "weights_moved": moved,
        "wall_s_per_step": round(wall / max(args.steps, 1), 3),
        "peak_cuda_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
    }


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0
    passthrough = list(argv if argv is not None else sys.argv[1:])
    # The checkout (for `dppo_dev`) after the caller's PYTHONPATH, so a dppo_trl installed there (the GPU check's
    # wheel) is the one the workers train with.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ROOT) if p))
    runs = {}
    for divergence in [d for d in args.divergences.split(",") if d]:
        for liger in [x for x in args.liger.split(",") if x]:
            name = f"{divergence}:{liger}"
            print(f"gpu_train: {name}", file=sys.stderr)
            cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--worker", name]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                runs[name] = {"run": name, "error": f"timed out after {args.timeout} s"}
                continue
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-4000:])
                runs[name] = {"run": name, "error": proc.stderr.strip().splitlines()[-1:]}
                continue
            runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    ok = bool(runs) and all(r.get("all_finite") and r.get("weights_moved") for r in runs.values())
    print(
        json.dumps(
            {
                "config": {k: v for k, v in vars(args).items() if k != "worker"} | {"model": SIZES[args.size]},
                "runs": runs,
                "ok": ok,
            },
            indent=1,
        )
    )
    # A failed run must fail the command: scripts/gpu_check.sh (and any CI) reads the exit code.
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
