# Copyright 2026 The dppo-trl Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""
Log-probabilities of a few token ids per position, without materializing the `[N, V]` logits.

Top-K DPPO needs, for each completion token, the trainer policy's log-probabilities at the behavior policy's top-K
ids plus the sampled id. Only the sampled id's log-probability needs a gradient. Every function here takes the final
hidden states of the valid positions (`hidden [M, H]`), the LM head `weight [V, H]` and an optional `bias [V]`, and
applies the same logit transform as TRL's fused LM head (see [`LogitTransform`]). Outputs are float32 (float64 for
float64 inputs, for `gradcheck`); id slots set to a negative value (padding) give `-inf`.

- [`logps_at_ids_from_sampled`]: no-grad, `J + 1` dot products per row, from a log-probability already known for one
  id per row (design B: the log-partition cancels).
- [`logps_at_ids_with_grad`]: the same `J + 1` dot products per row, differentiable (hidden, weight, bias and the
  known log-prob), with a chunked backward: π at the engine's kept ids under truncated sampling, whose gradient the
  loss needs (`dppo_trl.core.functional.kept_log_mass`).
- [`chunked_topk_logps`]: no-grad top-k of the full distribution with an online logsumexp over vocabulary tiles.

The differentiable fused gather (design A) and the full-logits references, used only by the tests and
`benchmarks/topk_memory.py`, live in `dppo_dev/topk_reference.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.torch_version import TorchVersion

# `torch.mm(..., out_dtype=torch.float32)` from bf16/fp16 inputs exists on CUDA from torch 2.8 (not on CPU)
_MM_OUT_DTYPE = TorchVersion(torch.__version__) >= "2.8"
# Default budget of the float32 weight rows `logps_at_ids_from_sampled` gathers per token chunk
_GATHER_CHUNK_BYTES = 128 * 2**20


@dataclass(frozen=True)
class LogitTransform:
    """
    Transform applied to the raw LM-head output `s = h·Wᵀ + b`: `z = softcap(s * logit_scale) / temperature`, where
    `softcap(y) = softcap * tanh(y / softcap)` when `softcap` is not `None`. Same order as TRL's fused LM head.
    """

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")

    @classmethod
    def from_model_config(cls, config: Any, temperature: float = 1.0) -> LogitTransform:
        """
        Read `final_logit_softcapping` and the logit scale from `config.get_text_config()` the way TRL's
        `add_fused_lm_head` does, so log-probabilities here match the ones TRL's fused head returns.
        """
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        softcap = getattr(text_config, "final_logit_softcapping", None)
        # Same fallback chain as TRL: `logit_scale`, then `output_multiplier`, then `lm_head_multiplier`, then the
        # inverse of `logits_scaling` (which HyperCLOVA X multiplies by instead). None means unscaled; 0.0 is kept.
        logit_scale = getattr(text_config, "logit_scale", None)
        if logit_scale is None:
            logit_scale = getattr(text_config, "output_multiplier", None)
        if logit_scale is None:
            logit_scale = getattr(text_config, "lm_head_multiplier", None)
        if logit_scale is None and getattr(text_config, "logits_scaling", None) is not None:
            logits_scaling = text_config.logits_scaling
            model_type = getattr(text_config, "model_type", None)
            logit_scale = logits_scaling if model_type == "hyperclovax" else 1 / logits_scaling
        logit_scale = 1.0 if logit_scale is None else logit_scale
        return cls(
            temperature=float(temperature),
            logit_scale=float(logit_scale),
            softcap=None if softcap is None else float(softcap),
        )

    def __call__(self, s: torch.Tensor) -> torch.Tensor:
        """Apply the transform to raw logits `s` (not in place)."""
        z = s * self.logit_scale if self.logit_scale != 1.0 else s
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z / self.temperature if self.temperature != 1.0 else z

    def apply_(self, s: torch.Tensor, keep_tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Transform `s` in place (one extra tile only when `keep_tanh` and a softcap are set). Returns `z` and, when
        `keep_tanh`, the softcap's `tanh` that [`backward_`] needs (else None).
        """
        if self.logit_scale != 1.0:
            s.mul_(self.logit_scale)
        t = None
        if self.softcap is not None:
            s.div_(self.softcap).tanh_()
            if keep_tanh:
                t, s = s, s.mul(self.softcap)
            else:
                s.mul_(self.softcap)
        if self.temperature != 1.0:
            s.div_(self.temperature)
        return s, t

    def backward_(self, dz: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        """Turn `dL/dz` into `dL/ds` in place, consuming (overwriting) the `tanh` tile `t` from [`apply_`]."""
        scale = self.logit_scale / self.temperature
        if t is not None:
            # d/dy [c·tanh(y/c)] = 1 − tanh²(y/c)
            dz.mul_(t.mul_(t).neg_().add_(1))
        if scale != 1.0:
            dz.mul_(scale)
        return dz


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [M, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"expected bias [{weight.shape[0]}], got {tuple(bias.shape)}")


def _resolve_compute_dtype(
    hidden: torch.Tensor, weight: torch.Tensor, compute_dtype: torch.dtype | None
) -> torch.dtype:
    if compute_dtype is not None:
        return compute_dtype
    # Matching low-precision inputs stay as they are (exact); anything mixed runs in float32
    return hidden.dtype if hidden.dtype == weight.dtype else torch.float32


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # float64 stays float64 (gradcheck); everything else is computed in float32
    return torch.float64 if dtype == torch.float64 else torch.float32


def _low_precision_cuda(device: torch.device, compute_dtype: torch.dtype) -> bool:
    return _MM_OUT_DTYPE and device.type == "cuda" and compute_dtype in (torch.float16, torch.bfloat16)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b` from inputs rounded to `compute_dtype`, with float32 products and output."""
    if _low_precision_cuda(a.device, compute_dtype):
        return torch.mm(a.to(compute_dtype), b.to(compute_dtype), out_dtype=torch.float32)
    # Elsewhere there is no fp32-output low-precision GEMM: round the inputs, then multiply in float32
    acc = _acc_dtype(compute_dtype)
    return torch.mm(a.to(compute_dtype).to(acc), b.to(compute_dtype).to(acc))


def _raw_logits_tile(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    start: int,
    end: int,
    compute_dtype: torch.dtype,
) -> torch.Tensor:
    """Raw float32 logits `[n, end - start]` of one token chunk against one vocabulary tile."""
    s = _mm_fp32(h, weight[start:end].t(), compute_dtype)
    if bias is not None:
        s.add_(bias[start:end].to(s.dtype))
    return s


def _no_autocast(device: torch.device):
    # Autocast would round the float32 GEMMs here to bf16; the dtypes are chosen explicitly instead
    return torch.autocast(device.type, enabled=False) if torch.is_autocast_enabled(device.type) else nullcontext()


# What makes a sharded LM head whole for direct reads: called with the head's parameters (`weight`, then `bias` when
# there is one), it returns a context manager inside which they hold their full data, e.g. TRL's
# `trl.trainer.utils.maybe_gather_lm_head_ctx` under DeepSpeed ZeRO-3. The gathers enter it around every read of the
# head, their backward's included (which runs after the caller's own contexts have closed). FSDP2's DTensors need
# none: the caller passes `full_tensor()`s (`dppo_trl.kernels.engine_view.full`).
HeadGather = Callable[..., AbstractContextManager[Any]]


def _head_ctx(weight: torch.Tensor, bias: torch.Tensor | None, gather: HeadGather | None) -> AbstractContextManager:
    """`gather(weight[, bias])`, or a null context; without a `gather`, a DeepSpeed ZeRO-3 partition (a parameter with
    `ds_status` and no local data) is refused by name rather than failing inside an index."""
    params = [p for p in (weight, bias) if p is not None]
    if gather is not None:
        return gather(*params)
    if any(hasattr(p, "ds_status") and p.numel() == 0 for p in params):
        raise ValueError(
            "The LM head is a DeepSpeed ZeRO-3 partition with no local data: pass `gather=` a context that gathers "
            "it, e.g. TRL's `trl.trainer.utils.maybe_gather_lm_head_ctx`."
        )
    return nullcontext()


# ---------------------------------------------------------------------------------------------------------------------
# Design B: no-grad log-probabilities at ids from one known log-probability per row
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def logps_at_ids_from_sampled(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    sampled_ids: torch.Tensor,
    sampled_logps: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = LogitTransform(),
    chunk_size: int | None = None,
    gather: HeadGather | None = None,
) -> torch.Tensor:
    """
    Log-probabilities at `ids` from the log-probability of one known id per row (the sampled token), with no gradient.

    Since `log π(k) = z_k − logZ`, `log π(k) = z_k − z_y + log π(y)`: the log-partition cancels and only
    `J + 1` dot products per row are needed, in float32. `sampled_logps` is typically what TRL's fused LM head returned
    for the sampled token.

    Args:
        hidden (`torch.Tensor`): final hidden states `[M, H]` of the valid positions.
        weight (`torch.Tensor`): LM head weight `[V, H]` (may be a tied embedding matrix).
        ids (`torch.Tensor`): `[M, J]` token ids; negative ids are padding and give `-inf`.
        sampled_ids (`torch.Tensor`): `[M]` ids whose log-probabilities are known; a negative id makes its row `-inf`.
        sampled_logps (`torch.Tensor`): `[M]` log-probabilities of `sampled_ids` under the same model and transform.
        bias (`torch.Tensor`, *optional*): LM head bias `[V]`.
        transform ([`LogitTransform`]): logit transform (temperature, logit scale, softcap).
        chunk_size (`int`, *optional*): token rows per chunk. Each chunk gathers `chunk_size × (J + 1) × H` float32
            weights, never the whole `[M, J + 1, H]`. Defaults to the rows that fit in about 128 MiB (372 rows for
            J + 1 = 22 and H = 4096).
        gather (`HeadGather`, *optional*): makes a sharded head whole while it is read (DeepSpeed ZeRO-3: TRL's
            `maybe_gather_lm_head_ctx`); `None`: the head is used as given.

    Returns:
        `torch.Tensor`: `[M, J]` float32 log-probabilities.
    """
    with _no_autocast(hidden.device), _head_ctx(weight, bias, gather):
        _check_inputs(hidden, weight, bias)
        if ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
            raise ValueError(f"expected ids [{hidden.shape[0]}, J], got {tuple(ids.shape)}")
        M, J = ids.shape
        if sampled_ids.shape != (M,) or sampled_logps.shape != (M,):
            raise ValueError(f"expected sampled_ids and sampled_logps of shape [{M}]")
        acc = _acc_dtype(torch.promote_types(hidden.dtype, weight.dtype))
        if chunk_size is None:
            chunk_size = max(1, _GATHER_CHUNK_BYTES // ((J + 1) * hidden.shape[1] * 4))
        out = torch.empty((M, J), device=hidden.device, dtype=acc)
        for t0 in range(0, M, chunk_size):
            t1 = min(t0 + chunk_size, M)
            chunk_ids = torch.cat([sampled_ids[t0:t1, None], ids[t0:t1]], dim=1)  # [n, J + 1]
            pad = chunk_ids < 0
            safe_ids = chunk_ids.clamp(min=0)
            w = weight[safe_ids].to(acc)  # [n, J + 1, H]
            s = torch.bmm(w, hidden[t0:t1].to(acc).unsqueeze(-1)).squeeze(-1)
            if bias is not None:
                s.add_(bias.to(acc)[safe_ids])
            z = transform(s)
            logps = z[:, 1:] - z[:, :1] + sampled_logps[t0:t1, None].to(acc)
            out[t0:t1] = logps.masked_fill_(pad[:, 1:] | pad[:, :1], -math.inf)
    return out


class _LogpsAtIdsFromSampled(torch.autograd.Function):
    """`z_k − z_y + log π(y)` at `ids` with its gradient; forward and backward hold one token chunk of gathered rows."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, sampled_ids, sampled_logps, transform, chunk_size, gather):
        # The gather takes the parameters themselves (their detached views carry no ZeRO-3 state).
        with _head_ctx(weight, bias, gather):
            out = logps_at_ids_from_sampled(
                hidden.detach(),
                weight.detach(),
                ids,
                sampled_ids,
                sampled_logps.detach(),
                bias=None if bias is None else bias.detach(),
                transform=transform,
                chunk_size=chunk_size,
            )
        ctx.save_for_backward(hidden, weight, bias, ids, sampled_ids)
        ctx.transform, ctx.chunk_size, ctx.lp_dtype = transform, chunk_size, sampled_logps.dtype
        ctx.gather = gather
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, ids, sampled_ids = ctx.saved_tensors
        transform, chunk = ctx.transform, ctx.chunk_size
        acc = _acc_dtype(torch.promote_types(hidden.dtype, weight.dtype))
        need_h, need_w, need_b, _, _, need_lp = ctx.needs_input_grad[:6]
        M = ids.shape[0]
        # Under ZeRO-3 the head is partitioned outside the gather: its gradient is sized inside it (as TRL's head does).
        with _no_autocast(hidden.device), _head_ctx(weight, bias, ctx.gather):
            grad_h = torch.zeros(hidden.shape, device=hidden.device, dtype=acc) if need_h else None
            grad_w = torch.zeros(weight.shape, device=weight.device, dtype=acc) if need_w else None
            grad_b = torch.zeros(bias.shape, device=bias.device, dtype=acc) if need_b and bias is not None else None
            grad_lp = torch.zeros(sampled_ids.shape, device=hidden.device, dtype=acc) if need_lp else None
            for t0 in range(0, M, chunk):
                t1 = min(t0 + chunk, M)
                chunk_ids = torch.cat([sampled_ids[t0:t1, None], ids[t0:t1]], dim=1)  # [n, J + 1]
                pad = chunk_ids < 0
                dead = pad[:, :1] | pad[:, 1:]  # output slots that are -inf: no gradient
                g = torch.where(dead, torch.zeros((), dtype=acc, device=hidden.device), grad_out[t0:t1].to(acc))
                # d/dz_k = g_k for the listed ids, d/dz_y = −Σ g_k, d/d log π(y) = Σ g_k
                g_sum = g.sum(dim=1, keepdim=True)
                if grad_lp is not None:
                    grad_lp[t0:t1] = g_sum.squeeze(1)
                if grad_h is None and grad_w is None and grad_b is None:
                    continue
                dz = torch.cat([-g_sum, g], dim=1)
                safe_ids = chunk_ids.clamp(min=0)
                w = weight[safe_ids].to(acc)  # [n, J + 1, H]
                h = hidden[t0:t1].to(acc)
                tanh = None
                if transform.softcap is not None:
                    s = torch.bmm(w, h.unsqueeze(-1)).squeeze(-1)
                    if bias is not None:
                        s.add_(bias.to(acc)[safe_ids])
                    _, tanh = transform.apply_(s, keep_tanh=True)
                ds = transform.backward_(dz, tanh).masked_fill_(pad, 0.0)
                if grad_h is not None:
                    grad_h[t0:t1] = torch.bmm(ds.unsqueeze(1), w).squeeze(1)
                if grad_w is not None:
                    grad_w.index_add_(
                        0, safe_ids.reshape(-1), (ds.unsqueeze(-1) * h.unsqueeze(1)).reshape(-1, h.shape[1])
                    )
                if grad_b is not None:
                    grad_b.index_add_(0, safe_ids.reshape(-1), ds.reshape(-1))
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None if grad_lp is None else grad_lp.to(ctx.lp_dtype),
            None,
            None,
            None,
        )


