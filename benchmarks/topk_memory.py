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
Peak extra memory and time of forward + backward for top-K DPPO log-probabilities, one fresh subprocess per variant.

Variants (all take hidden `[N, H]`, lm_head `[V, H]`, ids `[N, 1 + K]` = sampled id then K behavior top-K ids; only
the sampled id's log-probability gets a gradient, the K others feed a detached mask, as in DPPO):

- `naive`: full logits, `log_softmax`, gather K + 1, backward through column 0.
- `topk_anchor` (design B): TRL's single-target `ChunkedLogProbFunction` for the sampled id (with grad), plus
  `logps_at_ids_from_sampled` for the K others (no grad).
- `topk_fused` (design A): `fused_linear_logps_at_ids` on all K + 1 ids, gradient through column 0.
- `binary_trl`: binary DPPO, TRL's `ChunkedLogProbFunction` for the sampled id only.
- `binary_fused`: binary DPPO with `fused_linear_logps_at_ids` on the sampled id only (J = 1, same tiling as A).
- `kept_set`: binary DPPO under truncated sampling (top-k / top-p / min-p): `binary_trl` for the sampled id, plus
  `logps_at_ids_with_grad` at the K + 1 listed ids (the engine's kept-set list, row r keeping its first
  `1 + r mod (K + 1)`) and the gradient through log π_kept = log π(y) − logsumexp over the kept ids, as the trainer
  computes it. Compared with `binary_trl`, the untruncated binary loss.

Memory is the increase of the process's peak RSS (Linux `VmHWM`, reset through `/proc/self/clear_refs` right before
the measured step) over the RSS just before it, so it counts every transient of the step plus the gradients it
produces. With `--device cuda` it is the increase of `torch.cuda.max_memory_allocated` (peak stats reset right before
the step) over the allocated memory just before it, and times are taken after `torch.cuda.synchronize()`.
Prints one JSON object to stdout (library notices go to stderr) and exits 1 when a variant failed.

    .venv/bin/python benchmarks/topk_memory.py [--n-tokens 2048 --hidden 512 --vocab 151936 --k 20]
    .venv/bin/python benchmarks/topk_memory.py --variants binary_trl,kept_set   # truncated sampling's cost
    python benchmarks/topk_memory.py --device cuda --dtype bfloat16   # GPU (scripts/gpu_check.sh)
"""

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import threading
import time

from dppo_dev.bench_env import emit_json, load_average, stdout_to_stderr

VARIANTS = ("naive", "topk_anchor", "topk_fused", "binary_trl", "binary_fused", "kept_set")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-tokens", type=int, default=2048, help="completion tokens N")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size H")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size V (Qwen3: 151936)")
    parser.add_argument("--k", type=int, default=20, help="behavior top-K (ids per row: K + 1)")
    parser.add_argument("--token-chunk", type=int, default=1024, help="token chunk of design A")
    parser.add_argument(
        "--anchor-chunk", type=int, default=0, help="token chunk of the design-B gather (0: its ~128 MiB default)"
    )
    parser.add_argument("--vocab-tile", type=int, default=32768, help="vocabulary tile (TRL's default: 32768)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--frozen-weight", action="store_true", help="lm_head without gradient (LoRA)")
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats per variant (time = min)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the step runs")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="hidden states and lm_head weight"
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS)
    )
    parser.add_argument(
        "--paired",
        type=int,
        default=0,
        help="also time topk_fused and binary_fused alternately in one process, this many times each (0: off)",
    )
    parser.add_argument("--worker", choices=(*VARIANTS, "paired"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("n_tokens", "hidden", "vocab", "k", "token_chunk", "vocab_tile", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.anchor_chunk < 0 or args.threads < 0 or args.paired < 0:
        parser.error("--anchor-chunk, --threads and --paired must be >= 0")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# Worker: one variant, in its own process
# ---------------------------------------------------------------------------------------------------------------------


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss():
    """Reset `VmHWM` to the current RSS (Linux ≥ 4.0); return False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _RssSampler(threading.Thread):
    """Fallback peak-RSS sampler for systems where `VmHWM` cannot be reset."""

    def __init__(self, interval=0.002):
        super().__init__(daemon=True)
        self.interval, self.peak_kib, self._stop = interval, 0, threading.Event()

    def run(self):
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, _status_kib("VmRSS"))
            time.sleep(self.interval)

    def stop(self):
        self._stop.set()
        self.join()
        self.peak_kib = max(self.peak_kib, _status_kib("VmRSS"))
        return self.peak_kib


