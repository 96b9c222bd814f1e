"""The colocated vLLM engine on vLLM's CPU platform: its settings, and the factory TRL's colocate mode builds it with.

TRL's `VLLMGeneration` calls `vllm.LLM(...)` without `dtype`, `kv_cache_memory_bytes` or `enforce_eager`, and no
TRL argument carries them (docs/upstream.md, "CPU runtime"). On CPU each matters: `dtype="auto"` turns fp32
checkpoints into bf16 on x86 CPUs, so trainer and engine log-probs drift apart by ~1e-3 (the library default is
float32); vLLM sizes the KV cache against the machine's whole RAM unless told a size; and eager mode makes start-up
much faster. `EngineOptions` holds those settings, `EngineOptions.from_config` reads them from a `DPPOConfig`
(`vllm_cpu_dtype`, `vllm_cpu_engine_kwargs`), and `cpu_llm_factory` wraps `vllm.LLM` so that the engine TRL builds
gets them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dppo_trl.backends.cpu.platform import cpu_has_native_bf16, is_vllm_cpu_platform
from dppo_trl.backends.cpu.vllm_server import DEFAULT_KV_CACHE_BYTES

__all__ = ["DEFAULT_KV_CACHE_BYTES", "ENGINE_DTYPES", "EngineOptions", "cpu_llm_factory", "resolve_engine_dtype"]

ENGINE_DTYPES = ("float32", "bfloat16", "auto")


def resolve_engine_dtype(choice: str, native_bf16: bool | None = None) -> tuple[str, str]:
    """`(dtype, reason)` for a `vllm_cpu_dtype` choice; raises on an unknown one.

    `auto` is bfloat16 where the CPU computes it natively (x86 AVX512-BF16 or AMX; `native_bf16`, probed when None),
    float32 otherwise; `bfloat16` / `float32` are that dtype, whatever the CPU.
    """
    if choice not in ENGINE_DTYPES:
        raise ValueError(f"vllm_cpu_dtype={choice!r} is not supported; choose one of {list(ENGINE_DTYPES)}.")
    if choice != "auto":
        return choice, "as requested"
    if cpu_has_native_bf16() if native_bf16 is None else native_bf16:
        return "bfloat16", "auto: the CPU has native bf16 (AVX512-BF16/AMX)"
    return "float32", "auto: fp32 fallback, this CPU has no native bf16 (AVX512-BF16/AMX)"


@dataclass(frozen=True)
class EngineOptions:
    """`vllm.LLM` arguments for a colocated engine on vLLM's CPU platform.

    `dtype` is a resolved dtype (`resolve_engine_dtype`); `extra` holds further `vllm.LLM` arguments (e.g.
    `{"kv_cache_dtype": "fp8"}`), which override everything else, TRL's own arguments included.
    """

    dtype: str = "float32"
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    enforce_eager: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: Any) -> EngineOptions:
        """The options a trainer config asks for (`vllm_cpu_dtype`, `vllm_cpu_engine_kwargs`; absent: defaults)."""
        dtype, _ = resolve_engine_dtype(getattr(config, "vllm_cpu_dtype", None) or "float32")
        extra = getattr(config, "vllm_cpu_engine_kwargs", None) or {}
        if isinstance(extra, str):  # from a command line or a YAML string
            extra = json.loads(extra)
        if not isinstance(extra, dict):
            raise ValueError(f"vllm_cpu_engine_kwargs must be a dict of vllm.LLM arguments, got {extra!r}.")
        return cls(dtype=dtype, extra=dict(extra))

    def defaults(self) -> dict[str, Any]:
        """The arguments set where TRL passes none."""
        return {
            "dtype": self.dtype,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "enforce_eager": self.enforce_eager,
        }


def cpu_llm_factory(original_llm: Callable[..., Any], options: EngineOptions) -> Callable[..., Any]:
    """`original_llm` (TRL's `LLM`) with `options` applied; rejects sleep mode, which the CPU backend cannot do."""

    def cpu_llm(*args: Any, **kwargs: Any) -> Any:
        """`vllm.LLM` with CPU-friendly defaults for the arguments TRL does not pass."""
        if kwargs.get("enable_sleep_mode") and is_vllm_cpu_platform():
            raise ValueError(
                "vLLM's CPU backend does not support sleep mode; set `vllm_enable_sleep_mode=False` in the config."
            )
        for key, value in options.defaults().items():
            kwargs.setdefault(key, value)
        kwargs.update(options.extra)
        return original_llm(*args, **kwargs)

    cpu_llm.__wrapped__ = original_llm  # type: ignore[attr-defined]
    return cpu_llm
