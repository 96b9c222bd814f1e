"""Launch checks for several processes: fail before the model is built when accelerate would silently run a
different parallelism than the one asked for.

All three cases below were measured on a CPU-only machine with accelerate 1.15 / transformers 5.19 / DeepSpeed 0.19:

- **DeepSpeed with `use_cpu=True`.** accelerate picks DeepSpeed only off its CPU path (`accelerate/state.py`,
  `elif ... ACCELERATE_USE_DEEPSPEED ... and not cpu`), so the run is plain DDP without ZeRO sharding.
- **Process group larger than accelerate's world.** Without a GPU, `TrainingArguments(deepspeed=...)` initialises
  DeepSpeed's gloo group (world N) but does not forward `ddp_backend` to accelerate, which then sees no backend and
  counts one process; DeepSpeed later rejects the batch size (`train_batch_size ... != ... * 1 * N`).
- **FSDP without a GPU.** accelerate sets the FSDP distributed type only inside its branch for GPU-class devices
  (`accelerate/state.py`, the `DistributedType.FSDP` assignment under the `MULTI_GPU`/`MULTI_XPU`/... case), so on
  CPU the FSDP plugin is ignored and the run is plain DDP.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

ZERO3_CPU_CONFIG = "examples/recipes/accelerate/zero3_cpu.yaml"


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def _process_group_size() -> int | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return None


def check_distributed_setup(
    args, environ: Mapping[str, str] | None = None, group_world_size: int | None = None
) -> None:
    """Raise a `ValueError` naming the fix when the launch would not run the requested parallelism.

    `args` is the training config (its devices already set up). `environ` and `group_world_size` default to the live
    process environment and the initialised `torch.distributed` group; tests pass them explicitly.
    """
    environ = os.environ if environ is None else environ
    group_world_size = _process_group_size() if group_world_size is None else group_world_size
    wants_deepspeed = bool(args.deepspeed) or _flag(environ, "ACCELERATE_USE_DEEPSPEED")
    wants_fsdp = bool(args.fsdp) or _flag(environ, "ACCELERATE_USE_FSDP")

    if wants_deepspeed and args.use_cpu:
        raise ValueError(
            "DeepSpeed was requested but `use_cpu=True`: accelerate never builds a DeepSpeed engine on its CPU path, "
            "so this run would be plain DDP without ZeRO sharding. Set `use_cpu=False` (on a machine without a GPU "
            f"also `ddp_backend='gloo'`, launching with `accelerate launch --config_file {ZERO3_CPU_CONFIG}`)."
        )
    if group_world_size is not None and group_world_size != args.world_size:
        hint = (
            " On a machine without a GPU, DeepSpeed needs `use_cpu=False` and `ddp_backend='gloo'`, and must come "
            f"from the launcher (`accelerate launch --config_file {ZERO3_CPU_CONFIG}`) rather than `--deepspeed`: "
            "transformers does not pass `ddp_backend` to accelerate when `deepspeed` is set."
            if wants_deepspeed
            else " Set `ddp_backend` to the backend of the launched group (`gloo` without a GPU)."
        )
        raise ValueError(
            f"The process group has {group_world_size} processes but accelerate set up {args.world_size}: batch "
            f"sizes and metric reductions would be wrong.{hint}"
        )
    if wants_fsdp and args.device.type == "cpu":
        raise ValueError(
            "FSDP was requested on CPU: accelerate only enables FSDP for GPU-class devices and would silently run "
            "plain DDP with full, unsharded parameters. Run FSDP on GPUs, or use DeepSpeed ZeRO-3 to exercise sharded "
            f"training on CPU (`accelerate launch --config_file {ZERO3_CPU_CONFIG}` with `use_cpu=False`, "
            "`ddp_backend='gloo'`)."
        )