def _make_step(variant, args, torch, timings):
    # Import only what the variant runs, so the naive and fused workers do not pay for TRL's import
    from dppo_dev.topk_reference import fused_linear_logps_at_ids, naive_logps_at_ids
    from dppo_trl.core.functional import kept_log_mass
    from dppo_trl.kernels.topk_logps import LogitTransform, logps_at_ids_from_sampled, logps_at_ids_with_grad

    if variant in ("topk_anchor", "binary_trl", "kept_set"):
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    transform = LogitTransform(temperature=args.temperature)

    def dppo_loss(logp_sampled, logp_others, advantages):
        # Stand-in for the DPPO loss: the K others only build a detached mask
        mask = torch.isfinite(logp_others).all(dim=1).float() if logp_others is not None else 1.0
        return -(logp_sampled * advantages * mask).sum()

    def trl_sampled(hidden, weight, ids):
        return ChunkedLogProbFunction.apply(
            hidden, weight, None, ids[:, 0], transform.temperature, args.vocab_tile, None, 1.0, ()
        )[0]

    def step(hidden, weight, ids, advantages):
        if variant == "naive":
            logps = naive_logps_at_ids(hidden, weight, ids, transform=transform)
            loss = dppo_loss(logps[:, 0], logps[:, 1:].detach(), advantages)
        elif variant == "topk_anchor":
            logp = trl_sampled(hidden, weight, ids)
            gather_start = time.perf_counter()
            others = logps_at_ids_from_sampled(
                hidden.detach(),
                weight.detach(),
                ids[:, 1:],
                ids[:, 0],
                logp.detach(),
                transform=transform,
                chunk_size=args.anchor_chunk or None,
            )
            timings["anchor_gather_s"] = time.perf_counter() - gather_start
            loss = dppo_loss(logp, others, advantages)
        elif variant == "topk_fused":
            logps = fused_linear_logps_at_ids(
                hidden, weight, ids, transform=transform, token_chunk=args.token_chunk, vocab_tile=args.vocab_tile
            )
            loss = dppo_loss(logps[:, 0], logps[:, 1:].detach(), advantages)
        elif variant == "binary_trl":
            loss = dppo_loss(trl_sampled(hidden, weight, ids), None, advantages)
        elif variant == "kept_set":
            logp = trl_sampled(hidden, weight, ids)
            listed = logps_at_ids_with_grad(
                hidden, weight, ids, ids[:, 0], logp, transform=transform, chunk_size=args.anchor_chunk or None
            )
            slots = torch.arange(ids.shape[1], device=ids.device)
            rows = torch.arange(ids.shape[0], device=ids.device)
            kept = slots.unsqueeze(0) <= (rows % ids.shape[1]).unsqueeze(1)
            loss = dppo_loss(logp - kept_log_mass(listed, kept), None, advantages)
        elif variant == "binary_fused":
            logps = fused_linear_logps_at_ids(
                hidden,
                weight,
                ids[:, :1],
                transform=transform,
                token_chunk=args.token_chunk,
                vocab_tile=args.vocab_tile,
            )
            loss = dppo_loss(logps[:, 0], None, advantages)
        loss.backward()
        return float(loss.detach())

    return step


def _make_inputs(args, torch):
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    N, H, V, K = args.n_tokens, args.hidden, args.vocab, args.k
    dtype = getattr(torch, args.dtype)
    # Drawn on the CPU so both devices see the same numbers
    hidden = torch.randn(N, H).to(args.device, dtype).requires_grad_()
    weight = (torch.randn(V, H) / H**0.5).to(args.device, dtype).requires_grad_(not args.frozen_weight)
    # Sampled id then K behavior ids; the sampled id is inside the top-K for about half the rows
    ids = torch.randint(0, V, (N, 1 + K))
    inside = torch.rand(N) < 0.5
    ids[inside, 0] = ids[inside, 1]
    advantages = torch.randn(N)
    return hidden, weight, ids.to(args.device), advantages.to(args.device)


