"""Tests for dppo_trl.core.functional against brute-force fp64 references (eqs. 11-16 of arXiv 2602.04879)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from references import dppo_per_token_loss

from dppo_trl.core.functional import (
    DEFAULT_DELTAS,
    DIVERGENCES,
    binary_kl,
    binary_tv,
    compute_divergence,
    default_delta,
    dppo_coefficient,
    ratio_coefficient,
    topk_kl,
    topk_tv,
    trust_region_mask,
)

NEG_INF = -math.inf
PROPERTY = settings(max_examples=200, deadline=None)


# ----------------------------------------------------------------------------- brute-force fp64 references


def _xlogy_ratio(p: np.ndarray, q: np.ndarray) -> float:
    """Σ p log(p/q) with 0 log 0 = 0 (inf where p > 0 = q)."""
    with np.errstate(divide="ignore"):
        terms = np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - np.log(q)), 0.0)
    return float(terms.sum())


def _ref_tv(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


def _lump(probs: np.ndarray, idx: list[int]) -> np.ndarray:
    """Distribution over the listed tokens plus one rest bucket (clamped at 0)."""
    listed = probs[idx]
    return np.append(listed, max(1.0 - listed.sum(), 0.0))


def _random_dists(seed: int, batch: int, vocab: int, scale: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    pi = torch.log_softmax(scale * torch.randn(batch, vocab, generator=gen, dtype=torch.float64), -1)
    mu = torch.log_softmax(scale * torch.randn(batch, vocab, generator=gen, dtype=torch.float64), -1)
    return pi, mu


def _topk_sets(mu_full: torch.Tensor, k: int, sampled: torch.Tensor) -> list[list[int]]:
    """TopK(μ) ∪ {y} per row, the sampled token last when it is outside the top-K."""
    top = torch.topk(mu_full, k, dim=-1).indices.tolist()
    sets = []
    for row, y in zip(top, sampled.tolist()):
        sets.append(row if y in row else row + [y])
    return sets


def _gather_padded(full: torch.Tensor, sets: list[list[int]], width: int) -> torch.Tensor:
    out = torch.full((full.shape[0], width), NEG_INF, dtype=full.dtype)
    for b, idx in enumerate(sets):
        out[b, : len(idx)] = full[b, idx]
    return out


# ----------------------------------------------------------------------------- API basics


def test_default_delta_and_divergence_dispatch():
    assert DEFAULT_DELTAS == {"tv": 0.15, "kl": 0.05}
    assert default_delta("binary_tv") == default_delta("topk_tv") == 0.15
    assert default_delta("binary_kl") == default_delta("topk_kl") == 0.05
    with pytest.raises(ValueError):
        default_delta("tv")
    pi, mu = torch.tensor([-0.5, -2.0]), torch.tensor([-1.0, -1.5])
    pi_k, mu_k = torch.tensor([[-0.5, -3.0], [-2.0, -1.0]]), torch.tensor([[-1.0, -2.0], [-1.5, -0.7]])
    assert torch.equal(compute_divergence("binary_tv", pi, mu), binary_tv(pi, mu))
    assert torch.equal(compute_divergence("binary_kl", pi, mu), binary_kl(pi, mu))
    assert torch.equal(compute_divergence("topk_tv", pi, mu, pi_k, mu_k), topk_tv(pi_k, mu_k))
    assert torch.equal(compute_divergence("topk_kl", pi, mu, pi_k, mu_k), topk_kl(pi_k, mu_k))
    assert set(DIVERGENCES) == {"binary_tv", "binary_kl", "topk_tv", "topk_kl"}
    with pytest.raises(ValueError):
        compute_divergence("topk_kl", pi, mu)
    with pytest.raises(ValueError):
        compute_divergence("full_kl", pi, mu)


# ----------------------------------------------------------------------------- binary divergences


def test_binary_divergences_match_fp64_formulas():
    pi_full, mu_full = _random_dists(0, 64, 50)
    y = torch.randint(0, 50, (64,), generator=torch.Generator().manual_seed(1))
    pi_lp = pi_full.gather(-1, y[:, None]).squeeze(-1)
    mu_lp = mu_full.gather(-1, y[:, None]).squeeze(-1)
    p, q = pi_lp.exp().numpy(), mu_lp.exp().numpy()
    ref_tv = np.abs(p - q)
    ref_kl = np.array([_xlogy_ratio(np.array([m, 1 - m]), np.array([s, 1 - s])) for s, m in zip(p, q)])

    tv, kl = binary_tv(pi_lp.float(), mu_lp.float()), binary_kl(pi_lp.float(), mu_lp.float())
    assert tv.dtype == kl.dtype == torch.float32
    np.testing.assert_allclose(tv.double().numpy(), ref_tv, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(kl.double().numpy(), ref_kl, rtol=1e-4, atol=1e-6)
    # fp64 inputs stay fp64 and are exact.
    assert binary_kl(pi_lp, mu_lp).dtype == torch.float64
    np.testing.assert_allclose(binary_kl(pi_lp, mu_lp).numpy(), ref_kl, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_binary_edge_probabilities_are_finite(dtype):
    log_half = math.log(0.5)
    # (π, μ) pairs on and around the boundary p ∈ {0, 1}.
    pairs = [
        (0.0, 0.0),
        (NEG_INF, NEG_INF),
        (0.0, NEG_INF),
        (NEG_INF, 0.0),
        (log_half, 0.0),
        (log_half, NEG_INF),
        (0.0, log_half),
        (NEG_INF, log_half),
        (-1e-9, -2.0),
        (-30.0, -1e-9),
        (1e-3, -1.0),  # slightly positive log-prob from an engine: treated as p = 1
    ]
    pi = torch.tensor([a for a, _ in pairs], dtype=dtype)
    mu = torch.tensor([b for _, b in pairs], dtype=dtype)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for fn in (binary_tv, binary_kl):
        d = fn(pi, mu)
        assert d.dtype == out_dtype
        assert torch.isfinite(d).all() and (d >= 0).all(), (fn.__name__, d)
    kl = binary_kl(pi, mu)
    # Exact limits where the true KL is finite.
    assert kl[0] == 0 and kl[1] == 0
    tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-6
    assert abs(kl[4].item() - math.log(2)) < tol  # μ=1, π=½
    assert abs(kl[5].item() - math.log(2)) < tol  # μ=0, π=½
    # Infinite true KL: large, finite, above any sensible δ.
    assert (kl[[2, 3, 6, 7, 8, 9]] > 1.0).all()
    tv = binary_tv(pi, mu)
    assert tv[2] == 1 and tv[3] == 1 and tv[0] == 0


def test_binary_kl_bf16_near_one_is_not_the_known_clamp_bug():
    # bf16 log-probs of tokens with p ≈ 1: a clamp(max=1-1e-7) in bf16 is a no-op and gives inf/NaN.
    pi = torch.tensor([-1e-4, -0.0, -2e-3, -5.0], dtype=torch.bfloat16)
    mu = torch.tensor([-2e-3, -1e-4, -0.0, -0.0], dtype=torch.bfloat16)
    kl = binary_kl(pi, mu)
    assert kl.dtype == torch.float32 and torch.isfinite(kl).all() and (kl >= 0).all()
    ref = binary_kl(pi.double(), mu.double()).float()
    torch.testing.assert_close(kl, ref, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- top-K divergences


@pytest.mark.parametrize("sampled_in_topk", [True, False])
def test_topk_divergences_match_lumped_fp64(sampled_in_topk):
    batch, vocab, k = 32, 50, 5
    pi_full, mu_full = _random_dists(2, batch, vocab)
    order = torch.argsort(mu_full, dim=-1, descending=True)
    # Inside: one of the top-K tokens; outside: a token ranked below K.
    y = order[:, 2] if sampled_in_topk else order[:, k + 7]
    sets = _topk_sets(mu_full, k, y)
    assert all((len(s) == k) == sampled_in_topk for s in sets)
    pi_k = _gather_padded(pi_full, sets, k + 1)
    mu_k = _gather_padded(mu_full, sets, k + 1)

    ref_tv, ref_kl = [], []
    for b, idx in enumerate(sets):
        p, q = _lump(pi_full[b].exp().numpy(), idx), _lump(mu_full[b].exp().numpy(), idx)
        ref_tv.append(_ref_tv(p, q))
        ref_kl.append(_xlogy_ratio(q, p))

    tv, kl = topk_tv(pi_k.float(), mu_k.float()), topk_kl(pi_k.float(), mu_k.float())
    assert tv.dtype == kl.dtype == torch.float32 and tv.shape == kl.shape == (batch,)
    np.testing.assert_allclose(tv.double().numpy(), ref_tv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kl.double().numpy(), ref_kl, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(topk_kl(pi_k, mu_k).numpy(), ref_kl, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_padding_and_nan_slots_contribute_zero(dtype):
    pi_full, mu_full = _random_dists(3, 16, 50)
    sets = _topk_sets(mu_full, 6, torch.argmax(mu_full, -1))  # sampled token inside: no extra slot needed
    pi_k = _gather_padded(pi_full, sets, 6).to(dtype)
    mu_k = _gather_padded(mu_full, sets, 6).to(dtype)
    pad = torch.full((16, 3), NEG_INF, dtype=dtype)
    nan = torch.full((16, 3), math.nan, dtype=dtype)
    finite = torch.randn(16, 3, dtype=dtype).clamp(max=-1)
    # Padding terms are exactly 0; only the summation order over J changes (vectorised reductions), which moves
    # an fp32 result by a few ulps at most.
    tol = {"rtol": 5e-7, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-14, "atol": 1e-15}
    for fn in (topk_tv, topk_kl):
        base = fn(pi_k, mu_k)
        padded = fn(torch.cat([pi_k, pad], -1), torch.cat([mu_k, pad], -1))
        interleaved = fn(torch.cat([pad[:, :1], pi_k, pad], -1), torch.cat([pad[:, :1], mu_k, pad], -1))
        # A NaN in either tensor turns the slot into padding in both.
        nan_pi = fn(torch.cat([pi_k, nan], -1), torch.cat([mu_k, finite], -1))
        nan_mu = fn(torch.cat([finite, pi_k], -1), torch.cat([nan, mu_k], -1))
        for other in (padded, interleaved, nan_pi, nan_mu):
            assert other.dtype == dtype and torch.isfinite(other).all()
            torch.testing.assert_close(other, base, **tol)
        # All-padding rows: both distributions are the rest bucket, D = 0.
        assert (fn(pad, pad) == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_upcast(dtype):
    batch, vocab, k = 32, 50, 5
    pi_full, mu_full = _random_dists(4, batch, vocab)
    y = torch.argsort(mu_full, dim=-1, descending=True)[:, 9]
    sets = _topk_sets(mu_full, k, y)
    pi_k, mu_k = _gather_padded(pi_full, sets, k + 1), _gather_padded(mu_full, sets, k + 1)
    pi_y, mu_y = pi_full.gather(-1, y[:, None]).squeeze(-1), mu_full.gather(-1, y[:, None]).squeeze(-1)
    cases = [
        (binary_tv, pi_y, mu_y, 2e-2),
        (binary_kl, pi_y, mu_y, 2e-2),
        (topk_tv, pi_k, mu_k, 3e-2),
        (topk_kl, pi_k, mu_k, 3e-2),
    ]
    for fn, a, b, loose in cases:
        a_low, b_low = a.to(dtype), b.to(dtype)
        out = fn(a_low, b_low)
        assert out.dtype == torch.float32 and torch.isfinite(out).all() and (out >= 0).all()
        # Tight against fp64 on the rounded inputs (the computation itself loses nothing) ...
        torch.testing.assert_close(out.double(), fn(a_low.double(), b_low.double()), rtol=1e-4, atol=1e-6)
        # ... and loose against fp64 on the exact inputs (only input rounding differs).
        torch.testing.assert_close(out.double(), fn(a, b), rtol=0, atol=loose)


# ----------------------------------------------------------------------------- property tests


@st.composite
def _lumping_case(draw, logit_bound: float):
    vocab = draw(st.integers(2, 40))
    logits = st.lists(st.floats(-logit_bound, logit_bound), min_size=vocab, max_size=vocab)
    pi_logits, mu_logits = draw(logits), draw(logits)
    k = draw(st.integers(1, vocab))
    y = draw(st.integers(0, vocab - 1))
    return torch.tensor(pi_logits, dtype=torch.float64), torch.tensor(mu_logits, dtype=torch.float64), k, y


def _lumped_inputs(pi_logits, mu_logits, k, y, dtype):
    pi_full, mu_full = torch.log_softmax(pi_logits, -1), torch.log_softmax(mu_logits, -1)
    sets = _topk_sets(mu_full[None], k, torch.tensor([y]))
    pi_k, mu_k = _gather_padded(pi_full[None], sets, k + 1), _gather_padded(mu_full[None], sets, k + 1)
    return pi_full, mu_full, pi_full[y].to(dtype), mu_full[y].to(dtype), pi_k.to(dtype)[0], mu_k.to(dtype)[0]


@PROPERTY
@given(_lumping_case(logit_bound=5.0))
def test_data_processing_inequality(case):
    # Binary lumps the top-K set further; top-K lumps the full vocab: D_binary <= D_topK <= D_full.
    pi_full, mu_full, pi_y, mu_y, pi_k, mu_k = _lumped_inputs(*case, dtype=torch.float32)
    p, q = pi_full.exp().numpy(), mu_full.exp().numpy()
    full_tv, full_kl = _ref_tv(p, q), _xlogy_ratio(q, p)
    for d_bin, d_topk, d_full in (
        (binary_tv(pi_y, mu_y), topk_tv(pi_k, mu_k), full_tv),
        (binary_kl(pi_y, mu_y), topk_kl(pi_k, mu_k), full_kl),
    ):
        assert torch.isfinite(d_bin) and torch.isfinite(d_topk)
        assert d_bin >= 0 and d_topk >= 0
        tol = 1e-5 + 1e-5 * d_full
        assert d_bin.item() <= d_topk.item() + tol
        assert d_topk.item() <= d_full + tol


@PROPERTY
@given(_lumping_case(logit_bound=60.0), st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
def test_extreme_distributions_stay_finite(case, dtype):
    # Logits up to ±60 put probabilities at 0 and 1 in every dtype.
    pi_full, mu_full, pi_y, mu_y, pi_k, mu_k = _lumped_inputs(*case, dtype=dtype)
    for d in (binary_tv(pi_y, mu_y), binary_kl(pi_y, mu_y), topk_tv(pi_k, mu_k), topk_kl(pi_k, mu_k)):
        assert d.dtype == torch.float32 and torch.isfinite(d) and d >= 0
    assert binary_tv(pi_y, mu_y) <= 1 and topk_tv(pi_k, mu_k) <= 1
    if dtype == torch.float32:
        # KL only shrinks under the finite-value convention, so it stays below the exact full KL.
        full_kl = _xlogy_ratio(mu_full.exp().numpy(), pi_full.exp().numpy())
        assert binary_kl(pi_y, mu_y).item() <= full_kl + 1e-5 + 1e-5 * abs(full_kl)


_logp = st.one_of(st.just(NEG_INF), st.just(0.0), st.floats(-50.0, 0.0), st.floats(-1e-6, 0.0))
_adv = st.one_of(st.just(0.0), st.floats(-5.0, 5.0))


@PROPERTY
@given(
    st.lists(st.tuples(_logp, _logp, _adv), min_size=1, max_size=16),
    # δ representable in fp32, the dtype the comparison runs in.
    st.floats(0.0, 0.5, width=32),
    st.floats(0.0, 0.5, width=32),
    st.sampled_from(["binary_tv", "binary_kl"]),
    st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_mask_is_eq12_and_never_blocks_a_move_back(rows, delta_low, delta_high, kind, dtype):
    pi = torch.tensor([r[0] for r in rows], dtype=dtype)
    mu = torch.tensor([r[1] for r in rows], dtype=dtype)
    adv = torch.tensor([r[2] for r in rows])
    div = compute_divergence(kind, pi, mu)
    assert torch.isfinite(div).all() and (div >= 0).all()
    mask = trust_region_mask(pi, mu, adv, div, delta_low, delta_high)
    assert mask.dtype == torch.float32 and mask.shape == pi.shape
    for i in range(len(rows)):
        p, m, a, d = pi[i].item(), mu[i].item(), adv[i].item(), div[i].item()
        drop = (a > 0 and p > m and d > delta_high) or (a < 0 and p < m and d > delta_low)
        assert mask[i].item() == (0.0 if drop else 1.0)
        if (a > 0 and p <= m) or (a < 0 and p >= m) or a == 0:
            assert mask[i].item() == 1.0


@PROPERTY
@given(st.lists(st.tuples(_logp, _logp), min_size=1, max_size=16), st.sampled_from([1.0, 2.0, 10.0, math.inf]))
def test_ratio_coefficient_is_capped_and_finite(rows, cap):
    pi = torch.tensor([r[0] for r in rows])
    mu = torch.tensor([r[1] for r in rows])
    coef = ratio_coefficient(pi, mu, cap)
    assert coef.dtype == torch.float32 and torch.isfinite(coef).all() and (coef >= 0).all()
    assert (coef <= cap).all()
    for i, (p, m) in enumerate(rows):
        if p == NEG_INF:
            assert coef[i] == 0
        elif m > NEG_INF and p - m < 80:
            expected = min(math.exp(p - m), cap)
            assert math.isclose(coef[i].item(), expected, rel_tol=1e-5, abs_tol=1e-30)


def test_nan_inputs_do_not_raise():
    pi = torch.tensor([math.nan, -1.0, -0.5])
    mu = torch.tensor([-1.0, math.nan, -0.7])
    adv = torch.tensor([1.0, -1.0, 1.0])
    for kind in ("binary_tv", "binary_kl"):
        div = compute_divergence(kind, pi, mu)
        mask = trust_region_mask(pi, mu, adv, div, 0.1, 0.1)
        assert mask[:2].tolist() == [1.0, 1.0]


# ----------------------------------------------------------------------------- ratio and loss


def test_ratio_coefficient_never_overflows():
    pi = torch.tensor([0.0, 0.0, -1.0, NEG_INF, -3.0], dtype=torch.bfloat16)
    mu = torch.tensor([-200.0, NEG_INF, -1.0, NEG_INF, -1.0], dtype=torch.bfloat16)
    capped = ratio_coefficient(pi, mu, 10.0)
    assert capped.dtype == torch.float32
    torch.testing.assert_close(capped, torch.tensor([10.0, 10.0, 1.0, 0.0, math.exp(-2.0)]), rtol=1e-6, atol=0)
    uncapped = ratio_coefficient(pi, mu, math.inf)
    assert torch.isfinite(uncapped).all()
    assert uncapped[0] == torch.finfo(torch.float32).max and uncapped[2] == 1.0
    with pytest.raises(ValueError):
        ratio_coefficient(pi, mu, 0.0)


def _logits_with_prob(p: float, y: int, vocab: int) -> list[float]:
    """Logits whose softmax puts probability p on token y and spreads 1-p evenly elsewhere."""
    z = [math.log((1.0 - p) / (vocab - 1))] * vocab
    z[y] = math.log(p)
    return z


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loss_gradient_matches_eq11(dtype):
    vocab, cap, delta = 7, 2.0, 0.15
    # (π(y), μ(y), A, sampled token): the comment says what eq. 11-12 do with it (binary TV, δ=0.15, C=2).
    cases = [
        (0.60, 0.30, 1.0, 0),  # π>μ, A>0, D=0.3>δ: masked
        (0.20, 0.50, -1.0, 1),  # π<μ, A<0, D=0.3>δ: masked
        (0.30, 0.10, 2.0, 2),  # π>μ, A>0, D=0.2>δ: masked
        (0.50, 0.10, -1.5, 3),  # A<0, π>μ: move back towards μ, kept; r=5 capped at 2
        (0.20, 0.08, 0.5, 4),  # A>0, D=0.12<δ: kept; r=2.5 capped at 2
        (0.15, 0.50, 1.0, 5),  # A>0, π<μ, D=0.35: move back, kept; r=0.3
        (0.55, 0.50, 1.0, 6),  # D=0.05<δ: kept
        (0.45, 0.50, -0.7, 0),  # D=0.05<δ: kept
        (0.90, 0.10, 0.0, 1),  # A=0: kept, zero gradient
    ]
    logits = torch.tensor([_logits_with_prob(p, y, vocab) for p, _, _, y in cases], dtype=dtype, requires_grad=True)
    ys = torch.tensor([c[3] for c in cases])
    mu_lp = torch.tensor([math.log(c[1]) for c in cases], dtype=dtype)
    adv = torch.tensor([c[2] for c in cases], dtype=dtype)

    pi_lp = torch.log_softmax(logits, -1).gather(-1, ys[:, None]).squeeze(-1)
    div = binary_tv(pi_lp.detach(), mu_lp)
    mask = trust_region_mask(pi_lp.detach(), mu_lp, adv, div, delta, delta)
    loss = dppo_per_token_loss(pi_lp, mu_lp, adv, mask, cap)
    assert loss.dtype == dtype
    loss.sum().backward()

    expected_mask = [0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert mask.tolist() == expected_mask
    probs = torch.softmax(logits.detach(), -1)
    onehot = torch.nn.functional.one_hot(ys, vocab).to(dtype)
    weight = torch.tensor(
        [-a * min(p / m, cap) * keep for (p, m, a, _), keep in zip(cases, expected_mask)], dtype=dtype
    )
    expected = weight[:, None] * (onehot - probs)  # ∇_z log softmax(z)_y = onehot(y) - softmax(z)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(logits.grad, expected, **tol)
    assert (logits.grad[[0, 1, 2, 8]] == 0).all()


def test_loss_broadcasts_advantages_and_zero_weight_is_exact():
    pi = torch.tensor([[-0.5, -1.0, NEG_INF], [-2.0, -0.1, -0.3]], requires_grad=True)
    mu = torch.tensor([[-0.7, -0.9, -1.0], [-1.0, -0.2, -0.3]])
    adv = torch.tensor([[1.0], [-2.0]])
    keep = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    loss = dppo_per_token_loss(pi, mu, adv, keep, 3.0)
    torch.testing.assert_close(loss, dppo_per_token_loss(pi, mu, adv.expand(2, 3), keep, 3.0))
    # π = 0 (ratio 0) and masked tokens contribute exactly 0, no NaN from 0 · log 0.
    assert loss[0, 2] == 0 and loss[1, 1] == 0 and torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(pi.grad).all() and pi.grad[0, 2] == 0 and pi.grad[1, 1] == 0
    # bf16 policy log-probs: the loss is fp32 and the gradient flows back in bf16.
    pi_bf16 = pi.detach().to(torch.bfloat16).requires_grad_()
    out = dppo_per_token_loss(pi_bf16, mu, adv, keep, 3.0)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert pi_bf16.grad.dtype == torch.bfloat16


def test_dppo_coefficient_is_the_gradient_of_eq11():
    """`dppo_coefficient` (what the trainer uses) is exactly the w of eq. 11's gradient −A · w · ∇log π."""
    pi_full, mu_full = _random_dists(5, 64, 30)
    y = torch.randint(0, 30, (64,), generator=torch.Generator().manual_seed(6))
    pi = pi_full.gather(-1, y[:, None]).squeeze(-1).requires_grad_()
    mu = mu_full.gather(-1, y[:, None]).squeeze(-1)
    adv = torch.randn(64, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for kind, delta, cap in (("binary_tv", 0.15, 2.0), ("binary_kl", 0.05, 5.0)):
        keep = trust_region_mask(pi.detach(), mu, adv, compute_divergence(kind, pi.detach(), mu), delta, delta)
        (grad,) = torch.autograd.grad(dppo_per_token_loss(pi, mu, adv, keep, cap).sum(), pi)
        w = dppo_coefficient(pi.detach(), mu, adv, kind, delta, delta, cap)
        torch.testing.assert_close(grad, -adv * w, rtol=1e-12, atol=1e-14)
        assert (w == 0).any() and (w > 0).any()  # both regimes of the mask are exercised


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_floors_only_infinite_values(dtype):
    """A finite π, however close to 0 or 1, is used as it is; only π exactly 0 or 1 (infinite KL) is moved."""
    mu = torch.tensor([math.log(0.5), math.log(0.5), math.log(0.5), math.log(0.5)], dtype=dtype)
    pi = torch.tensor([math.log(1e-9), math.log(1e-30), NEG_INF, 0.0], dtype=dtype)
    kl = binary_kl(pi, mu)
    exact = [0.5 * math.log(0.5 / p) + 0.5 * math.log(0.5 / (1 - p)) for p in (1e-9, 1e-30)]
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert kl[0].item() == pytest.approx(exact[0], rel=tol) and kl[1].item() == pytest.approx(exact[1], rel=tol)
    # π = 0 and π = 1 (infinite exact KL): π moved to 1e-7 from the boundary.
    floor0 = 0.5 * math.log(0.5 / 1e-7) + 0.5 * math.log(0.5 / (1 - 1e-7))
    floor1 = 0.5 * math.log(0.5 / (1 - 1e-7)) + 0.5 * math.log(0.5 / 1e-7)
    assert kl[2].item() == pytest.approx(floor0, rel=1e-5) and kl[3].item() == pytest.approx(floor1, rel=1e-5)
    assert kl[1] > kl[2]  # a finite π below the floor is not raised to it
    # Top-K KL: same rule for listed slots and the rest bucket.
    pi_k = torch.tensor([[math.log(1e-30), math.log(0.5)], [NEG_INF, math.log(0.5)]], dtype=dtype)
    mu_k = torch.tensor([[math.log(0.5), math.log(0.25)], [math.log(0.5), math.log(0.25)]], dtype=dtype)
    topk = topk_kl(pi_k, mu_k)
    assert topk[0] > topk[1] and torch.isfinite(topk).all()
