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

"""`dppo_trl.kernels.topk_logps`: the logit transform, the gathers at listed ids (no-grad from the sampled token's
log-prob, and with a gradient) and the chunked top-K, against full-logits references. The fused reference gather
(`dppo_dev.topk_reference`, design A) and the CUDA test are in test_topk_reference.py."""

import math
from types import SimpleNamespace

import pytest
import torch

from dppo_dev.topk_reference import fused_linear_logps_at_ids, naive_logps_at_ids, naive_topk_logps
from dppo_trl.kernels.topk_logps import LogitTransform, chunked_topk_logps, logps_at_ids_from_sampled

# Both sides upcast the same (possibly bf16) values and compute in float32, so they differ only in summation order:
# with H = 64 and logits of magnitude ≲ 10 that is ~1e-6 per logit, and log-probabilities (a difference of two
# logits plus a logZ or an anchor) stay well inside 2e-5.
ATOL = 2e-5
TRANSFORMS = {
    "identity": LogitTransform(),
    "temperature": LogitTransform(temperature=0.7),
    "scale_softcap": LogitTransform(temperature=1.3, logit_scale=2.5, softcap=4.0),
}
# Ragged: 67 rows in chunks of 16, 301 vocabulary entries in tiles of 64
M, H, V, K = 67, 64, 301, 8


def make_inputs(dtype=torch.float32, seed=0, bias=False, tied=False, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=g).to(dtype)
    if tied:
        weight = torch.nn.Embedding(V, H).weight.data.normal_(generator=g).mul_(0.3).to(dtype)
    else:
        weight = (0.3 * torch.randn(V, H, generator=g)).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    if requires_grad:
        hidden.requires_grad_()
        weight.requires_grad_()
        if b is not None:
            b.requires_grad_()
    return hidden, weight, b


def make_ids(hidden, weight, bias, transform, seed=0):
    """`[M, 1 + K]` ids: sampled id (inside or outside the top-K), then the top-K, with duplicates and padding."""
    g = torch.Generator().manual_seed(seed)
    _, topk = naive_topk_logps(hidden.detach(), weight.detach(), K, bias=None if bias is None else bias.detach())
    # The random draws come from a CPU generator (the same ids on every device), so the ids are assembled on the CPU
    # and moved to the inputs' device at the end: CUDA top-K ids and CPU draws cannot meet in one torch.where.
    topk = topk.cpu()
    sampled = torch.randint(0, V, (M,), generator=g)
    inside = torch.rand(M, generator=g) < 0.5
    sampled = torch.where(inside, topk[:, 3], sampled)  # sampled id also in the top-K: a duplicate
    ids = torch.cat([sampled[:, None], topk], dim=1)
    ids[5, 4] = ids[5, 2]  # a duplicate inside the top-K
    ids[7, 6:] = -1  # padded top-K slots
    ids[9, 1:] = -1  # no top-K at all
    ids[11] = -1  # a padding row
    return ids.to(hidden.device)


