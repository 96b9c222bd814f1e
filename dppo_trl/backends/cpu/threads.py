"""torch's thread count for a CPU trainer that shares its cores with a colocated vLLM engine."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch

__all__ = ["cpu_colocate_threads", "trainer_cpu_threads"]


def cpu_colocate_threads(local_world_size: int) -> int | None:
    """torch threads for a CPU trainer sharing its cores with a colocated vLLM engine; None leaves them alone.

    A launcher or user that set `OMP_NUM_THREADS` decides. Otherwise one thread per local process: measured on 2
    cores, torch's default (one thread per core) with the colocated engine runs several times slower per step than
    1 thread, which is what `accelerate launch` sets (docs/faults.md, "Thread counts").
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return 1 if local_world_size >= 1 else None


@contextlib.contextmanager
def trainer_cpu_threads(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` torch intra-op threads, then restore the previous count (None: no change).

    The change is announced with a `UserWarning`, which Python's default warning filter shows once per process.
    """
    previous = torch.get_num_threads()
    if threads is None or threads == previous:
        yield
        return
    warnings.warn(
        f"CPU trainer with a colocated vLLM engine and no OMP_NUM_THREADS: training with {threads} torch thread(s) "
        f"instead of {previous} (the engine shares these cores; more threads oversubscribe them). Set "
        "OMP_NUM_THREADS to choose.",
        UserWarning,
        stacklevel=3,
    )
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