class _CudaPeak:
    """Peak extra CUDA memory of one step: allocator peak over the memory allocated when it starts."""

    def __init__(self, torch):
        self.torch = torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()

    def stop(self):
        self.torch.cuda.synchronize()
        return (self.torch.cuda.max_memory_allocated() - self.base) // 1024


def run_paired(args):
    """Alternate top-K and binary fused steps in one process, so both see the same background load."""
    import statistics

    import torch

    hidden, weight, ids, advantages = _make_inputs(args, torch)
    steps = {name: _make_step(name, args, torch, {}) for name in ("topk_fused", "binary_fused")}
    cpu = {name: [] for name in steps}
    wall = {name: [] for name in steps}
    for i in range(args.paired + 1):
        # Alternate which one goes first; round 0 is a full-size warm-up and is not recorded
        for name in steps if i % 2 else reversed(steps):
            hidden.grad = weight.grad = None
            start, cpu_start = time.perf_counter(), time.process_time()
            steps[name](hidden, weight, ids, advantages)
            if args.device == "cuda":
                torch.cuda.synchronize()
            if i:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - cpu_start)
    ratios = [a / b for a, b in zip(cpu["topk_fused"], cpu["binary_fused"])]
    return {
        "variant": "paired",
        "cpu_s": {name: [round(t, 3) for t in ts] for name, ts in cpu.items()},
        "wall_s": {name: [round(t, 3) for t in ts] for name, ts in wall.items()},
        "median_cpu_time_topk_fused_over_binary_fused": round(statistics.median(ratios), 4),
    }


def run_worker(args):
    import torch

    if args.worker == "paired":
        return run_paired(args)
    hidden, weight, ids, advantages = _make_inputs(args, torch)
    timings = {}
    step = _make_step(args.worker, args, torch, timings)

    # Warm-up on a few rows: imports, thread pools, first-call allocations
    small = slice(0, min(args.n_tokens, 64))
    step(hidden[small].detach().requires_grad_(), weight, ids[small], advantages[small])

    times, cpu_times, gathers, peaks = [], [], [], []
    for _ in range(args.repeats):
        hidden.grad = weight.grad = None
        gc.collect()
        sampler = cuda_peak = None
        if args.device == "cuda":
            base_kib, cuda_peak = 0, _CudaPeak(torch)
        else:
            base_kib = _status_kib("VmRSS")
            if not _reset_peak_rss():
                sampler = _RssSampler()
                sampler.start()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = step(hidden, weight, ids, advantages)  # float(loss) waits for the device
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        if "anchor_gather_s" in timings:
            gathers.append(timings["anchor_gather_s"])
        if cuda_peak is not None:
            peak_kib = cuda_peak.stop()
        else:
            peak_kib = sampler.stop() if sampler is not None else _status_kib("VmHWM")
        peaks.append((peak_kib - base_kib) / 1024)
    result = {
        "variant": args.worker,
        "peak_extra_mib": round(max(peaks), 1),
        "time_s": round(min(times), 3),
        "cpu_s": round(min(cpu_times), 3),
        "times_s": [round(t, 3) for t in times],
        "loss": loss,
        "peak_method": "cuda max_memory_allocated"
        if args.device == "cuda"
        else ("VmHWM reset" if sampler is None else "RSS sampler (2 ms)"),
    }
    if gathers:
        result["anchor_gather_s"] = round(min(gathers), 3)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def _overhead(a, b):
    ratio = _ratio(a, b)
    return None if ratio is None else round(ratio - 1, 3)


