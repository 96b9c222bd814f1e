"""The LoRA weight sync under DeepSpeed ZeRO-3: TRL 1.16's walk vs DPPO's, on 2 gloo ranks on CPU.

A shrunk Qwen3-MoE in bf16 (default 8 decoder layers, hidden 512, 16 experts, vocab 8192: 65M parameters, 134 MB with
its adapters) with LoRA on q/k/v/o and, through
`target_parameters`, on the fused expert weights (`gate_up_proj`, `down_proj`), adapters in bf16 as TRL leaves them
under ZeRO-3 (`autocast_adapter_dtype=False`) and non-zero (a trained adapter), partitioned by ZeRO-3 on 2 ranks
(`stage3_param_persistence_threshold: 0`, so every parameter is a partition). Each variant runs in its own 2-rank
launch and walks the weights the way a vLLM sync does, every rank iterating:

- `trl`: TRL's own `VLLMGeneration._iter_named_params` (gathers every parameter, `merge_adapter()`, yields,
  `unmerge_adapter()`);
- `dppo`: `dppo_trl.weights.stream.merged_named_weights` (one decoder layer gathered at a time, merged out of place in
  float32, rounded once to bf16).

Per variant, on rank 0: `peak_gathered_bytes` (the most bytes of ZeRO-3 parameters materialised at once, read at every
yielded tensor), `peak_rss_bytes` and `peak_rss_extra_bytes` (process RSS sampled every millisecond during the walk,
absolute, with TRL and vLLM imported in both, and above its start), `sync_s` (the walk's wall time; the consumer does
nothing), `max_abs_error` (max |sent − reference| over all tensors, read in a second walk, the reference being the
unsharded model merged by PEFT in float64), `tensors` sent and `base_partitions_changed` (rank 0's base partitions
that differ after both walks). `model_bytes` is the whole model (adapters included) in its dtype. The ranks run with
a fixed glibc mmap threshold (`MALLOC_MMAP_THRESHOLD_`, unless set), so that memory a gather frees leaves RSS.

Measured on 2 shared CPU cores (docs/api.md, "LoRA weight sync"): peak gathered 134 MB (TRL) against 14.7 MB (one
decoder layer), peak RSS above the start 166 MB against 48 MB, max error 8.3e-4 against 4.9e-4.

stdout is exactly one JSON object (notices go to stderr); the exit status is non-zero if a variant fails.

```bash
python benchmarks/lora_sync.py             # 8 layers, 16 experts, 65M parameters (~3 min on 2 shared cores)
python benchmarks/lora_sync.py --tiny      # 2 layers, 4 experts: a smoke run
```
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from types import SimpleNamespace

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
VARIANTS = ("trl", "dppo")
SIZES = {
    "default": {"layers": 8, "hidden": 512, "experts": 16, "moe_intermediate": 256, "vocab": 8192, "rank": 8},
    "tiny": {"layers": 2, "hidden": 64, "experts": 4, "moe_intermediate": 32, "vocab": 259, "rank": 4},
}


class RssSampler:
    """The process's resident set size, sampled every `interval` seconds on a thread while the block runs."""

    def __init__(self, interval: float = 1e-3):
        self.interval = interval
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())


def build_peft_model(size: dict):
    import torch
    from peft import LoraConfig, get_peft_model

    from dppo_dev.tiny_models import build_tiny_model

    model, _ = build_tiny_model(
        "qwen3_moe",
        dtype=torch.bfloat16,
        num_layers=size["layers"],
        hidden_size=size["hidden"],
        num_heads=4,
        num_kv_heads=2,
        head_dim=size["hidden"] // 4,
        num_experts=size["experts"],
        moe_intermediate_size=size["moe_intermediate"],
        vocab_size=size["vocab"],
    )
    config = LoraConfig(
        r=size["rank"],
        lora_alpha=2 * size["rank"],
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,  # non-zero B: the adapter of a trained model, so the merge changes every tensor
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return get_peft_model(model, config, autocast_adapter_dtype=False)


def reference_weights(model) -> dict:
    """The unsharded model merged by PEFT in float64, by checkpoint name."""
    import copy

    import torch

    merged = copy.deepcopy(model).to(torch.float64).merge_and_unload()
    return {name: param.detach() for name, param in merged.named_parameters()}


def trl_walk(model):
    """TRL 1.16's own sync walk for `model` under ZeRO-3 (called on a bare `VLLMGeneration`: it reads only the model
    and the distributed backend)."""
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    generation = object.__new__(VLLMGeneration)
    generation.model = model
    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3), fsdp_plugin=None)
    generation._dist = DistributedBackend(SimpleNamespace(state=state))
    return generation._iter_named_params()


def worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    # Both variants import TRL's generation module (and with it vLLM), so their absolute RSS starts alike.
    from trl.generation import vllm_generation  # noqa: F401

    from dppo_trl.weights.stream import merged_named_weights

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    size = SIZES["tiny" if args.tiny else "default"]
    model = build_peft_model(size)
    reference = reference_weights(model) if rank == 0 else {}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": True},
    }
    deepspeed.initialize(model=model, config=config)
    params = list(model.parameters())
    model_bytes = sum(int(p.ds_numel) * p.element_size() for p in params)
    base_before = {id(p): p.ds_tensor.detach().clone() for p in params if not p.requires_grad}

    def walk():
        return trl_walk(model) if args.worker == "trl" else merged_named_weights(model)

    # Memory freed while the model was built and partitioned goes back to the system, so that the RSS of the walk
    # counts what the walk allocates rather than what the allocator kept.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    # The measured walk consumes nothing (a sync's consumer is the same for both); the error is read in a second one.
    peak_gathered, tensors = 0, 0
    dist.barrier()
    start = time.perf_counter()
    with RssSampler() as rss:
        for _ in walk():
            gathered = sum(
                int(p.ds_numel) * p.element_size() for p in params if p.ds_status == ZeroParamStatus.AVAILABLE
            )
            peak_gathered = max(peak_gathered, gathered)
            tensors += 1
    sync_s = time.perf_counter() - start
    max_error = 0.0
    for name, tensor in walk():
        if rank == 0:
            max_error = max(max_error, (tensor.detach().double() - reference[name]).abs().max().item())
    changed = sum(int(not torch.equal(p.ds_tensor, base_before[id(p)])) for p in params if id(p) in base_before)
    if rank == 0:
        result = {
            "peak_gathered_bytes": peak_gathered,
            "model_bytes": model_bytes,
            "peak_rss_bytes": rss.peak,
            "peak_rss_extra_bytes": rss.peak - rss.start,
            "sync_s": sync_s,
            "max_abs_error": max_error,
            "tensors": tensors,
            "reference_tensors": len(reference),
            "base_partitions_changed": changed,
        }
        with open(args.out, "w") as out:
            json.dump(result, out)
    dist.barrier()


def launch(variant: str, tiny: bool, out: str, port: int) -> dict:
    """One 2-rank torchrun of this script's worker for `variant`; rank 0's result."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD)]
    command += ["--master_port", str(port), os.path.abspath(__file__), "--worker", variant, "--out", out]
    command += ["--tiny"] if tiny else []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # glibc serves a block below its mmap threshold from the heap, whose freed memory it keeps, and raises the threshold
    # as large blocks are freed: RSS would then keep the high-water mark of every layer's gather. A fixed threshold
    # maps every large tensor and unmaps it when freed, so the sampled RSS follows the memory in use.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    proc = subprocess.run(command, cwd=ROOT, env=env, stdout=sys.stderr, stderr=sys.stderr, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the {variant} ranks exited with {proc.returncode} (their output is on stderr)")
    with open(out) as result:
        return json.load(result)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2 layers, 4 experts, hidden 64: a smoke run")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    from dppo_dev.bench_env import emit_json, load_average, machine_info, versions

    load_before = load_average()
    report: dict = {
        "benchmark": "lora_sync",
        "model": {"kind": "qwen3_moe (bf16)", **SIZES["tiny" if args.tiny else "default"]},
        "world_size": WORLD,
        "versions": versions(),
    }
    failed = False
    with tempfile.TemporaryDirectory(prefix="dppo-lora-sync-") as tmp:
        for variant in args.variants:
            try:
                report[variant] = launch(variant, args.tiny, os.path.join(tmp, f"{variant}.json"), _free_port())
            except Exception as error:  # a failed variant is reported, and fails the run
                traceback.print_exc()
                report[variant] = {"error": f"{type(error).__name__}: {error}"}
                failed = True
    if all("peak_gathered_bytes" in report.get(v, {}) for v in VARIANTS):
        report["dppo_over_trl"] = {
            key: report["dppo"][key] / report["trl"][key] if report["trl"][key] else None
            for key in ("peak_gathered_bytes", "peak_rss_extra_bytes", "sync_s", "max_abs_error")
        }
    report["machine"] = machine_info(load_before)
    emit_json(report, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
