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
What carrying μ's top-K lists costs in `AsyncDPPOTrainer`, binary (`binary_tv`) against top-K (`topk_tv`, K lists),
at each stage of the asynchronous data path (`dppo_trl/trainers/trl116/async_topk.py`):

- `server_response`: bytes per completion token of the server's `/v1/completions` choice (`"logprobs": 0` against
  `"logprobs": K` with `token_id:N` keys), built in vLLM's format from random ids and log-probs, and the time
  `completion_topk` takes to read the K lists (per 1,000 tokens);
- `sample`: bytes of one rollout sample as the worker process pickles it onto the queue (`RolloutSample` against
  `TopKRolloutSample`), and the arrays' bytes per trained token;
- `collate`: the time to read the samples through `SampleVersionQueue`, pack them in TRL's `TreeRow` and run
  `SampleVersionCollator`, and the bytes of the batch's top-K tensors;
- `loss_step`: `AsyncDPPOTrainer.compute_loss` plus backward on that batch (tiny model, CPU tree attention; the two
  variants alternate), the increase of the process's peak RSS during one step (Linux `VmHWM`, reset right before),
  and, for top-K, the time of its own extra work alone (`topk_gather_s`: π at the K + 1 ids of every loss term).

Times are medians over `--repeats`; nothing here calls a server. Prints one JSON object on stdout.

    .venv/bin/python benchmarks/async_topk_cost.py [--samples 32 --prompt-tokens 32 --completion-tokens 128 --k 20]
    .venv/bin/python benchmarks/async_topk_cost.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dppo_dev.bench_env import emit_json, load_average, machine_info, stdout_to_stderr, thread_settings, versions

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO_ROOT / "examples" / "tiny_math_model"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32, help="rollout samples in the micro-batch")
    parser.add_argument("--group-size", type=int, default=4, help="samples sharing a prompt (TRL's num_generations)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--completion-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=20, help="divergence_top_k")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", type=Path, default=TINY_MODEL)
    parser.add_argument("--quick", action="store_true", help="smallest sizes (8 samples of 8 + 16 tokens, K = 4)")
    parser.add_argument("--output", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.group_size, args.prompt_tokens, args.completion_tokens = 8, 4, 8, 16
        args.k, args.repeats = 4, 1
    for name in ("samples", "group_size", "prompt_tokens", "completion_tokens", "k", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _median_time(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _choice(rng, token_ids, vocab: int, k: int) -> dict:
    """A `/v1/completions` choice in vLLM's format: `logprobs: 0` (k = 0) or `logprobs: k` with `token_id:N` keys."""
    logps = (-rng.exponential(2.0, size=len(token_ids))).tolist()
    choice = {"token_ids": token_ids, "logprobs": {"token_logprobs": logps, "tokens": [], "top_logprobs": []}}
    for t, sampled in enumerate(token_ids):
        choice["logprobs"]["tokens"].append(f"token_id:{sampled}")
        if k:
            others = rng.choice(vocab, size=k + 1, replace=False).tolist()
            entries = {f"token_id:{sampled}": logps[t]}
            entries.update({f"token_id:{i}": float(-rng.exponential(3.0)) for i in others if i != sampled})
            choice["logprobs"]["top_logprobs"].append(dict(list(entries.items())[: k + 1]))
        else:
            choice["logprobs"]["top_logprobs"].append({f"token_id:{sampled}": logps[t]})
    return choice


def _samples(args, rng, vocab: int, topk: bool):
    import numpy as np
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    from dppo_trl.trainers.trl116.async_topk import TopKRolloutSample, completion_topk

    samples = []
    for i in range(args.samples):
        group = i // args.group_size
        prompt = np.random.default_rng(group).integers(0, vocab, size=args.prompt_tokens).tolist()
        completion = rng.integers(0, vocab, size=args.completion_tokens).tolist()
        choice = _choice(rng, completion, vocab, args.k if topk else 0)
        fields = dict(
            prompt=[],
            completion=[],
            input_ids=np.asarray(prompt + completion, dtype=np.int64),
            completion_mask=np.asarray([0] * len(prompt) + [1] * len(completion), dtype=np.int64),
            old_log_probs=np.asarray([0.0] * len(prompt) + choice["logprobs"]["token_logprobs"], dtype=np.float32),
            advantage=float(rng.normal()),
            model_version=0,
            group_id=group,
            metrics={"reward": 0.0},
        )
        if topk:
            ids, logps = completion_topk(choice, args.k)
            samples.append(TopKRolloutSample(**fields, topk_ids=ids, topk_logps=logps))
        else:
            samples.append(RolloutSample(**fields))
    return samples


def _collate(samples, pad_token_id: int):
    """The trainer's path from the queue to the batch for one micro-batch on one process."""
    from trl.experimental.async_grpo.packing import TreeRow

    from dppo_trl.trainers.async_dppo_trainer import SampleVersionCollator, SampleVersionQueue

    source = queue.Queue()
    for sample in samples:
        source.put(sample)
    reader = SampleVersionQueue(source)
    row = TreeRow()
    for _ in samples:
        s = reader.get()
        keys = ("input_ids", "completion_mask", "old_log_probs", "advantage", "group_id", "metrics")
        row.add({key: getattr(s, key) for key in keys})
    return SampleVersionCollator(pad_token_id)([[row]])


def _peak_rss_reset() -> int | None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS")
    except OSError:
        return None


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _trainer(args, tmp: str, divergence: str):
    from transformers import AutoTokenizer

    from dppo_trl import AsyncDPPOConfig, AsyncDPPOTrainer

    class _IdleWorker:  # TRL's `RolloutWorkerProtocol`; never started: the benchmark feeds the collator itself
        rollout_buffer = queue.Queue()
        metrics_queue = queue.Queue()

        def start(self):
            pass

        def stop(self):
            pass

        def update_model_version(self, model_version):
            pass

        def check_health(self, stale_after_s):
            pass

    config = AsyncDPPOConfig(
        output_dir=os.path.join(tmp, divergence),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        divergence=divergence,
        divergence_top_k=args.k,
        vllm_server_base_url="http://127.0.0.1:1",  # never contacted
        token_budget=0,
    )
    from datasets import Dataset

    trainer = AsyncDPPOTrainer(
        model=str(args.model),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]]}),
        processing_class=AutoTokenizer.from_pretrained(str(args.model)),
        rollout_worker=_IdleWorker(),
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _loss_steps(trainers: dict, batches: dict, repeats: int) -> dict:
    """`compute_loss` + backward per variant: a warm-up step each, the peak-RSS step each, then `repeats` timed steps
    alternating the variants (order flipped every round) so a change in machine load hits both alike."""
    from dppo_trl.backends.cpu.async_cpu import cpu_tree_attention

    def step(name):
        trainer = trainers[name]
        trainer.model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with cpu_tree_attention():
            loss = trainer.compute_loss(trainer.model, dict(batches[name]))
        loss.backward()
        return time.perf_counter() - start

    names = list(trainers)
    out = {}
    for name in names:
        step(name)  # warm-up: first-call allocations are not the step's cost
        before = _peak_rss_reset()
        step(name)
        peak = _status_kib("VmHWM")
        extra = None if before is None or peak is None else round(max(peak - before, 0) / 1024, 2)
        out[name] = {"times": [], "peak_extra_mib": extra}
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            out[name]["times"].append(step(name))
    return {
        name: {"time_s": round(statistics.median(r["times"]), 5), "peak_extra_mib": r["peak_extra_mib"]}
        for name, r in out.items()
    }


