"""Where this process runs: vLLM's CPU platform, and whether the CPU computes bf16 natively."""

from __future__ import annotations

import importlib.util

__all__ = ["cpu_has_native_bf16", "is_vllm_cpu_platform"]


def is_vllm_cpu_platform() -> bool:
    """True when vLLM is importable and its current platform is the CPU one; never raises."""
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # a broken or partial vLLM install must not break callers
        return False


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX tiles); False when torch cannot tell."""
    import torch

    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private probes: a torch without them (or a non-x86 build) gets the safe fp32
        return False