def _run_worker(cmd, variant):
    """One worker's JSON, or an `error` entry with the end of its stderr (also echoed to ours)."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        try:
            return json.loads(proc.stdout)
        except json.JSONDecodeError:
            pass
    sys.stderr.write(proc.stderr)
    tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
    return {"variant": variant, "error": tail[0], "returncode": proc.returncode}


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        with stdout_to_stderr():
            result = run_worker(args)
        print(json.dumps(result))
        return 0
    with stdout_to_stderr():
        report = _measure(args, argv)
    emit_json(report, indent=1)
    return 1 if report["failed"] else 0


def _measure(args, argv):
    """Run every asked-for variant in its own process and put their results and ratios together."""
    load_before = load_average()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants: {sorted(unknown)}")
    passthrough = list(argv if argv is not None else sys.argv[1:])
    results = {}
    for variant in variants:
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--worker", variant]
        results[variant] = _run_worker(cmd, variant)
    paired = None
    if args.paired:
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--worker", "paired"]
        paired = _run_worker(cmd, "paired")

    def mem(v):
        return results.get(v, {}).get("peak_extra_mib")

    def tim(v):
        return results.get(v, {}).get("time_s")

    def cpu(v):
        return results.get(v, {}).get("cpu_s")

    ratios = {}
    gather = results.get("topk_anchor", {}).get("anchor_gather_s")
    if gather is not None and tim("binary_trl") is not None:
        # Design B is binary_trl plus this no-grad gather; timed in-process, so free of cross-process noise. A time
        # that rounds to 0.0 leaves the ratio undefined (null), as `_ratio` does.
        ratios["anchor_gather_over_binary_trl_time"] = (
            round(gather / tim("binary_trl"), 4) if tim("binary_trl") else None
        )
    ran = set(variants)
    for ours in ("topk_anchor", "topk_fused", "kept_set"):
        if ours not in ran:
            continue
        # Only the comparisons whose variants were asked for: a null here means one of them failed.
        pairs = {
            "naive_over_ours_memory": ("naive", _ratio(mem("naive"), mem(ours))),
            "memory_overhead_vs_binary_trl": ("binary_trl", _overhead(mem(ours), mem("binary_trl"))),
            "memory_overhead_vs_binary_fused": ("binary_fused", _overhead(mem(ours), mem("binary_fused"))),
            "time_over_binary_trl": ("binary_trl", _ratio(tim(ours), tim("binary_trl"))),
            "time_over_binary_fused": ("binary_fused", _ratio(tim(ours), tim("binary_fused"))),
            "cpu_time_over_binary_trl": ("binary_trl", _ratio(cpu(ours), cpu("binary_trl"))),
            "cpu_time_over_binary_fused": ("binary_fused", _ratio(cpu(ours), cpu("binary_fused"))),
            "naive_over_ours_time": ("naive", _ratio(tim("naive"), tim(ours))),
        }
        ratios[ours] = {key: value for key, (other, value) in pairs.items() if other in ran}
    import torch

    N, H, V = args.n_tokens, args.hidden, args.vocab
    failed = sorted(name for name, r in {**results, "paired": paired or {}}.items() if "error" in r)
    return {
        "benchmark": "topk_memory",
        "failed": failed,
        "config": {
            "n_tokens": N,
            "hidden": H,
            "vocab": V,
            "k": args.k,
            "token_chunk": args.token_chunk,
            "anchor_chunk": args.anchor_chunk or "default",
            "vocab_tile": args.vocab_tile,
            "trl_token_chunk": 4096,
            "temperature": args.temperature,
            "frozen_weight": args.frozen_weight,
            "dtype": args.dtype,
            "device": args.device,
            "repeats": args.repeats,
            "threads": args.threads or torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"
            + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""),
            "load_average_before": load_before,
            "load_average_after": load_average(),
        },
        "reference_sizes_mib": {
            "one_NxV_fp32": round(N * V * 4 / 2**20, 1),
            "grad_weight_VxH": round(V * H * (2 if args.dtype == "bfloat16" else 4) / 2**20, 1),
            "one_tile_fp32": round(min(N, args.token_chunk) * min(V, args.vocab_tile) * 4 / 2**20, 1),
        },
        "results": results,
        "ratios": ratios,
        "paired_timing": paired,
    }


if __name__ == "__main__":
    sys.exit(main())
