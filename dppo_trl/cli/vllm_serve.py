"""`dppo-trl vllm-serve`: the vLLM server for server-mode and asynchronous training, with `trl vllm-serve`'s flags.

On a GPU this is TRL's `trl vllm-serve` (NCCL weight transfer, processed log-probs, `--max-logprobs -1`). On the CPU
build of vLLM, where TRL's server cannot start, the same flags start the project's CPU server
(`python -m dppo_trl.backends.cpu.vllm_server`: file weight sync, processed log-probs, eager, bound to 127.0.0.1
unless `--host` is given, fp32 unless `--dtype` is given). Options TRL's parser does not know go to the server
unchanged: on CPU the launcher's own (`--kv-cache-memory-bytes`, `--max-logprobs`, `--api-key`, `--dry-run`), then
vLLM's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from dppo_trl.cli.options import CLIError, explicit_arg_names

PROG = "dppo-trl vllm-serve"


def make_parser():
    from trl.scripts.vllm_serve import make_parser as trl_parser

    return trl_parser(prog=PROG)


def cpu_server_argv(script_args: Any, extra: Sequence[str], explicit: set[str]) -> list[str]:
    """`python -m dppo_trl.backends.cpu.vllm_server` arguments for TRL's `vllm-serve` settings."""
    explicit = {name.replace("-", "_") for name in explicit}
    if "gpu_memory_utilization" in explicit:
        raise CLIError(
            "--gpu_memory_utilization sizes a GPU's KV cache; the CPU server's is set in bytes: pass "
            "--kv-cache-memory-bytes N instead (default 64 MiB)."
        )
    argv = ["--model", script_args.model, "--port", str(script_args.port)]
    if "host" in explicit:  # TRL binds 0.0.0.0; the CPU server's development endpoints stay on 127.0.0.1 unless asked
        argv += ["--host", script_args.host]
    if "dtype" in explicit:  # TRL's "auto"; the CPU server's float32 keeps μ within ~1e-6 of an fp32 trainer
        argv += ["--dtype", script_args.dtype]
    if script_args.revision is not None:
        argv += ["--revision", script_args.revision]
    if script_args.max_model_len is not None:
        argv += ["--max-model-len", str(script_args.max_model_len)]
    if script_args.enable_prefix_caching is not None:
        argv += ["--enable-prefix-caching" if script_args.enable_prefix_caching else "--no-enable-prefix-caching"]
    if script_args.tensor_parallel_size != 1:
        argv += ["--tensor-parallel-size", str(script_args.tensor_parallel_size)]
    if script_args.data_parallel_size != 1:
        argv += ["--data-parallel-size", str(script_args.data_parallel_size)]
    if "kv_cache_dtype" in explicit:
        argv += ["--kv-cache-dtype", script_args.kv_cache_dtype]
    if "vllm_model_impl" in explicit:
        argv += ["--model-impl", script_args.vllm_model_impl]
    if script_args.trust_remote_code:
        argv += ["--trust-remote-code"]
    if script_args.distributed_executor_backend is not None:
        argv += ["--distributed-executor-backend", script_args.distributed_executor_backend]
    if script_args.speculative_config is not None:
        argv += ["--speculative-config", script_args.speculative_config]
    argv += ["--uvicorn-log-level", script_args.log_level]
    # --enforce_eager: the CPU server always runs eager.
    return argv + list(extra)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args, extra = make_parser().parse_args_and_config(argv, return_remaining_strings=True)
    from dppo_trl.backends.cpu.platform import is_vllm_cpu_platform

    if not is_vllm_cpu_platform():
        from trl.scripts.vllm_serve import main as trl_vllm_serve

        trl_vllm_serve(script_args, extra)  # exec: the process becomes vLLM's server
        return 0
    try:
        server_argv = cpu_server_argv(script_args, extra, explicit_arg_names(argv))
    except CLIError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    from dppo_trl.backends.cpu.vllm_server import main as cpu_server_main

    cpu_server_main(server_argv)  # exec, unless --dry-run
    return 0
