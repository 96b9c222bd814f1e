"""`dppo_dev.topk_reference`: the differentiable fused gather (design A) against the full-logits references, its
gradient (every backward loop order, gradcheck in float64, a frozen head, bf16 parameters), TRL's own single-target
kernel, CUDA in bf16 (marked `gpu`), and the memory benchmark's variants agreeing on one loss. The library's gathers
(`dppo_trl.kernels.topk_logps`) are tested in test_topk_logps.py, whose inputs these tests share."""

import math

import pytest
import torch
from test_topk_logps import ATOL, TRANSFORMS, M, V, assert_logps_close, make_ids, make_inputs

from dppo_dev import topk_reference
from dppo_dev.topk_reference import fused_linear_logps_at_ids, naive_logps_at_ids, naive_topk_logps
from dppo_trl.kernels.topk_logps import LogitTransform, chunked_topk_logps, logps_at_ids_from_sampled


@pytest.fixture(params=["auto", "token", "vocab"])
def backward_order(request, monkeypatch):
    """Run a gradient test with the fused backward's automatic loop order and with each order forced."""
    monkeypatch.setattr(topk_reference, "_BACKWARD_ORDER", None if request.param == "auto" else request.param)
    return request.param


# ---------------------------------------------------------------------------------------------------------------------
# Design A: fused_linear_logps_at_ids
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transform_name", list(TRANSFORMS))
def test_fused_forward_matches_naive(dtype, transform_name):
    transform = TRANSFORMS[transform_name]
    hidden, weight, b = make_inputs(dtype, bias=True, tied=True)
    ids = make_ids(hidden, weight, b, transform)
    out = fused_linear_logps_at_ids(hidden, weight, ids, bias=b, transform=transform, token_chunk=16, vocab_tile=64)
    assert_logps_close(out, naive_logps_at_ids(hidden, weight, ids, bias=b, transform=transform), ids)


