"""Top-K log-prob gathers that training does not use: design A and the full-logits references.

- [`fused_linear_logps_at_ids`]: differentiable, chunked linear + log-softmax gather (design A). The trainer uses design
  B ([`dppo_trl.kernels.topk_logps.logps_at_ids_from_sampled`]) instead, chosen by measurement (docs/topk_memory.md); design A
  stays as the benchmark's comparison point.
- [`naive_logps_at_ids`], [`naive_topk_logps`]: full `[M, V]` logits references for the tests and the benchmark.
"""

from __future__ import annotations

import math

import torch

from dppo_trl.kernels.topk_logps import (
    LogitTransform,
    _acc_dtype,
    _check_inputs,
    _head_ctx,
    _low_precision_cuda,
    _no_autocast,
    _raw_logits_tile,
    _resolve_compute_dtype,
)

# Loop order of the fused backward: None picks the one with the smaller float32 accumulator; "token" or "vocab" forces
# one (tests)
_BACKWARD_ORDER: str | None = None


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, compute_dtype: torch.dtype) -> None:
    """
    `acc += a @ b` into a float32 accumulator, where `a` is a float32 logits-gradient tile and `b` an input.

    On CUDA with low-precision inputs the tile is rounded to `compute_dtype` to run a tensor-core GEMM with a float32
    output, like TRL's fused head; elsewhere the tile stays float32.
    """
    if _low_precision_cuda(acc.device, compute_dtype):
        torch.addmm(acc, a.to(compute_dtype), b.to(compute_dtype), out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(compute_dtype).to(acc.dtype))


# ---------------------------------------------------------------------------------------------------------------------
# Design A: fused, chunked linear + log-softmax gather, with gradient
# ---------------------------------------------------------------------------------------------------------------------