def assert_logps_close(actual, expected, ids, atol=ATOL):
    assert actual.dtype == torch.float32
    pad = ids < 0
    assert torch.isneginf(actual[pad]).all()
    torch.testing.assert_close(actual[~pad], expected[~pad].float(), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# LogitTransform
# ---------------------------------------------------------------------------------------------------------------------


def test_transform_matches_definition():
    s = torch.randn(5, 7) * 10
    t = LogitTransform(temperature=0.6, logit_scale=1.7, softcap=3.0)
    expected = 3.0 * torch.tanh(s * 1.7 / 3.0) / 0.6
    torch.testing.assert_close(t(s), expected)
    for keep_tanh in (False, True):
        z, tanh = t.apply_(s.clone(), keep_tanh=keep_tanh)
        torch.testing.assert_close(z, expected)
        assert (tanh is not None) == keep_tanh


@pytest.mark.parametrize(
    "attrs, expected",
    [
        ({}, (1.0, None)),
        ({"final_logit_softcapping": 30.0}, (1.0, 30.0)),
        ({"logit_scale": 0.0625}, (0.0625, None)),
        ({"logit_scale": None, "output_multiplier": 0.5}, (0.5, None)),
        ({"lm_head_multiplier": 0.25}, (0.25, None)),
        ({"logits_scaling": 8.0, "model_type": "granite"}, (0.125, None)),
        ({"logits_scaling": 8.0, "model_type": "hyperclovax"}, (8.0, None)),
        ({"logit_scale": 0.0}, (0.0, None)),
    ],
)
def test_transform_from_model_config(attrs, expected):
    text_config = SimpleNamespace(**attrs)
    config = SimpleNamespace(get_text_config=lambda: text_config)
    t = LogitTransform.from_model_config(config, temperature=0.9)
    assert (t.logit_scale, t.softcap, t.temperature) == (*expected, 0.9)


def test_transform_from_real_configs():
    from transformers import CohereConfig, Gemma2Config, GraniteConfig, LlamaConfig

    assert LogitTransform.from_model_config(LlamaConfig()) == LogitTransform()
    assert LogitTransform.from_model_config(Gemma2Config()).softcap == Gemma2Config().final_logit_softcapping
    assert LogitTransform.from_model_config(CohereConfig(logit_scale=0.125)).logit_scale == 0.125
    assert LogitTransform.from_model_config(GraniteConfig(logits_scaling=4.0)).logit_scale == 0.25


def test_transform_validation():
    with pytest.raises(ValueError):
        LogitTransform(temperature=0.0)
    with pytest.raises(ValueError):
        LogitTransform(softcap=0.0)


# ---------------------------------------------------------------------------------------------------------------------
# Design B: logps_at_ids_from_sampled
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transform_name", list(TRANSFORMS))
@pytest.mark.parametrize("bias", [False, True])
def test_anchor_matches_naive(dtype, transform_name, bias):
    transform = TRANSFORMS[transform_name]
    hidden, weight, b = make_inputs(dtype, bias=bias)
    ids = make_ids(hidden, weight, b, transform)
    ref = naive_logps_at_ids(hidden, weight, ids, bias=b, transform=transform)
    sampled_ids = ids[:, 0]
    out = logps_at_ids_from_sampled(
        hidden, weight, ids[:, 1:], sampled_ids, ref[:, 0], bias=b, transform=transform, chunk_size=16
    )
    assert_logps_close(out, ref[:, 1:], ids[:, 1:] | torch.where(sampled_ids < 0, -1, 0)[:, None])


def test_anchor_tied_head_and_other_anchor():
    # Tied head: weight is an embedding matrix; the anchor need not be one of the ids
    hidden, weight, _ = make_inputs(tied=True)
    transform = TRANSFORMS["scale_softcap"]
    ids = make_ids(hidden, weight, None, transform)
    sampled_ids = torch.randint(0, V, (M,))
    sampled_logps = naive_logps_at_ids(hidden, weight, sampled_ids[:, None], transform=transform)[:, 0]
    out = logps_at_ids_from_sampled(
        hidden, weight, ids, sampled_ids, sampled_logps, transform=transform, chunk_size=10
    )
    assert_logps_close(out, naive_logps_at_ids(hidden, weight, ids, transform=transform), ids)


def test_anchor_padding_anchor_row_and_no_grad():
    hidden, weight, _ = make_inputs(requires_grad=True)
    ids = torch.randint(0, V, (M, 3))
    sampled_ids = ids[:, 0].clone()
    sampled_ids[4] = -1
    ref = naive_logps_at_ids(hidden, weight, ids)
    out = logps_at_ids_from_sampled(hidden, weight, ids, sampled_ids, ref[:, 0])
    assert not out.requires_grad
    assert torch.isneginf(out[4]).all()
    keep = torch.arange(M) != 4
    torch.testing.assert_close(out[keep], ref[keep].detach(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("transform_name", list(TRANSFORMS))
def test_anchor_from_trl_fused_head(transform_name):
    # The intended use: the anchor is what TRL's own chunked log-prob kernel returned for the sampled token
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    transform = TRANSFORMS[transform_name]
    hidden, weight, b = make_inputs(bias=True)
    ids = make_ids(hidden, weight, b, transform)
    sampled = ids[:, 0].clamp(min=0)
    trl_logps = ChunkedLogProbFunction.apply(
        hidden, weight, b, sampled, transform.temperature, 64, transform.softcap, transform.logit_scale, ()
    )[0]
    out = logps_at_ids_from_sampled(hidden, weight, ids, sampled, trl_logps, bias=b, transform=transform)
    ref = naive_logps_at_ids(hidden, weight, ids, bias=b, transform=transform)
    assert_logps_close(out, ref, ids)


# ---------------------------------------------------------------------------------------------------------------------
# chunked_topk_logps
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transform_name", list(TRANSFORMS))
@pytest.mark.parametrize("tiles", [(16, 64), (67, 301), (5, 1000), (1, 7)])
def test_chunked_topk_matches_naive(dtype, transform_name, tiles):
    transform = TRANSFORMS[transform_name]
    hidden, weight, b = make_inputs(dtype, bias=True, seed=1)
    token_chunk, vocab_tile = tiles
    logps, ids = chunked_topk_logps(
        hidden, weight, 20, bias=b, transform=transform, token_chunk=token_chunk, vocab_tile=vocab_tile
    )
    ref_logps, ref_ids = naive_topk_logps(hidden, weight, 20, bias=b, transform=transform)
    assert logps.dtype == torch.float32 and ids.dtype == torch.int64
    assert (logps[:, :-1] >= logps[:, 1:]).all()
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=0)
    # The returned ids really carry the returned log-probabilities
    full = naive_logps_at_ids(hidden, weight, ids, bias=b, transform=transform)
    torch.testing.assert_close(full, logps, atol=1e-5, rtol=0)
    # and equal the reference ids except among near-ties (which random Gaussian logits make vanishingly rare)
    gaps = (ref_logps[:, :-1] - ref_logps[:, 1:]).abs() <= 1e-5
    tied = torch.zeros_like(ids, dtype=torch.bool)
    tied[:, :-1] |= gaps
    tied[:, 1:] |= gaps
    assert (ids == ref_ids)[~tied].all()
    if transform.softcap is None:
        # (a saturated softcap creates genuine near-ties)
        assert tied.float().mean() < 0.01


def test_chunked_topk_k_equals_vocab_and_validation():
    hidden, weight, _ = make_inputs()
    logps, ids = chunked_topk_logps(hidden[:4], weight, V, vocab_tile=50)
    assert (ids.sort(dim=1).values == torch.arange(V)).all()
    torch.testing.assert_close(logps.exp().sum(1), torch.ones(4), atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        chunked_topk_logps(hidden, weight, V + 1)


def test_empty_batch():
    # A micro-batch without valid completion tokens
    _, weight, _ = make_inputs()
    hidden = torch.zeros(0, H, requires_grad=True)
    ids = torch.zeros(0, K + 1, dtype=torch.long)
    out = fused_linear_logps_at_ids(hidden, weight, ids)
    assert out.shape == (0, K + 1)
    out.sum().backward()
    assert hidden.grad.shape == (0, H)
    assert logps_at_ids_from_sampled(hidden, weight, ids, ids[:, 0], torch.zeros(0)).shape == (0, K + 1)
    logps, top_ids = chunked_topk_logps(hidden, weight, K)
    assert logps.shape == top_ids.shape == (0, K)


@pytest.mark.parametrize(
    "transform",
    [LogitTransform(), LogitTransform(temperature=0.7, logit_scale=1.3, softcap=2.0)],
    ids=["plain", "all"],
)
def test_logps_at_ids_with_grad_is_the_full_softmax_with_its_gradient(transform):
    """π at listed ids with a gradient (truncated sampling's kept set): equal to the full log-softmax and, through a
    logsumexp over the kept ids, to its gradient; gradcheck in float64; padding gives -inf and no gradient."""
    from dppo_trl.core.functional import kept_log_mass
    from dppo_trl.kernels.topk_logps import logps_at_ids_with_grad

    g = torch.Generator().manual_seed(3)
    m, h, v, j = 6, 4, 13, 4
    hidden = torch.randn(m, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, v, (m, j), generator=g)
    ids[1, 3] = ids[4, 0] = -1
    sampled = torch.randint(0, v, (m,), generator=g)
    kept = (torch.rand(m, j, generator=g) < 0.7) & (ids >= 0)

    def ours(hidden, weight, bias):
        full = torch.log_softmax(transform(hidden @ weight.t() + bias), -1)
        lp = full.gather(1, sampled[:, None]).squeeze(1)
        return logps_at_ids_with_grad(hidden, weight, ids, sampled, lp, bias=bias, transform=transform, chunk_size=4)

    def reference(hidden, weight, bias):
        full = torch.log_softmax(transform(hidden @ weight.t() + bias), -1)
        return full.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, -math.inf)

    got, want = ours(hidden, weight, bias), reference(hidden, weight, bias)
    assert torch.equal(got.isinf(), ids < 0) and torch.allclose(got[ids >= 0], want[ids >= 0])
    grads = torch.autograd.grad(kept_log_mass(got, kept).sum(), (hidden, weight, bias))
    ref_grads = torch.autograd.grad(kept_log_mass(want, kept).sum(), (hidden, weight, bias))
    for ours_grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert torch.allclose(ours_grad, ref_grad, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *p: kept_log_mass(ours(*p), kept), (hidden, weight, bias))
    # A frozen head (LoRA): no weight gradient is built, the hidden states' is unchanged.
    (hidden_only,) = torch.autograd.grad(
        kept_log_mass(ours(hidden, weight.detach(), bias.detach()), kept).sum(), hidden
    )
    assert torch.allclose(hidden_only, ref_grads[0], atol=1e-12)


@pytest.mark.parametrize(
    "dtype, autocast", [(torch.bfloat16, False), (torch.float32, True)], ids=["bf16-weights", "fp32-weights-autocast"]
)
def test_logps_at_ids_with_grad_in_bf16(dtype, autocast):
    """The kept set's differentiable gather in the precision users train in, against float64 on the very inputs: it
    upcasts bf16 inputs and turns autocast off, so its log-probs are a float32 computation (≤ ATOL, given the same
    anchor) and autocast changes nothing (float32 rounding: 1e-5 of each gradient's norm).

    With bf16 inputs, each input's gradient is the sum of two parts autograd adds in bf16: the gather's (accumulated
    in float32, rounded once) and the anchor's (log π(y)'s gradient times Σ_k ∂L/∂log π(k), rounded once). For a
    kept set's log-mass they nearly cancel (each is ~17x their sum here), so the error is bounded by bf16's unit
    roundoff u = 2^-8 of the parts, not of the sum: ≤ u·(|gather part| + |anchor part| + |sum|), measured 0.3 of that.
    The trainer's bf16 gradient of the kept-set correction carries the same error (TRL's head returns the anchor's
    gradient in bf16)."""
    from dppo_trl.core.functional import kept_log_mass
    from dppo_trl.kernels.topk_logps import logps_at_ids_with_grad

    transform = TRANSFORMS["scale_softcap"]
    hidden, weight, b = make_inputs(dtype, bias=True, requires_grad=True)
    ids = make_ids(hidden, weight, b, transform)
    kept = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)) < 0.7) & (ids >= 0)
    sampled = ids[:, 0].clamp(min=0)

    def full_logps(h, w, bb):
        return torch.log_softmax(transform(h @ w.t() + bb), -1)

    anchor = full_logps(hidden.float(), weight.float(), b.float()).gather(1, sampled[:, None]).squeeze(1)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        got = logps_at_ids_with_grad(hidden, weight, ids, sampled, anchor, bias=b, transform=transform, chunk_size=16)
    exact = [t.detach().double().requires_grad_() for t in (hidden, weight, b)]
    full = full_logps(*exact)
    want = full.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, -math.inf)
    assert got.dtype == torch.float32 and torch.equal(got.isinf(), ids < 0)
    torch.testing.assert_close(got[ids >= 0].double(), want[ids >= 0].detach(), atol=ATOL, rtol=0)
    grads = torch.autograd.grad(kept_log_mass(got, kept).sum(), (hidden, weight, b))
    loss = kept_log_mass(want, kept).sum()
    expected = torch.autograd.grad(loss, exact, retain_graph=True)
    # The anchor's part in float64: ∂L/∂log π(y) = Σ_k ∂L/∂log π(k) over the listed ids, times ∇ log π(y).
    (per_id,) = torch.autograd.grad(loss, want, retain_graph=True)
    anchor_parts = torch.autograd.grad(
        full.gather(1, sampled[:, None]).squeeze(1), exact, per_id.masked_fill(ids < 0, 0.0).sum(1)
    )
    for grad, reference, anchor_part, given in zip(grads, expected, anchor_parts, (hidden, weight, b), strict=True):
        assert grad.dtype == given.dtype
        error = (grad.double() - reference).norm().item()
        if dtype == torch.bfloat16:
            parts = anchor_part.norm() + (reference - anchor_part).norm() + reference.norm()
            assert error <= 2.0**-8 * parts.item(), error / parts.item()
        else:
            assert error <= 1e-5 * reference.norm().item()