@pytest.mark.parametrize("transform_name", list(TRANSFORMS))
def test_fused_gradcheck_float64(transform_name, backward_order):
    transform = TRANSFORMS[transform_name]
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(23, 4, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(23, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 23, (6, 4), generator=g)
    ids[:, 1] = ids[:, 0]  # duplicates
    ids[2, 3] = -1  # padding slot
    ids[4] = -1  # padding row

    def fn(h, w, b):
        out = fused_linear_logps_at_ids(h, w, ids, bias=b, transform=transform, token_chunk=4, vocab_tile=7)
        # -inf padding has no finite difference; its gradient is checked to be zero by the comparison below
        return out.masked_fill(ids < 0, 0.0)

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def _grads(fn, inputs, grad_out):
    out = fn(*inputs)
    wanted = [x for x in inputs if x is not None and x.requires_grad]
    return torch.autograd.grad(out, wanted, grad_out)


@pytest.mark.parametrize("transform_name", list(TRANSFORMS))
@pytest.mark.parametrize("column0_only", [False, True])
def test_fused_gradients_match_naive(transform_name, column0_only, backward_order):
    transform = TRANSFORMS[transform_name]
    hidden, weight, b = make_inputs(bias=True, requires_grad=True)
    ids = make_ids(hidden, weight, b, transform)
    grad_out = torch.randn(ids.shape).masked_fill(ids < 0, 0.0)
    if column0_only:
        # DPPO: only log π(sampled) carries a gradient; the top-K columns feed a detached mask
        grad_out[:, 1:] = 0.0
    grad_out[:20] = 0.0  # whole token chunks without gradient are skipped

    def ours(h, w, bb):
        return fused_linear_logps_at_ids(h, w, ids, bias=bb, transform=transform, token_chunk=16, vocab_tile=64)

    def naive(h, w, bb):
        return naive_logps_at_ids(h, w, ids, bias=bb, transform=transform)

    for actual, expected in zip(
        _grads(ours, (hidden, weight, b), grad_out), _grads(naive, (hidden, weight, b), grad_out)
    ):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def test_fused_dppo_usage_column0_backward():
    # Loss built like DPPO: gradient through column 0, the others detached into a mask
    hidden, weight, _ = make_inputs(requires_grad=True)
    ids = make_ids(hidden, weight, None, LogitTransform())
    grads = []
    for fn in (fused_linear_logps_at_ids, naive_logps_at_ids):
        hidden.grad = weight.grad = None
        logps = fn(hidden, weight, ids)
        mask = (logps[:, 1:].detach().exp().sum(1) > 0.5).float()
        (logps[:, 0] * mask).sum().backward()
        grads.append((hidden.grad.clone(), weight.grad.clone()))
    for actual, expected in zip(*grads):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def test_fused_frozen_weight_and_bf16_grads(backward_order):
    # Frozen (LoRA) head: no weight gradient at all; the hidden gradient is unchanged
    hidden, weight, _ = make_inputs(requires_grad=True)
    weight.requires_grad_(False)
    ids = make_ids(hidden, weight, None, LogitTransform())
    ids[:, 1:] = -1
    fused_linear_logps_at_ids(hidden, weight, ids, token_chunk=16, vocab_tile=64)[:, 0].sum().backward()
    assert weight.grad is None
    grad_h = hidden.grad.clone()
    hidden.grad = None
    naive_logps_at_ids(hidden, weight, ids)[:, 0].sum().backward()
    torch.testing.assert_close(grad_h, hidden.grad, atol=1e-5, rtol=1e-4)

    # bf16 parameters: gradients accumulate in float32 and are rounded once, to the parameter dtype
    hidden16 = hidden.detach().bfloat16().requires_grad_()
    weight16 = weight.detach().bfloat16().requires_grad_()
    fused_linear_logps_at_ids(hidden16, weight16, ids, token_chunk=16, vocab_tile=64)[:, 0].sum().backward()
    assert hidden16.grad.dtype == weight16.grad.dtype == torch.bfloat16
    h32 = hidden16.detach().float().requires_grad_()
    w32 = weight16.detach().float().requires_grad_()
    naive_logps_at_ids(h32, w32, ids)[:, 0].sum().backward()
    # One bf16 rounding of the result: relative error 2^-8
    torch.testing.assert_close(hidden16.grad.float(), h32.grad, atol=1e-5, rtol=2**-8)
    torch.testing.assert_close(weight16.grad.float(), w32.grad, atol=1e-5, rtol=2**-8)


def test_fused_ignores_autocast_and_unused_output():
    hidden, weight, _ = make_inputs(requires_grad=True)
    ids = make_ids(hidden, weight, None, LogitTransform())
    ref = fused_linear_logps_at_ids(hidden, weight, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_linear_logps_at_ids(hidden, weight, ids)
        anchored = logps_at_ids_from_sampled(hidden, weight, ids, ids[:, 0], ref[:, 0].detach())
    assert out.dtype == anchored.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    assert_logps_close(anchored, ref.detach(), ids)
    # All-padding input still returns a differentiable (zero-gradient) result
    empty = fused_linear_logps_at_ids(hidden, weight, torch.full_like(ids, -1))
    assert torch.isneginf(empty).all()
    empty.masked_fill(torch.ones_like(ids, dtype=torch.bool), 0.0).sum().backward()
    assert hidden.grad.abs().max() == 0


def test_fused_single_target_matches_trl_kernel():
    # J = 1 reduces to TRL's binary fused log-prob, value and gradients
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    transform = TRANSFORMS["scale_softcap"]
    hidden, weight, b = make_inputs(bias=True, requires_grad=True)
    targets = torch.randint(0, V, (M,))
    grad_out = torch.randn(M)

    def ours(h, w, bb):
        return fused_linear_logps_at_ids(h, w, targets[:, None], bias=bb, transform=transform, vocab_tile=64)[:, 0]

    def trl(h, w, bb):
        return ChunkedLogProbFunction.apply(
            h, w, bb, targets, transform.temperature, 64, transform.softcap, transform.logit_scale, ()
        )[0]

    torch.testing.assert_close(ours(hidden, weight, b), trl(hidden, weight, b), atol=ATOL, rtol=0)
    for actual, expected in zip(
        _grads(ours, (hidden, weight, b), grad_out), _grads(trl, (hidden, weight, b), grad_out)
    ):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_cuda_bf16_matches_float32_reference():
    hidden, weight, b = make_inputs(torch.bfloat16, bias=True, requires_grad=False)
    hidden, weight, b = (x.cuda().requires_grad_() for x in (hidden, weight, b))
    transform = TRANSFORMS["scale_softcap"]
    ids = make_ids(hidden, weight, b, transform)
    out = fused_linear_logps_at_ids(hidden, weight, ids, bias=b, transform=transform, token_chunk=16, vocab_tile=64)
    ref = naive_logps_at_ids(hidden, weight, ids, bias=b, transform=transform)
    assert_logps_close(out, ref, ids, atol=1e-4)
    grad_out = torch.randn(ids.shape, device="cuda").masked_fill(ids < 0, 0.0)
    grad_out[:, 1:] = 0
    for actual, expected in zip(
        torch.autograd.grad(out, (hidden, weight, b), grad_out),
        torch.autograd.grad(ref, (hidden, weight, b), grad_out),
    ):
        # bf16 GEMM inputs for the gradient tiles (like TRL on CUDA), fp32 accumulation, one bf16 rounding at the end
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=2e-2)
    logps, topk_ids = chunked_topk_logps(hidden, weight, 20, bias=b, transform=transform, vocab_tile=64)
    ref_logps, _ = naive_topk_logps(hidden, weight, 20, bias=b, transform=transform)
    torch.testing.assert_close(logps, ref_logps, atol=1e-4, rtol=0)
    anchored = logps_at_ids_from_sampled(
        hidden, weight, ids, ids[:, 0], ref[:, 0].detach(), bias=b, transform=transform
    )
    assert_logps_close(anchored, ref.detach(), ids, atol=1e-4)
    assert math.isfinite(float(out[~(ids < 0)].sum()))


def test_benchmark_variants_agree():
    # The benchmark's workers, in-process on tiny sizes: every variant computes the same DPPO stand-in loss
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "topk_memory.py"
    spec = importlib.util.spec_from_file_location("topk_memory_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    losses = {}
    for variant in bench.VARIANTS:
        args = bench.parse_args(
            ["--n-tokens", "40", "--hidden", "16", "--vocab", "500", "--vocab-tile", "128", "--token-chunk", "16"]
            + ["--worker", variant]
        )
        result = bench.run_worker(args)
        # Memory is counted, not timed; the time is only checked to be reported (a fast run rounds it to 0.0)
        assert result["peak_extra_mib"] >= 0 and math.isfinite(result["time_s"])
        losses[variant] = result["loss"]
    # `kept_set` is the truncated-sampling loss: π renormalised over each row's kept ids (its first 1 + r mod (K + 1)).
    hidden, weight, ids, advantages = bench._make_inputs(args, torch)
    with torch.no_grad():
        full = torch.log_softmax(hidden @ weight.t(), dim=-1).gather(1, ids)
        kept = torch.arange(ids.shape[1]).unsqueeze(0) <= (torch.arange(ids.shape[0]) % ids.shape[1]).unsqueeze(1)
        pi_kept = full[:, 0] - torch.logsumexp(full.masked_fill(~kept, -math.inf), dim=1)
    assert losses.pop("kept_set") == pytest.approx(-(pi_kept * advantages).sum().item(), rel=1e-5)
    for variant, loss in losses.items():
        assert loss == pytest.approx(losses["naive"], rel=1e-5), variant
