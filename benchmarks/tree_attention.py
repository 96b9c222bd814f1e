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
Time and peak extra memory of tree attention over one packed row, forward + backward, per implementation.

Implementations (`--variants`):

- `sdpa`: `dppo_trl.kernels.tree_attention.tree_attention_sdpa` (the default off FA3).
- `eager`: `dppo_trl.kernels.tree_attention.tree_attention_cpu`, float32 score matrices per segment (the CPU path
  before `sdpa`).
- `fa3`: TRL's FlashAttention-3 `tree_attention`, measured only where `fa3_unavailable` finds it loads and runs
  (CUDA, `kernels`, the Hub kernel); elsewhere reported as skipped with the reason.

Rows (`--rows`, comma-separated): `NxL` is N unrelated samples of L tokens packed into one row (the issue's H100 table);
`P+NxL` is a GRPO group, one P-token prompt shared by N completions of L tokens (segments with more keys than queries,
bottom-right aligned). Each implementation gets the same inputs; `max_abs_diff_vs_eager` is its largest output
difference from `eager`'s (float32 softmax) on the same inputs.

Memory: on CUDA the increase of `torch.cuda.max_memory_allocated` over the memory allocated before the step; on CPU the
increase of the process's peak RSS (`VmHWM`, reset through `/proc/self/clear_refs` before the step) over the RSS before
it, with glibc's mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_`, the script re-executes itself with it) so that large
tensors are returned to the system when freed instead of staying resident for the next step. Time: the fastest of
`--repeats` steps after one warm-up step (CUDA synchronized); on CPU with `--threads` torch threads (default
`OMP_NUM_THREADS`, else 1: on a loaded machine more threads mostly measure contention). Prints one JSON object to
stdout and exits 1 when an implementation failed (a skipped `fa3` is not a failure).

    .venv/bin/python benchmarks/tree_attention.py                 # CPU: float32, the CPU default rows
    python benchmarks/tree_attention.py --device cuda              # GPU: bfloat16, the issue's rows and 1x16384
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

from dppo_dev.bench_env import emit_json, load_average, machine_info, stdout_to_stderr, thread_settings, versions

VARIANTS = ("sdpa", "eager", "fa3")
CPU_ROWS = "8x128,4x512,2x1024,512+4x256,1x4096"
CUDA_ROWS = "8x512,4x2048,2x4096,1x16384,1024+4x2048"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip())
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if available")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="auto: bf16 on cuda")
    parser.add_argument("--rows", default=None, help=f"packed rows (CPU default {CPU_ROWS}; CUDA {CUDA_ROWS})")
    parser.add_argument("--heads", type=int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads (grouped-query attention)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per implementation and row (time = min)")
    parser.add_argument(
        "--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 1), help="torch threads on CPU"
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS)
    )
    parser.add_argument("--quick", action="store_true", help="smoke size: rows 2x32,8+2x16, 2 heads over 1, dim 16")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.heads, args.kv_heads, args.head_dim, args.repeats = "2x32,8+2x16", 2, 1, 16, 1
    for name in ("heads", "kv_heads", "head_dim", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants: {sorted(unknown)}")
    return args


def parse_row(spec: str) -> tuple[int, int, int]:
    """`NxL` -> (0, N, L); `P+NxL` -> (P, N, L)."""
    try:
        prompt, _, rest = spec.rpartition("+")
        count, length = rest.split("x")
        parsed = (int(prompt or 0), int(count), int(length))
    except ValueError:
        raise SystemExit(f"bad row {spec!r}: use NxL or P+NxL") from None
    if parsed[0] < 0 or parsed[1] < 1 or parsed[2] < 1:
        raise SystemExit(f"bad row {spec!r}: sizes must be positive")
    return parsed


def packed_tables(prompt: int, count: int, length: int, torch, device) -> dict:
    """TRL's packed tables (DFS layout, as `TreeRow.pack` lays them out) for one row: with a prompt, segment 0 is the
    prompt and segment i the i-th completion, whose path is the prompt then itself."""
    cu_q, cu_k, kv_index = [0], [0], []
    if prompt:
        kv_index += range(prompt)
        cu_q.append(prompt)
        cu_k.append(prompt)
    for i in range(count):
        start = prompt + i * length
        own = list(range(start, start + length))
        kv_index += (list(range(prompt)) if prompt else []) + own
        cu_q.append(start + length)
        cu_k.append(len(kv_index))
    return {
        "tree_kv_index": torch.tensor(kv_index, device=device),
        "tree_cu_seqlens_q": torch.tensor(cu_q, dtype=torch.int32, device=device),
        "tree_cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int32, device=device),
        "tree_max_seqlen_q": max(b - a for a, b in zip(cu_q[:-1], cu_q[1:])),
        "tree_max_seqlen_k": max(b - a for a, b in zip(cu_k[:-1], cu_k[1:])),
    }


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(function, inputs, tables, grad_out, torch, device, repeats: int) -> dict:
    """Peak extra memory and min time of forward + backward; the output of the last step."""

    def step():
        for t in inputs:
            t.grad = None
        out, _ = function(None, *inputs, None, **tables)
        out.backward(grad_out)
        return out.detach()

    step()  # warm-up: kernels, thread pools, first allocations
    times, peaks = [], []
    for _ in range(repeats):
        for t in inputs:
            t.grad = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            can_reset = _reset_peak_rss()
            base = _status_kib("VmRSS") * 1024
        start = time.perf_counter()
        out = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated() - base)
        else:
            peaks.append(_status_kib("VmHWM") * 1024 - base if can_reset else None)
        del out
    out = step()
    known = [p for p in peaks if p is not None]
    return {
        "time_s": round(min(times), 4),
        "times_s": [round(t, 4) for t in times],
        "peak_extra_mib": round(max(known) / 2**20, 1) if known else None,
    }, out


