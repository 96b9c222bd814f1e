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
Tree attention over TRL's packed rows without TRL's FlashAttention-3 kernel, and its float32 reference.

TRL 1.16's `AsyncGRPOTrainer` packs each rank's samples into a prefix trie (`trl.experimental.async_grpo.packing.
TreeRow`) and builds the model with `attn_implementation="tree_fa3"`: a FlashAttention-3 varlen kernel fetched from
the Hugging Face Hub at run time. The contract of that attention: segment `s` owns the queries `cu_q[s]:cu_q[s+1]` of
the packed row and attends to the K/V rows `tree_kv_index[cu_k[s]:cu_k[s+1]]` (its root-to-segment path, its own rows
last), causally and bottom-right aligned (query `i` of the segment sees path row `p` iff `p <= i + L_k - L_q`), with
grouped-query heads, an optional sliding window (`p > i + L_k - L_q - w`) and an optional logit softcap.

- [`tree_attention_sdpa`]: that contract with `torch.nn.functional.scaled_dot_product_attention`, one call per segment
  on its gathered path, so no `[L_q, L_k]` score matrix is ever materialized (flash / memory-efficient backends on
  CUDA, the fused CPU kernel on CPU). Softcap, which SDPA cannot apply, goes through a query-chunked softmax
  recomputed in backward, whose memory is bounded by a chunk rather than by `L_q * L_k`. q, k and v are brought to
  one dtype first ([`attention_dtype`]), as TRL's FA3 function does: under autocast a layer hands attention q and k
  in float32 (Qwen3's float32 q/k norm and RoPE) and v in bf16 (the autocast `v_proj`).
- [`tree_attention_cpu`]: the same contract in float32 with one score matrix per segment (O(L²) memory): the reference
  `tree_attention_sdpa` is checked against (`AsyncDPPOConfig.tree_attention="eager"` runs it).

Torch only: registering a function under TRL's name and choosing between these and TRL's FlashAttention-3 kernel is
`dppo_trl.backends.tree_attention`'s.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["LOWER_RIGHT_CHOICES", "attention_dtype", "tree_attention_cpu", "tree_attention_sdpa"]

# How `tree_attention_sdpa` aligns a segment below a fork (fewer queries than path rows) bottom-right: "bias" is SDPA's
# lower-right causal bias (`torch.nn.attention.bias.causal_lower_right`: the flash / memory-efficient kernels on CUDA,
# no mask built; CPU torch materializes it), "mask" an explicit boolean mask per query chunk. `None` picks "bias" on
# CUDA and "mask" elsewhere; the CPU tests force each, so neither is reached only on a GPU.
LOWER_RIGHT_CHOICES = ("bias", "mask")

# Query rows per SDPA call where an explicit mask is needed (sliding window; `lower_right="mask"`): the
# boolean mask is at most `_MASK_QUERY_CHUNK x (L_k)` instead of `L_q x L_k`.
_MASK_QUERY_CHUNK = 2048
# Softcap: score elements (heads x query rows x keys) per chunk of the explicit softmax, 2**25 = 128 MiB in float32.
_SOFTCAP_CHUNK_ELEMENTS = 1 << 25


def tree_attention_sdpa(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q=None,
    tree_max_seqlen_k=None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    lower_right: str | None = None,
    mask_query_chunk: int = _MASK_QUERY_CHUNK,
    softcap_chunk_elements: int = _SOFTCAP_CHUNK_ELEMENTS,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Tree attention over a packed row (TRL's `tree_fa3` contract, see the module docstring) with one SDPA call per
    segment, in one dtype for q, k and v ([`attention_dtype`]: the autocast dtype under autocast, as TRL's FA3
    function, else the widest of the three), which is also the output's.

    `query` is `(1, heads, N, head_dim)`, `key`/`value` `(1, kv_heads, N, head_dim)` with `heads % kv_heads == 0`.
    Returns `((1, N, heads, head_dim), None)` like transformers' attention functions. The paths' K/V rows are gathered
    once, as TRL's FA3 call gathers them; grouped-query K/V are then repeated per segment (SDPA's own GQA support
    depends on the backend), so the K/V kept for backward are `heads / kv_heads` times those of a GQA-aware kernel.
    `lower_right` ("bias" or "mask", `None`: "bias" on CUDA, else "mask"; see `LOWER_RIGHT_CHOICES`) is how segments
    below a fork are aligned. `mask_query_chunk` (query rows per masked SDPA call) and `softcap_chunk_elements` (score
    elements per softcap chunk) bound the transient memory of those two paths.
    """
    if query.dim() != 4 or query.shape[0] != 1 or key.shape[0] != 1 or value.shape[0] != 1:
        raise ValueError(
            f"Tree attention takes one packed row, `(1, heads, N, head_dim)`; got query {tuple(query.shape)}, key "
            f"{tuple(key.shape)}."
        )
    _, heads, n_tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly.")
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    if len(cu_q) != len(cu_k) or cu_q[0] != 0 or cu_k[0] != 0 or cu_q[-1] != n_tokens:
        raise ValueError(
            f"tree_cu_seqlens_q must run from 0 to the row's {n_tokens} tokens and tree_cu_seqlens_k must start at 0 "
            f"with one entry per segment boundary as well; got {len(cu_q)} and {len(cu_k)} boundaries, "
            f"cu_q[-1] = {cu_q[-1]}."
        )
    if tree_kv_index.numel() != cu_k[-1]:
        raise ValueError(f"tree_kv_index has {tree_kv_index.numel()} rows but tree_cu_seqlens_k ends at {cu_k[-1]}.")
    if mask_query_chunk < 1 or softcap_chunk_elements < 1:
        raise ValueError("mask_query_chunk and softcap_chunk_elements must be >= 1.")
    if lower_right is None:
        lower_right = "bias" if query.device.type == "cuda" else "mask"
    if lower_right not in LOWER_RIGHT_CHOICES:
        raise ValueError(f"lower_right must be one of {LOWER_RIGHT_CHOICES} or None, got {lower_right!r}.")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    window = sliding_window or None
    # SDPA's lower-right bias dispatches past autocast and refuses mixed dtypes; the other calls would each cast.
    dtype = attention_dtype(query, key, value)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    # One gather for every path (as TRL's FA3 call does), so the backward is one scatter rather than one per segment.
    kv_index = tree_kv_index.long()
    key_paths, value_paths = key.index_select(2, kv_index), value.index_select(2, kv_index)
    outputs = []
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        if q1 - q0 > k1 - k0:
            raise ValueError(f"Segment {s} has {q1 - q0} queries but a path of only {k1 - k0} K/V rows.")
        if q1 == q0:
            continue
        q, k, v = query[:, :, q0:q1], key_paths[:, :, k0:k1], value_paths[:, :, k0:k1]
        if kv_heads != heads:
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        if softcap:
            outputs.append(_softcapped_segment(q, k, v, scale, window, softcap, dropout, softcap_chunk_elements))
        else:
            outputs.append(_sdpa_segment(q, k, v, scale, window, dropout, mask_query_chunk, lower_right))
    out = torch.cat(outputs, dim=2) if outputs else query.new_zeros(query.shape)
    return out.transpose(1, 2), None


def attention_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype:
    """The one dtype tree attention computes q, k and v in: under autocast on the query's device, a float32 query goes
    to the autocast dtype (TRL's FA3 function, through transformers' `get_target_dtype`); otherwise the widest of the
    three (SDPA runs float32, so unlike FA3 nothing has to be narrowed: mixed inputs are never rounded down)."""
    device_type = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)


def _sdpa_segment(
    q, k, v, scale: float, window: int | None, dropout: float, chunk: int, lower_right: str = "mask"
) -> torch.Tensor:
    """One segment: `(1, H, L_q, D)` queries over its `(1, H, L_k, D)` path, bottom-right causal."""
    len_q, len_k = q.shape[2], k.shape[2]
    windowed = window is not None and window < len_k
    if not windowed and len_q == len_k:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
    if not windowed and lower_right == "bias":
        # SDPA's `is_causal` is top-left aligned; its lower-right bias runs the flash or memory-efficient kernel with
        # bottom-right alignment and never builds the mask on CUDA (CPU torch materializes it).
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(len_q, len_k)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=scale)
    # An explicit boolean mask, a chunk of query rows at a time, over only the keys that chunk can see.
    chunks = []
    for r0 in range(0, len_q, chunk):
        r1 = min(r0 + chunk, len_q)
        lo, hi, allowed = _chunk_keys(r0, r1, len_q, len_k, window, q.device)
        chunks.append(
            F.scaled_dot_product_attention(
                q[:, :, r0:r1], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=allowed, dropout_p=dropout, scale=scale
            )
        )
    return torch.cat(chunks, dim=2)


def _chunk_keys(r0: int, r1: int, len_q: int, len_k: int, window: int | None, device) -> tuple[int, int, torch.Tensor]:
    """Path rows `[lo, hi)` that query rows `[r0, r1)` can see, and the `(r1 - r0, hi - lo)` boolean mask over them."""
    offset = len_k - len_q  # query row r is path row r + offset
    hi = r1 + offset
    lo = max(0, r0 + offset - window + 1) if window is not None else 0
    rows = torch.arange(r0 + offset, r1 + offset, device=device).unsqueeze(1)
    cols = torch.arange(lo, hi, device=device).unsqueeze(0)
    allowed = cols <= rows
    if window is not None:
        allowed = allowed & (cols > rows - window)
    return lo, hi, allowed


def _softcapped_segment(
    q, k, v, scale: float, window: int | None, softcap: float, dropout: float, chunk_elements: int
) -> torch.Tensor:
    """SDPA has no softcap: an explicit softmax of `softcap * tanh(scores / softcap)` in float32 at least (autocast
    off), a chunk of query rows at a time, each recomputed in backward (`torch.utils.checkpoint`), so at most one
    chunk's scores live."""
    heads, len_q, len_k = q.shape[1], q.shape[2], k.shape[2]
    rows_per_chunk = max(1, min(len_q, chunk_elements // max(1, heads * len_k)))
    chunks = []
    for r0 in range(0, len_q, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, len_q)
        lo, hi, allowed = _chunk_keys(r0, r1, len_q, len_k, window, q.device)
        args = (q[:, :, r0:r1], k[:, :, lo:hi], v[:, :, lo:hi], allowed)
        if torch.is_grad_enabled() and any(t.requires_grad for t in args[:3]):
            chunks.append(checkpoint(_softcapped_chunk, *args, scale, softcap, dropout, use_reentrant=False))
        else:
            chunks.append(_softcapped_chunk(*args, scale, softcap, dropout))
    return torch.cat(chunks, dim=2)


def _softcapped_chunk(q, k, v, allowed, scale: float, softcap: float, dropout: float) -> torch.Tensor:
    dtype = torch.promote_types(q.dtype, torch.float32)  # float32 at least (bf16 scores lose the softmax's tail)
    # Under autocast the matmuls would run in the autocast dtype whatever their inputs are.
    with torch.autocast(q.device.type, enabled=False):
        scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
        if dropout:
            probs = F.dropout(probs, p=dropout, training=True)
        return torch.matmul(probs, v.to(dtype)).to(q.dtype)


def tree_attention_cpu(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q=None,
    tree_max_seqlen_k=None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The float32 reference: variable-length causal attention over a packed tree row, in plain PyTorch (any device).

    `query`/`key`/`value` are `(1, heads, N, head_dim)` (key/value may have fewer heads: grouped-query attention).
    Segment s owns queries `cu_q[s]:cu_q[s+1]` and attends to the K/V rows `tree_kv_index[cu_k[s]:cu_k[s+1]]`, the
    last `L_q` of which are its own tokens: query i sees key j iff `j ≤ i + L_k − L_q` (and, with a sliding window w,
    `j > i + L_k − L_q − w`). Softmax in float32. Returns `((1, N, heads, head_dim), None)` like transformers'
    attention functions. `dropout` is accepted and ignored: the trainer's forward is not a dropout forward.
    """
    _, heads, n_tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    q_all = query[0].transpose(0, 1)  # (N, H, D)
    k_all = key[0].transpose(0, 1).index_select(0, tree_kv_index.long())
    v_all = value[0].transpose(0, 1).index_select(0, tree_kv_index.long())
    cu_q = tree_cu_seqlens_q.tolist()
    cu_k = tree_cu_seqlens_k.tolist()
    out = query.new_zeros(n_tokens, heads, head_dim)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        len_q, len_k = q1 - q0, k1 - k0
        if len_q == 0:
            continue
        q = q_all[q0:q1].transpose(0, 1).float()  # (H, Lq, D)
        k = k_all[k0:k1].transpose(0, 1).float()  # (Hkv, Lk, D)
        v = v_all[k0:k1].transpose(0, 1).float()
        if kv_heads != heads:
            k = k.repeat_interleave(heads // kv_heads, dim=0)
            v = v.repeat_interleave(heads // kv_heads, dim=0)
        scores = (q @ k.transpose(-1, -2)) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        rows = torch.arange(len_q, device=q.device).unsqueeze(1) + (len_k - len_q)
        cols = torch.arange(len_k, device=q.device).unsqueeze(0)
        allowed = cols <= rows
        if sliding_window:
            allowed = allowed & (cols > rows - sliding_window)
        scores = scores.masked_fill(~allowed, -math.inf)
        out[q0:q1] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(out.dtype)
    return out.unsqueeze(0), None
