# Copyright 2026 The dppo-trl authors. Licensed under the Apache License, Version 2.0.
"""Research-only knob: a controlled train–inference mismatch for the sanity benchmark (docs/results.md).

**Not a training feature.** It deliberately makes the inference engine sample from *different* weights than the
trainer holds, so that μ (the engine's log-probs, captured as usual) differs from π by a controlled amount. It lives
with the benchmark, not in `DPPOConfig`, and is off unless a sweep asks for it.

The weights TRL syncs into vLLM are perturbed on their way there; the trainer keeps its fp32 weights untouched:

- `int8`: per-output-channel symmetric int8 fake quantization, `q(w) = round(w / s) * s` with `s = max|w_c| / 127`;
- `e4m3`: fp8 (e4m3, `torch.float8_e4m3fn`) round trip with a per-output-channel scale `s = max|w_c| / 448`;
- `noise=σ`: adds a Gaussian perturbation of standard deviation `σ × rms(w_c)` per output channel. The noise pattern is
  drawn once per tensor from a fixed seed and reused at every sync, so it behaves like a fixed kernel difference,
  not like fresh sampling noise;
- combinations (`int8+noise=0.02`): quantize, then add noise.

Engine-side settings (`EngineMismatch`) leave the weights alone and change how the engine computes instead, the way a
real inference stack errs: `kv=fp8` / `kv=fp8_e4m3` / `kv=fp8_e5m2` stores vLLM's KV cache in fp8 (the CPU attention
backend's own `kv_cache_dtype`, with its default unit scales), `dtype=float16` / `dtype=float32` runs the engine in
another precision than the benchmark's bf16. A `--mismatch` level may combine both kinds (`kv=fp8+noise=0.1`);
`parse_level` splits it.

Only matrices (ndim ≥ 2: linear layers, embeddings and the LM head) are perturbed, as weight-only quantization does;
norm weights and biases pass through unchanged. The hook wraps the instance's `VLLMGeneration._iter_named_params`,
the iterator every sync path consumes (TRL's own and `dppo_trl.backends.cpu.weight_sync`'s colocate reload), so nothing of TRL's sync
code is copied and PEFT merging still happens before the perturbation. TRL starts `_last_loaded_step` at -1, so the
first generation syncs (and perturbs) before it samples: the engine never samples from the unperturbed checkpoint.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "ENGINE_DTYPES",
    "KV_CACHE_DTYPES",
    "QUANTIZERS",
    "EngineMismatch",
    "WeightMismatch",
    "engine_config_fields",
    "fake_quant_e4m3",
    "fake_quant_int8",
    "install_weight_mismatch",
    "parse_level",
    "relative_noise",
]

QUANTIZERS = ("none", "int8", "e4m3")
KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")  # what vLLM's CPU attention backend accepts besides "auto"
ENGINE_DTYPES = ("float16", "bfloat16", "float32")
INT8_MAX = 127.0
E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def _channel_absmax(w: torch.Tensor) -> torch.Tensor:
    """max |w| per output channel (dim 0), broadcastable against `w`; a zero channel gets 1 (any scale is exact)."""
    amax = w.abs().flatten(1).amax(dim=1)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    return amax.view(-1, *([1] * (w.ndim - 1)))


def fake_quant_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 quantize-dequantize; returns `(q(w), scale)`, both fp32."""
    w = w.float()
    scale = _channel_absmax(w) / INT8_MAX
    return torch.clamp(torch.round(w / scale), -INT8_MAX, INT8_MAX) * scale, scale