def logps_at_ids_with_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    sampled_ids: torch.Tensor,
    sampled_logps: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = LogitTransform(),
    chunk_size: int | None = None,
    gather: HeadGather | None = None,
) -> torch.Tensor:
    """
    [`logps_at_ids_from_sampled`] with a gradient: `log π(k) = z_k − z_y + log π(y)` flows into `hidden`, `weight`,
    `bias` and `sampled_logps` (the fused head's log π(y), which carries the gradient of log Z).

    So `logsumexp` over a set of these log-probs has the exact gradient of `log Σ_k π(k)`, without the `[M, V]`
    logits: the backward recomputes each chunk's `J + 1` gathered rows (same `chunk_size` bound as the forward) and
    scatter-adds into one weight gradient. Used for π at the engine's kept ids under truncated sampling.

    Returns:
        `torch.Tensor`: `[M, J]` float32 log-probabilities (`-inf`, with zero gradient, at padding ids).
    """
    # The head's shapes are checked by the forward, inside `gather` (a ZeRO-3 partition has none outside it).
    if ids.dim() != 2 or hidden.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"expected hidden [M, H] and ids [M, J], got {tuple(hidden.shape)} and {tuple(ids.shape)}")
    if chunk_size is None:
        chunk_size = max(1, _GATHER_CHUNK_BYTES // ((ids.shape[1] + 1) * hidden.shape[1] * 4))
    return _LogpsAtIdsFromSampled.apply(
        hidden, weight, bias, ids, sampled_ids, sampled_logps, transform, chunk_size, gather
    )


# ---------------------------------------------------------------------------------------------------------------------
# Chunked top-k of the full distribution (behavior policy on the HF-generate path)
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def chunked_topk_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = LogitTransform(),
    token_chunk: int = 1024,
    vocab_tile: int = 32768,
    compute_dtype: torch.dtype | None = None,
    gather: HeadGather | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Top-`k` log-probabilities and ids per row, holding at most one `[token_chunk, vocab_tile]` block of logits.

    Each vocabulary tile updates an online logsumexp (running max and rescaled sum of exponentials) and a running
    top-`k` of the transformed logits; the log-partition is subtracted at the end.

    Args:
        compute_dtype (`torch.dtype`, *optional*): dtype the GEMM inputs are rounded to (products are float32).
            Defaults to the inputs' dtype when `hidden` and `weight` share it, float32 otherwise.
        gather (`HeadGather`, *optional*): makes a sharded head whole while it is read (see
            [`logps_at_ids_from_sampled`]).

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: `[M, k]` float32 log-probabilities sorted in descending order and the
        matching `[M, k]` int64 ids.
    """
    device = hidden.device
    with _no_autocast(device), _head_ctx(weight, bias, gather):
        _check_inputs(hidden, weight, bias)
        M, V = hidden.shape[0], weight.shape[0]
        if not 0 < k <= V:
            raise ValueError(f"k must be in [1, {V}], got {k}")
        compute_dtype = _resolve_compute_dtype(hidden, weight, compute_dtype)
        acc = _acc_dtype(compute_dtype)
        topk_logps = torch.empty((M, k), device=device, dtype=acc)
        topk_ids = torch.empty((M, k), device=device, dtype=torch.long)
        for t0 in range(0, M, token_chunk):
            t1 = min(t0 + token_chunk, M)
            n = t1 - t0
            h = hidden[t0:t1].to(compute_dtype)
            running_max = torch.full((n,), -math.inf, device=device, dtype=acc)
            sum_exp = torch.zeros((n,), device=device, dtype=acc)
            best_z = torch.full((n, 0), -math.inf, device=device, dtype=acc)
            best_ids = torch.zeros((n, 0), device=device, dtype=torch.long)
            for v0 in range(0, V, vocab_tile):
                v1 = min(v0 + vocab_tile, V)
                z, _ = transform.apply_(_raw_logits_tile(h, weight, bias, v0, v1, compute_dtype))
                tile_z, tile_idx = z.topk(min(k, v1 - v0), dim=1)
                # Merge the tile's top-k into the running top-k; the candidates are at most 2k wide
                cand_z = torch.cat([best_z, tile_z], dim=1)
                cand_ids = torch.cat([best_ids, tile_idx + v0], dim=1)
                best_z, sel = cand_z.topk(min(k, cand_z.shape[1]), dim=1)
                best_ids = cand_ids.gather(1, sel)
                new_max = torch.maximum(running_max, tile_z[:, 0])
                sum_exp.mul_(torch.exp(running_max - new_max)).add_(z.sub_(new_max[:, None]).exp_().sum(dim=1))
                running_max = new_max
                del z
            log_z = running_max + torch.log(sum_exp)
            topk_logps[t0:t1] = best_z - log_z[:, None]
            topk_ids[t0:t1] = best_ids
    return topk_logps, topk_ids