def run(args) -> dict:
    import torch
    from trl.experimental.async_grpo import packing

    from dppo_trl.backends.tree_attention import fa3_unavailable
    from dppo_trl.kernels.tree_attention import tree_attention_cpu, tree_attention_sdpa

    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32}.get(args.dtype) or getattr(
        torch, args.dtype
    )
    rows = args.rows or (CUDA_ROWS if device.type == "cuda" else CPU_ROWS)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    variants = [v for v in args.variants.split(",") if v]
    functions = {"sdpa": tree_attention_sdpa, "eager": tree_attention_cpu, "fa3": packing.tree_attention}
    fa3_reason = fa3_unavailable(device) if "fa3" in variants else None
    if fa3_reason is None and dtype == torch.float32:
        fa3_reason = "FlashAttention-3 takes bf16/fp16 inputs (TRL casts them from the model, which this row has not)"

    results, failed = {}, []
    for spec in rows.split(","):
        prompt, count, length = parse_row(spec)
        n_tokens = prompt + count * length
        tables = packed_tables(prompt, count, length, torch, device)
        generator = torch.Generator().manual_seed(0)
        shapes = ((args.heads, n_tokens), (args.kv_heads, n_tokens), (args.kv_heads, n_tokens))
        inputs = [
            torch.randn(1, h, n, args.head_dim, generator=generator).to(device, dtype).requires_grad_()
            for h, n in shapes
        ]
        grad_out = torch.randn(1, n_tokens, args.heads, args.head_dim, generator=generator).to(device, dtype)
        row, outputs = {"tokens": n_tokens}, {}
        for variant in variants:
            if variant == "fa3" and fa3_reason is not None:
                row[variant] = {"skipped": fa3_reason}
                continue
            try:
                row[variant], outputs[variant] = measure(
                    functions[variant], inputs, tables, grad_out, torch, device, args.repeats
                )
            except Exception as error:  # reported, and the run exits 1
                row[variant] = {"error": f"{type(error).__name__}: {error}"}
                failed.append(f"{spec}/{variant}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if "eager" in outputs:
            for variant, out in outputs.items():
                row[variant]["max_abs_diff_vs_eager"] = float((out.float() - outputs["eager"].float()).abs().max())
        results[spec] = row
        del inputs, grad_out, outputs

    ratios = {}
    for spec, row in results.items():
        ours = row.get("sdpa", {})
        for other in ("eager", "fa3"):
            theirs = row.get(other, {})
            if "time_s" in ours and "time_s" in theirs:
                ratios.setdefault(spec, {})[f"{other}_over_sdpa_time"] = _ratio(theirs["time_s"], ours["time_s"])
                ratios[spec][f"{other}_over_sdpa_memory"] = _ratio(theirs["peak_extra_mib"], ours["peak_extra_mib"])
    return {
        "config": {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "dtype": str(dtype).removeprefix("torch."),
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "repeats": args.repeats,
            "rows": rows.split(","),
            "pass": "forward + backward",
            "peak_method": "cuda max_memory_allocated"
            if device.type == "cuda"
            else f"VmHWM reset (peak RSS), MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}",
        },
        "results": results,
        "ratios": ratios,
        "fa3": fa3_reason or "ran",
        "failed": failed,
        "versions": versions(),
        "threads": thread_settings(),
    }


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else round(a / b, 3)


# Allocations from 64 KiB up are mmapped and unmapped on free (glibc otherwise raises the threshold after the first
# free, and freed tensors stay resident, so a step reusing them shows no peak).
MMAP_THRESHOLD = str(64 * 1024)


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD and sys.platform.startswith("linux"):
        # glibc reads the variable at start-up only: run again with it (same arguments, same stdout).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])], env)
    load_before = load_average()
    with stdout_to_stderr():
        report = run(args)
    report["machine"] = machine_info(load_before)
    emit_json(report, indent=1)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
