"""Literal references the tests compare the library against (not used by training)."""

from __future__ import annotations

import torch
from torch import Tensor

from dppo_trl.core.functional import compute_dtype, ratio_coefficient


def dppo_per_token_loss(
    pi_logps: Tensor,
    mu_logps: Tensor,
    advantages: Tensor,
    keep_mask: Tensor,
    ratio_cap: float,
) -> Tensor:
    """Eq. 11 written out as a loss: -A_t · sg(min(π/μ, C)) · M_t · log π(y_t).

    `pi_logps` carries the gradient, so ∇ loss_t = -A_t · min(π/μ, C) · M_t · ∇ log π(y_t). Tokens whose weight
    A · coef · M is exactly 0 contribute exactly 0 (also when log π = -inf). Returns float32 (float64 for float64
    inputs), shape broadcast of the inputs; aggregation over tokens is the caller's choice.
    """
    dtype = compute_dtype(pi_logps, mu_logps)
    pi_lp = pi_logps.to(dtype)
    coef = ratio_coefficient(pi_lp.detach(), mu_logps, ratio_cap)
    weight = (advantages.to(dtype) * coef * keep_mask.to(dtype)).detach()
    loss = -weight * pi_lp
    return torch.where(weight == 0, torch.zeros((), dtype=dtype, device=loss.device), loss)


def tree_attention_per_query(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    sequences: list[list[int]],
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Tree attention written out one query at a time, from the samples rather than from the packed tables.

    `sequences` are the samples as packed-row positions (each sample's tokens in order, shared prefixes at shared
    positions). A position attends to its own sample's positions up to itself (the last `sliding_window` of them when
    set), with `softmax(softcap * tanh(q·k * scale / softcap))` in the inputs' dtype (use float64). Query heads share
    key/value heads in contiguous groups (`h // (heads / kv_heads)`). `query` `(1, H, N, D)`, `key`/`value`
    `(1, H_kv, N, D)`; returns `(1, N, H, D)`.
    """
    _, heads, n_tokens, head_dim = query.shape
    group = heads // key.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    rows: list[Tensor | None] = [None] * n_tokens
    for positions in sequences:
        for t, i in enumerate(positions):
            visible = positions[: t + 1]
            if sliding_window:
                visible = visible[-sliding_window:]
            per_head = []
            for h in range(heads):
                k = key[0, h // group, visible]
                v = value[0, h // group, visible]
                scores = (k @ query[0, h, i]) * scale
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                per_head.append(torch.softmax(scores, dim=0) @ v)
            rows[i] = torch.stack(per_head)  # a shared position sees the same keys from every sample holding it
    missing = [i for i, r in enumerate(rows) if r is None]
    assert not missing, f"packed positions {missing} belong to no sample"
    return torch.stack([r for r in rows if r is not None]).unsqueeze(0)