def fake_quant_e4m3(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel scaled fp8 e4m3 round trip (round to nearest even); returns `(q(w), scale)`, both fp32."""
    if not hasattr(torch, "float8_e4m3fn"):
        raise RuntimeError("mismatch 'e4m3' needs torch.float8_e4m3fn (torch >= 2.1); use 'int8' or 'noise=...'.")
    w = w.float()
    scale = _channel_absmax(w) / E4M3_MAX
    return (w / scale).to(torch.float8_e4m3fn).float() * scale, scale


def relative_noise(w: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    """Gaussian noise of std `std × rms(w_c)` per output channel, from a generator seeded by `seed` (fp32)."""
    w = w.float()
    rms = w.pow(2).flatten(1).mean(dim=1).sqrt().view(-1, *([1] * (w.ndim - 1)))
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(w.shape, generator=generator, dtype=torch.float32) * rms * std


_SPEC = re.compile(r"^(?:(none|int8|e4m3))?(?:\+?noise=([0-9.eE+-]+))?$")


@dataclass(frozen=True)
class WeightMismatch:
    """What the engine's weights get: `quant` (one of QUANTIZERS) then relative Gaussian noise of std `noise`."""

    quant: str = "none"
    noise: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.quant not in QUANTIZERS:
            raise ValueError(f"mismatch quant={self.quant!r} is not one of {QUANTIZERS}.")
        if not (self.noise >= 0 and self.noise < float("inf")):
            raise ValueError(f"mismatch noise={self.noise!r} must be a finite std >= 0 (e.g. 'noise=0.02').")

    @classmethod
    def parse(cls, spec: str | None, seed: int = 0) -> WeightMismatch:
        """`none`, `int8`, `e4m3`, `noise=0.05` or `int8+noise=0.05` (the benchmark's `--mismatch` syntax)."""
        match = _SPEC.match((spec or "none").strip())
        if not match or not (spec or "none").strip():
            raise ValueError(
                f"--mismatch {spec!r} not understood; use 'none', 'int8', 'e4m3', 'noise=<std>' or 'int8+noise=<std>'."
            )
        return cls(quant=match.group(1) or "none", noise=float(match.group(2) or 0.0), seed=seed)

    @property
    def off(self) -> bool:
        return self.quant == "none" and self.noise == 0.0

    @property
    def label(self) -> str:
        parts = [self.quant] if self.quant != "none" or self.noise == 0 else []
        if self.noise:
            parts.append(f"noise={self.noise:g}")
        return "+".join(parts)

    def tensor_seed(self, name: str) -> int:
        # Stable across processes and Python runs (unlike hash()): the same tensor gets the same noise pattern.
        return (self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63

    def perturb(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The engine's copy of one named weight; a new tensor in the input's dtype (the input is not modified)."""
        if self.off or tensor.ndim < 2:
            return tensor
        out = tensor.detach().float()
        if self.quant == "int8":
            out, _ = fake_quant_int8(out)
        elif self.quant == "e4m3":
            out, _ = fake_quant_e4m3(out)
        if self.noise:
            # Scaled by the unquantized weights' rms, so `noise` means the same thing with or without a quantizer.
            out = out + relative_noise(tensor, self.noise, self.tensor_seed(name)).to(out.device)
        return out.to(tensor.dtype)


def install_weight_mismatch(trainer, mismatch: WeightMismatch) -> WeightMismatch:
    """Perturb every weight sync of `trainer`'s vLLM engine by `mismatch`; the trainer's own weights stay exact.

    Re-installing replaces the previous mismatch (the original iterator is kept). `mismatch.off` restores TRL's.
    """
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or not hasattr(generation, "_iter_named_params"):
        raise ValueError("install_weight_mismatch needs a trainer with use_vllm=True (TRL's VLLMGeneration).")
    original = generation.__dict__.get("_dppo_original_iter_named_params", generation._iter_named_params)
    generation._dppo_original_iter_named_params = original
    generation.weight_mismatch = mismatch
    if mismatch.off:
        generation._iter_named_params = original  # bit-identical: TRL's iterator, untouched
        return mismatch

    def perturbed_named_params() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in original():
            yield name, mismatch.perturb(name, tensor)

    generation._iter_named_params = perturbed_named_params
    return mismatch


@dataclass(frozen=True)
class EngineMismatch:
    """Engine-side settings that change how vLLM computes μ, not the weights it holds (None: the benchmark's own)."""

    kv_cache_dtype: str | None = None
    dtype: str | None = None

    def __post_init__(self):
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"mismatch kv={self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}.")
        if self.dtype is not None and self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"mismatch dtype={self.dtype!r} is not one of {ENGINE_DTYPES}.")

    @property
    def off(self) -> bool:
        return self.kv_cache_dtype is None and self.dtype is None

    def llm_kwargs(self) -> dict:
        """The `vllm.LLM` arguments this setting overrides."""
        kwargs = {"kv_cache_dtype": self.kv_cache_dtype, "dtype": self.dtype}
        return {k: v for k, v in kwargs.items() if v is not None}


def parse_level(spec: str | None, seed: int = 0) -> tuple[WeightMismatch, EngineMismatch]:
    """Split a `--mismatch` level into its weight part and its engine part (`kv=...`, `dtype=...`)."""
    engine, weight_parts = {}, []
    for part in (spec or "none").strip().split("+"):
        key, _, value = part.partition("=")
        if key in ("kv", "dtype"):
            field = "kv_cache_dtype" if key == "kv" else "dtype"
            if not value or field in engine:
                raise ValueError(f"--mismatch {spec!r}: {key}= needs one value (e.g. 'kv=fp8', 'dtype=float16').")
            engine[field] = value
        else:
            weight_parts.append(part)
    if engine and not weight_parts:
        weight_parts = ["none"]
    return WeightMismatch.parse("+".join(weight_parts), seed=seed), EngineMismatch(**engine)


def engine_config_fields(engine: EngineMismatch) -> dict:
    """The `DPPOConfig` fields that give the trainer's engine `engine`'s settings (`vllm_cpu_engine_kwargs`, which
    override the engine's other arguments); empty when the setting is off."""
    return {} if engine.off else {"vllm_cpu_engine_kwargs": engine.llm_kwargs()}