def _gather_time(trainer, batch, repeats: int) -> float:
    """The top-K-only work of the loss step: π at μ's K + 1 ids of every loss term (`logps_at_ids_from_sampled`, on
    hidden states of the model's width)."""
    import torch

    from dppo_trl.kernels.topk_logps import logps_at_ids_from_sampled
    from dppo_trl.trainers.trl116.async_topk import BEHAVIOR_TOPK_IDS

    ids = batch[BEHAVIOR_TOPK_IDS][batch["token_index"] >= 0]
    weight = trainer.model.get_output_embeddings().weight
    hidden = torch.randn(ids.shape[0], weight.shape[1])
    seconds, _ = _median_time(
        lambda: logps_at_ids_from_sampled(hidden, weight, ids, ids[:, 0], torch.zeros(ids.shape[0])), repeats
    )
    return round(seconds, 6)


def _measure(args, tmp: str) -> dict:
    import numpy as np
    import torch

    from dppo_trl.trainers.trl116.async_topk import BEHAVIOR_TOPK_IDS, BEHAVIOR_TOPK_LOGPS, completion_topk

    torch.manual_seed(0)
    trainers = {name: _trainer(args, tmp, name) for name in ("binary_tv", "topk_tv")}
    vocab = trainers["binary_tv"].model.config.get_text_config().vocab_size
    pad = trainers["binary_tv"].processing_class.pad_token_id
    results, batches = {}, {}
    for name, topk in (("binary_tv", False), ("topk_tv", True)):
        rng = np.random.default_rng(0)
        choices = [_choice(rng, rng.integers(0, vocab, 64).tolist(), vocab, args.k if topk else 0) for _ in range(8)]
        response_bytes = sum(len(json.dumps(c)) for c in choices) / (64 * len(choices))
        parse_s = None
        if topk:
            parse_s, _ = _median_time(
                lambda choices=choices: [completion_topk(c, args.k) for c in choices], args.repeats
            )
            parse_s = round(parse_s * 1000 / (64 * len(choices)), 6)
        samples = _samples(args, np.random.default_rng(1), vocab, topk)
        pickled = statistics.mean(len(pickle.dumps(s)) for s in samples)
        array_bytes = sum(
            s.input_ids.nbytes + s.completion_mask.nbytes + s.old_log_probs.nbytes for s in samples
        ) + sum(s.topk_ids.nbytes + s.topk_logps.nbytes for s in samples if topk)
        trained = sum(int(s.completion_mask.sum()) for s in samples)
        collate_s, batch = _median_time(lambda samples=samples: _collate(samples, pad), args.repeats)
        topk_batch = sum(batch[key].nbytes for key in (BEHAVIOR_TOPK_IDS, BEHAVIOR_TOPK_LOGPS) if key in batch)
        results[name] = {
            "server_response": {"bytes_per_token": round(response_bytes, 1), "parse_s_per_1k_tokens": parse_s},
            "sample": {
                "pickled_bytes_mean": round(pickled, 1),
                "array_bytes_per_trained_token": round(array_bytes / trained, 2),
            },
            "collate": {"time_s": round(collate_s, 5), "batch_topk_bytes": topk_batch},
        }
        batches[name] = batch
    for name, measured in _loss_steps(trainers, batches, args.repeats).items():
        results[name]["loss_step"] = measured
    results["binary_tv"]["loss_step"]["topk_gather_s"] = None
    results["topk_tv"]["loss_step"]["topk_gather_s"] = _gather_time(
        trainers["topk_tv"], batches["topk_tv"], args.repeats
    )

    def ratio(stage: str, key: str):
        a, b = results["topk_tv"][stage][key], results["binary_tv"][stage][key]
        return None if a is None or not b else round(a / b, 3)

    return {
        "benchmark": "async_topk_cost",
        "settings": {
            "samples": args.samples,
            "group_size": args.group_size,
            "prompt_tokens": args.prompt_tokens,
            "completion_tokens": args.completion_tokens,
            "k": args.k,
            "repeats": args.repeats,
            "model": os.path.relpath(args.model, REPO_ROOT)
            if args.model.is_relative_to(REPO_ROOT)
            else str(args.model),
            "vocab_size": vocab,
            "hidden_size": trainers["binary_tv"].model.config.get_text_config().hidden_size,
        },
        "results": results,
        "ratios_topk_over_binary": {
            "server_response_bytes": ratio("server_response", "bytes_per_token"),
            "sample_pickled_bytes": ratio("sample", "pickled_bytes_mean"),
            "collate_time": ratio("collate", "time_s"),
            "loss_step_time": ratio("loss_step", "time_s"),
        },
        "machine": machine_info(LOAD_BEFORE, threads=thread_settings()),
        "versions": versions(),
    }


LOAD_BEFORE = load_average()


def main(argv=None) -> dict:
    args = parse_args(argv)
    with stdout_to_stderr(), tempfile.TemporaryDirectory(prefix="dppo-async-topk-cost-") as tmp:
        report = _measure(args, tmp)
    emit_json(report, args.output)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
