"""Which dtype the vLLM engine samples in when TRL's colocate mode runs on the CPU build of vLLM.

`dppo_trl.backends.cpu.vllm_cpu.patch_trl_vllm_for_cpu` builds the engine in float32 by default, so μ equals the fp32 trainer's π
to ~1e-6. The recipe's CPU demo instead samples in bfloat16 like a GPU run does (bf16 engine, fp32 trainer): the
training–inference mismatch DPPO's μ anchor exists for is then real, as it is at scale. `vllm_cpu_dtype`:

- `auto`: bfloat16 where the CPU computes it natively (x86 AVX512-BF16 or AMX), float32 otherwise;
- `bfloat16` / `float32`: that dtype, whatever the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

VLLM_CPU_DTYPES = ("auto", "bfloat16", "float32")

__all__ = ["VLLM_CPU_DTYPES", "cpu_has_native_bf16", "resolve_vllm_cpu_dtype", "vllm_cpu_engine_dtype"]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX tiles); False when torch cannot tell."""
    import torch

    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private probes: a torch without them (or a non-x86 build) gets the safe fp32
        return False


def resolve_vllm_cpu_dtype(choice: str) -> tuple[str, str]:
    """`(dtype, reason)` for a `vllm_cpu_dtype` choice; raises on an unknown one."""
    if choice not in VLLM_CPU_DTYPES:
        raise ValueError(f"vllm_cpu_dtype={choice!r} is not supported; choose one of {list(VLLM_CPU_DTYPES)}.")
    if choice != "auto":
        return choice, "as requested"
    if cpu_has_native_bf16():
        return "bfloat16", "auto: the CPU has native bf16 (AVX512-BF16/AMX)"
    return "float32", "auto: fp32 fallback, this CPU has no native bf16 (AVX512-BF16/AMX)"


@contextmanager
def vllm_cpu_engine_dtype(training_args, choice: str | None) -> Iterator[str | None]:
    """Within the block, a colocated CPU engine is built in the dtype `choice` resolves to (yielded; None if the
    setting does not apply).

    Applies only to `use_vllm` + `vllm_mode="colocate"` on vLLM's CPU platform (GPU engines keep TRL's behaviour);
    `choice=None` keeps the library's float32. Build the trainer inside the block: its construction then finds the
    engine defaults set here and keeps them. On exit the process is as before the block: the previous process-wide
    patch when there was one, none otherwise (a trainer built inside keeps the reload-based weight sync bound to its
    own engine), so later trainers in the same process, DPPO's or TRL's, are unaffected.
    """
    if choice is None or not (training_args.use_vllm and training_args.vllm_mode == "colocate"):
        yield None
        return
    from dppo_trl.backends.cpu.vllm_cpu import (
        PATCH_STATE,
        is_vllm_cpu_platform,
        patch_trl_vllm_for_cpu,
        unpatch_trl_vllm_for_cpu,
    )

    if not is_vllm_cpu_platform():
        yield None
        return
    dtype, reason = resolve_vllm_cpu_dtype(choice)
    previous = (dict(PATCH_STATE.llm_defaults), PATCH_STATE.forced) if PATCH_STATE.applied else None
    unpatch_trl_vllm_for_cpu()
    patch_trl_vllm_for_cpu(dtype=dtype)

    from accelerate import PartialState

    if PartialState().is_main_process:
        trainer_dtype = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "fp32"
        print(f"vLLM CPU engine dtype: {dtype} ({reason}); trainer: {trainer_dtype}", flush=True)
    try:
        yield dtype
    finally:
        unpatch_trl_vllm_for_cpu()
        if previous is not None:
            defaults, forced = previous
            # `None` leaves an argument to vLLM, exactly as an absent key did.
            patch_trl_vllm_for_cpu(
                kv_cache_memory_bytes=defaults.get("kv_cache_memory_bytes"),
                dtype=defaults.get("dtype"),
                enforce_eager=defaults.get("enforce_eager"),
                force=forced,
            )