class _FusedLinearLogpsAtIds(torch.autograd.Function):
    """
    `log_softmax(transform(hidden @ weightᵀ + bias))` gathered at `ids`, one `[token_chunk, vocab_tile]` block at a
    time. The forward folds each tile into an online logsumexp and picks the ids' logits from the same tile; the
    backward recomputes each tile and accumulates the gradient GEMMs in float32.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        ids: torch.Tensor,
        transform: LogitTransform,
        token_chunk: int,
        vocab_tile: int,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        device = hidden.device
        M, J = ids.shape
        V = weight.shape[0]
        acc = _acc_dtype(compute_dtype)
        log_z = torch.empty((M,), device=device, dtype=acc)
        picked = torch.zeros((M, J), device=device, dtype=acc)
        with _no_autocast(device), _head_ctx(weight, bias, None):
            for t0 in range(0, M, token_chunk):
                t1 = min(t0 + token_chunk, M)
                n = t1 - t0
                h = hidden[t0:t1].to(compute_dtype)
                chunk_ids = ids[t0:t1]
                chunk_picked = picked[t0:t1]
                running_max = torch.full((n,), -math.inf, device=device, dtype=acc)
                sum_exp = torch.zeros((n,), device=device, dtype=acc)
                for v0 in range(0, V, vocab_tile):
                    v1 = min(v0 + vocab_tile, V)
                    z, _ = transform.apply_(_raw_logits_tile(h, weight, bias, v0, v1, compute_dtype))
                    # The ids' logits come from the same tile as logZ, so the two stay consistent
                    local = chunk_ids - v0
                    in_tile = (local >= 0) & (local < v1 - v0)
                    chunk_picked.copy_(torch.where(in_tile, z.gather(1, local.clamp(0, v1 - v0 - 1)), chunk_picked))
                    new_max = torch.maximum(running_max, z.amax(dim=1))
                    sum_exp.mul_(torch.exp(running_max - new_max)).add_(z.sub_(new_max[:, None]).exp_().sum(dim=1))
                    running_max = new_max
                    # Free this tile before the next GEMM allocates one: a single block of logits alive at a time
                    del z
                log_z[t0:t1] = running_max + torch.log(sum_exp)
        out = (picked - log_z[:, None]).masked_fill_(ids < 0, -math.inf)
        ctx.save_for_backward(hidden, weight, bias, ids, log_z)
        ctx.transform = transform
        ctx.token_chunk = token_chunk
        ctx.vocab_tile = vocab_tile
        ctx.compute_dtype = compute_dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor | None):  # type: ignore[override]
        if grad_out is None:
            return (None,) * 8
        hidden, weight, bias, ids, log_z = ctx.saved_tensors
        transform: LogitTransform = ctx.transform
        compute_dtype = ctx.compute_dtype
        token_chunk, vocab_tile = ctx.token_chunk, ctx.vocab_tile
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        device = hidden.device
        M, H = hidden.shape
        V = weight.shape[0]
        acc = log_z.dtype
        # Padding outputs are a constant -inf: drop whatever flows into them (possibly nan from inf arithmetic)
        g = grad_out.to(acc).masked_fill(ids < 0, 0.0)
        safe_ids = ids.clamp(min=0)
        # One host sync for all chunks: under DPPO many rows may carry no gradient (masked tokens)
        row_has_grad = (g != 0).any(dim=1).tolist()
        chunks = [(t0, min(t0 + token_chunk, M)) for t0 in range(0, M, token_chunk)]
        chunks = [(t0, t1) for t0, t1 in chunks if any(row_has_grad[t0:t1])]
        tiles = [(v0, min(v0 + vocab_tile, V)) for v0 in range(0, V, vocab_tile)]

        grad_hidden = torch.zeros(hidden.shape, device=device, dtype=hidden.dtype) if need_h else None
        grad_weight = torch.zeros(weight.shape, device=device, dtype=weight.dtype) if need_w else None
        grad_bias = torch.zeros((V,), device=device, dtype=acc) if need_b else None
        # Gradients of float32 tensors accumulate in place. Low-precision ones need float32 accumulators; a gradient
        # is complete after its inner loop, so the inner loop's gradient needs only a chunk- or tile-sized one.
        # Pick the loop order whose full-size accumulator is smaller (lm_head [V, H] vs hidden [M, H]).
        h_acc = need_h and hidden.dtype != acc
        w_acc = need_w and weight.dtype != acc
        token_outer_size = (V * H if w_acc else 0) + (min(token_chunk, M) * H if h_acc else 0)
        vocab_outer_size = (min(vocab_tile, V) * H if w_acc else 0) + (M * H if h_acc else 0)
        vocab_outer = _BACKWARD_ORDER == "vocab" or (_BACKWARD_ORDER is None and vocab_outer_size < token_outer_size)

        def tile_grad(t0: int, t1: int, v0: int, v1: int, h: torch.Tensor) -> torch.Tensor:
            """Recompute one tile and return `dL/ds` (gradient w.r.t. the raw logits), float32."""
            g_chunk = g[t0:t1]
            z, t = transform.apply_(_raw_logits_tile(h, weight, bias, v0, v1, compute_dtype), keep_tanh=True)
            # dz = −(Σ_j g_j)·softmax(z) + Σ_j g_j·onehot(id_j); scatter_add sums duplicate ids
            dz = z.sub_(log_z[t0:t1, None]).exp_().mul_(-g_chunk.sum(dim=1, keepdim=True))
            local = safe_ids[t0:t1] - v0
            in_tile = (local >= 0) & (local < v1 - v0)
            dz.scatter_add_(1, local.clamp(0, v1 - v0 - 1), torch.where(in_tile, g_chunk, 0.0))
            return transform.backward_(dz, t)

        def accumulator(out: torch.Tensor | None) -> torch.Tensor | None:
            # `out` itself when it is already float32 (a view into the returned gradient), else a fresh one
            if out is None or out.dtype == acc:
                return out
            return torch.zeros(out.shape, device=device, dtype=acc)

        def flush(acc_tensor: torch.Tensor | None, out: torch.Tensor | None) -> None:
            if acc_tensor is not None and acc_tensor is not out:
                out.copy_(acc_tensor)

        with _no_autocast(device), _head_ctx(weight, bias, None):
            if vocab_outer:
                gh = accumulator(grad_hidden)
                for v0, v1 in tiles:
                    gw = accumulator(None if grad_weight is None else grad_weight[v0:v1])
                    for t0, t1 in chunks:
                        h = hidden[t0:t1].to(compute_dtype)
                        ds = tile_grad(t0, t1, v0, v1, h)
                        if gh is not None:
                            _addmm_fp32_(gh[t0:t1], ds, weight[v0:v1], compute_dtype)
                        if gw is not None:
                            _addmm_fp32_(gw, ds.t(), h, compute_dtype)
                        if grad_bias is not None:
                            grad_bias[v0:v1] += ds.sum(dim=0)
                        del ds
                    flush(gw, None if grad_weight is None else grad_weight[v0:v1])
                flush(gh, grad_hidden)
            else:
                gw = accumulator(grad_weight)
                for t0, t1 in chunks:
                    h = hidden[t0:t1].to(compute_dtype)
                    gh = accumulator(None if grad_hidden is None else grad_hidden[t0:t1])
                    for v0, v1 in tiles:
                        ds = tile_grad(t0, t1, v0, v1, h)
                        if gh is not None:
                            _addmm_fp32_(gh, ds, weight[v0:v1], compute_dtype)
                        if gw is not None:
                            _addmm_fp32_(gw[v0:v1], ds.t(), h, compute_dtype)
                        if grad_bias is not None:
                            grad_bias[v0:v1] += ds.sum(dim=0)
                        del ds
                    flush(gh, None if grad_hidden is None else grad_hidden[t0:t1])
                flush(gw, grad_weight)
        return (
            grad_hidden,
            grad_weight,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def fused_linear_logps_at_ids(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = LogitTransform(),
    token_chunk: int = 1024,
    vocab_tile: int = 32768,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """
    Log-probabilities at `ids` `[M, J]` of `log_softmax(transform(hidden @ weightᵀ + bias))`, differentiable w.r.t.
    `hidden`, `weight` and `bias`, holding at most one `[token_chunk, vocab_tile]` block of logits.

    Saves only the inputs and the `[M]` log-partition for the backward, which recomputes each tile. Token chunks whose
    incoming gradient is all zero are skipped, and no weight gradient is computed for a frozen head. Negative ids are
    padding: their output is `-inf` and receives no gradient.

    Args:
        compute_dtype (`torch.dtype`, *optional*): dtype the GEMM inputs are rounded to; products, the softmax and
            the gradient accumulators are float32. Defaults to the inputs' dtype when `hidden` and `weight` share it,
            float32 otherwise. Pass `torch.bfloat16` to match TRL's fused head under bf16 autocast.

    Returns:
        `torch.Tensor`: `[M, J]` float32 log-probabilities.
    """
    _check_inputs(hidden, weight, bias)
    if ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"expected ids [{hidden.shape[0]}, J], got {tuple(ids.shape)}")
    compute_dtype = _resolve_compute_dtype(hidden, weight, compute_dtype)
    return _FusedLinearLogpsAtIds.apply(hidden, weight, bias, ids, transform, token_chunk, vocab_tile, compute_dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Full-logits references (tests and benchmarks only)
# ---------------------------------------------------------------------------------------------------------------------


def _naive_logps(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: LogitTransform
) -> torch.Tensor:
    acc = _acc_dtype(torch.promote_types(hidden.dtype, weight.dtype))
    s = hidden.to(acc) @ weight.to(acc).t()
    if bias is not None:
        s = s + bias.to(acc)
    return torch.log_softmax(transform(s), dim=-1)


def naive_logps_at_ids(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = LogitTransform(),
) -> torch.Tensor:
    """Reference for [`fused_linear_logps_at_ids`]: full `[M, V]` float32 logits, `log_softmax`, gather (with grad)."""
    logps = _naive_logps(hidden, weight, bias, transform).gather(1, ids.clamp(min=0))
    return logps.masked_fill(ids < 0, -math.inf)


def naive_topk_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = LogitTransform(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for [`chunked_topk_logps`]: full `[M, V]` float32 logits, `log_softmax`, `topk`."""
    values, indices = _naive_logps(hidden, weight, bias, transform).topk(k, dim=-1)
    return values, indices
