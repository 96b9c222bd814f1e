"""Tests for dppo_trl.core.baselines and dppo_trl.core.registry: each coefficient against the autograd of the method's own
surrogate objective, and the registry's dispatch."""

import math

import pytest
import torch

from dppo_trl.core.baselines import (
    CISPO_EPS_MAX,
    cispo_coefficient,
    dppo_decoupled_coefficient,
    grpo_clip_coefficient,
    minirl_coefficient,
    pg_is_coefficient,
    relaxed_clip_coefficient,
)
from dppo_trl.core.functional import binary_tv, dppo_coefficient, ratio_coefficient, trust_region_mask
from dppo_trl.core.registry import TRUST_REGIONS, CoefficientInputs, trust_region_table
from dppo_trl.core.spec import TrustRegionSpec

NEEDS_OLD_LOGPS = {name for name, entry in TRUST_REGIONS.items() if entry.needs_old_logps}


def _entry(name, pi, mu, adv, old=None, **spec_fields):
    """The registry entry `name` called as `policy_loss` calls it (D of the binary TV, the spec's fields)."""
    spec = TrustRegionSpec(trust_region=name, **spec_fields)
    tokens = CoefficientInputs(pi, mu, adv, binary_tv(pi, mu), "binary_tv", old_logps=old)
    return spec.region.coefficient(tokens, spec)


def clip_higher_coefficient(pi, mu, adv):
    """The registry's `clip_higher` entry with ε_low = 0.2."""
    return _entry("clip_higher", pi, mu, adv, epsilon=0.2)


def _random_inputs(seed: int, n: int = 256) -> tuple[torch.Tensor, ...]:
    """fp64 log-probs of π, μ, π_old with ratios spread across every clip region, and signed advantages."""
    gen = torch.Generator().manual_seed(seed)
    mu = torch.log(torch.rand(n, generator=gen, dtype=torch.float64).clamp(min=1e-4))
    old = (mu + 0.4 * torch.randn(n, generator=gen, dtype=torch.float64)).clamp(max=0)
    pi = (mu + 0.4 * torch.randn(n, generator=gen, dtype=torch.float64)).clamp(max=0)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    adv[::17] = 0.0
    return pi, mu, old, adv


def _surrogate_grad(surrogate, pi: torch.Tensor) -> torch.Tensor:
    """∂(Σ_t surrogate_t)/∂ log π_t by autograd."""
    leaf = pi.clone().requires_grad_()
    surrogate(leaf).sum().backward()
    return leaf.grad


def _ppo_surrogate(log_r: torch.Tensor, adv: torch.Tensor, lo, hi) -> torch.Tensor:
    """PPO's -min(r·A, clip(r, lo, hi)·A); lo/hi may be tensors."""
    r = log_r.exp()
    return -torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    ("fn", "eps_low", "eps_high"), [(grpo_clip_coefficient, 0.2, 0.2), (clip_higher_coefficient, 0.2, 0.28)]
)
def test_grpo_and_clip_higher_match_surrogate(seed, fn, eps_low, eps_high):
    pi, mu, _, adv = _random_inputs(seed)
    grad = _surrogate_grad(lambda p: _ppo_surrogate(p - mu, adv, 1 - eps_low, 1 + eps_high), pi)
    coef = fn(pi, mu, adv)
    torch.testing.assert_close(grad, -adv * coef, rtol=1e-12, atol=1e-12)
    coef32 = fn(pi.float(), mu.float(), adv.float())
    assert coef32.dtype == torch.float32 and not coef32.requires_grad
    torch.testing.assert_close(coef32.double(), coef, rtol=1e-5, atol=1e-6)
    # Every region is exercised: unclipped, clipped above with A>0, clipped below with A<0.
    r = (pi - mu).exp()
    assert ((adv > 0) & (r > 1 + eps_high)).any() and ((adv < 0) & (r < 1 - eps_low)).any() and (coef > 0).any()


def test_grpo_clip_crafted():
    r = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1, 0.9, 1.25])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 1.0])
    mu = torch.full_like(r, math.log(0.2))
    pi = mu + r.log()
    expected = torch.tensor([0.0, 1.5, 0.0, 0.5, 1.1, 0.9, 0.0])
    torch.testing.assert_close(grpo_clip_coefficient(pi, mu, adv), expected)
    # Clip-Higher keeps r = 1.25 for A > 0 (1.25 < 1.28).
    expected[-1] = 1.25
    torch.testing.assert_close(clip_higher_coefficient(pi, mu, adv), expected)


def test_cispo_and_pg_is():
    pi, mu, _, adv = _random_inputs(2)
    # CISPO's surrogate: -A · sg(min(r, ε_max)) · log π.
    cap = lambda p: torch.clamp((p - mu).exp(), max=CISPO_EPS_MAX).detach()  # noqa: E731
    grad = _surrogate_grad(lambda p: -adv * cap(p) * p, pi)
    torch.testing.assert_close(grad, -adv * cispo_coefficient(pi, mu, adv), rtol=1e-12, atol=1e-12)
    assert CISPO_EPS_MAX == 5.0
    big = torch.tensor([0.0, -0.1]), torch.tensor([-5.0, -0.2])
    torch.testing.assert_close(cispo_coefficient(*big, torch.ones(2), eps_max=2.0), torch.tensor([2.0, math.exp(0.1)]))
    # Plain IS policy gradient: -A · r with r differentiable.
    grad = _surrogate_grad(lambda p: -adv * (p - mu).exp(), pi)
    torch.testing.assert_close(grad, -adv * pg_is_coefficient(pi, mu, adv), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [3, 4])
def test_minirl_matches_surrogate(seed):
    pi, mu, old, adv = _random_inputs(seed)
    is_weight = (old - mu).exp()
    grad = _surrogate_grad(lambda p: is_weight * _ppo_surrogate(p - old, adv, 0.8, 1.2), pi)
    coef = minirl_coefficient(pi, mu, adv, old)
    torch.testing.assert_close(grad, -adv * coef, rtol=1e-10, atol=1e-12)
    # The clip decision follows π/π_old, not π/μ: the two disagree somewhere in this sample.
    clipped_old = ((adv > 0) & ((pi - old).exp() > 1.2)) | ((adv < 0) & ((pi - old).exp() < 0.8))
    clipped_mu = ((adv > 0) & ((pi - mu).exp() > 1.2)) | ((adv < 0) & ((pi - mu).exp() < 0.8))
    assert (clipped_old != clipped_mu).any()
    assert (coef[clipped_old] == 0).all()
    torch.testing.assert_close(coef[~clipped_old], (pi - mu).exp()[~clipped_old])


def _eq12_mask(pi: torch.Tensor, anchor: torch.Tensor, adv: torch.Tensor, delta: float) -> torch.Tensor:
    keep = []
    for p, a, g in zip(pi.exp().tolist(), anchor.exp().tolist(), adv.tolist()):
        d = abs(p - a)
        keep.append(0.0 if (g > 0 and p > a and d > delta) or (g < 0 and p < a and d > delta) else 1.0)
    return torch.tensor(keep, dtype=torch.float64)


@pytest.mark.parametrize("cap", [2.0, math.inf])
def test_dppo_and_decoupled(cap):
    pi, mu, old, adv = _random_inputs(5)
    ratio = torch.clamp((pi - mu).exp(), max=cap)
    coef = dppo_coefficient(pi, mu, adv, ratio_cap=cap)
    torch.testing.assert_close(coef, ratio * _eq12_mask(pi, mu, adv, 0.15), rtol=1e-12, atol=0)
    decoupled = dppo_decoupled_coefficient(pi, mu, adv, old, ratio_cap=cap)
    torch.testing.assert_close(decoupled, ratio * _eq12_mask(pi, old, adv, 0.15), rtol=1e-12, atol=0)
    # Anchoring on π_old = μ recovers DPPO.
    torch.testing.assert_close(dppo_decoupled_coefficient(pi, mu, adv, mu, ratio_cap=cap), coef)
    # Same as the trust_region building blocks, and the KL/top-K kinds dispatch.
    div = binary_tv(pi, mu)
    blocks = ratio_coefficient(pi, mu, cap) * trust_region_mask(pi, mu, adv, div, 0.15, 0.15).double()
    torch.testing.assert_close(coef, blocks)
    kl = dppo_coefficient(pi, mu, adv, divergence="binary_kl", delta_low=0.05, delta_high=0.05)
    assert torch.isfinite(kl).all() and (kl == 0).any()
    pi_k = torch.stack([pi, torch.full_like(pi, -math.inf)], -1)
    mu_k = torch.stack([mu, torch.full_like(mu, -math.inf)], -1)
    topk = dppo_coefficient(pi, mu, adv, divergence="topk_tv", pi_topk_logps=pi_k, mu_topk_logps=mu_k, ratio_cap=cap)
    # With the sampled token alone in the set, top-K TV equals binary TV.
    torch.testing.assert_close(topk, coef)


@pytest.mark.parametrize("relax", ["low", "high", "both"])
def test_relaxed_clip_matches_surrogate(relax):
    pi, mu, _, adv = _random_inputs(6)
    alpha = 0.3
    rare = mu.exp() < alpha
    no_clip_low = rare & (relax in ("low", "both"))
    no_clip_high = rare & (relax in ("high", "both"))
    lo = torch.where(no_clip_low, torch.zeros_like(mu), torch.full_like(mu, 0.8))
    hi = torch.where(no_clip_high, torch.full_like(mu, math.inf), torch.full_like(mu, 1.2))
    grad = _surrogate_grad(lambda p: _ppo_surrogate(p - mu, adv, lo, hi), pi)
    coef = relaxed_clip_coefficient(pi, mu, adv, alpha=alpha, relax=relax)
    torch.testing.assert_close(grad, -adv * coef, rtol=1e-12, atol=1e-12)
    assert (coef != grpo_clip_coefficient(pi, mu, adv)).any()


def test_relaxed_clip_around_alpha():
    alpha = 0.1
    # μ just below / just above α; r = 0.5 with A < 0 (low clip), r = 1.5 with A > 0 (high clip).
    mu_p = torch.tensor([0.099, 0.101, 0.099, 0.101])
    r = torch.tensor([0.5, 0.5, 1.5, 1.5])
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0])
    mu = mu_p.log()
    pi = mu + r.log()
    expected = {
        "low": [0.5, 0.0, 0.0, 0.0],
        "high": [0.0, 0.0, 1.5, 0.0],
        "both": [0.5, 0.0, 1.5, 0.0],
    }
    for relax, values in expected.items():
        coef = relaxed_clip_coefficient(pi, mu, adv, alpha=alpha, relax=relax)
        torch.testing.assert_close(coef, torch.tensor(values))
    # α = 0 relaxes nothing: plain GRPO clipping.
    torch.testing.assert_close(relaxed_clip_coefficient(pi, mu, adv, alpha=0.0, relax="both"), torch.zeros(4))
    with pytest.raises(ValueError):
        relaxed_clip_coefficient(pi, mu, adv, alpha=alpha, relax="middle")


def test_no_overflow_dtype_and_detached():
    # π/μ = e^80 and beyond, bf16 inputs that require grad.
    pi = torch.tensor([0.0, 0.0, -1.0, -math.inf], dtype=torch.bfloat16, requires_grad=True)
    mu = torch.tensor([-80.0, -200.0, -math.inf, -math.inf], dtype=torch.bfloat16)
    old = torch.tensor([-0.1, -0.1, -1.0, -1.0], dtype=torch.bfloat16)
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0])
    for name, entry in TRUST_REGIONS.items():
        coef = _entry(name, pi, mu, adv, old if entry.needs_old_logps else None)
        assert coef.dtype == torch.float32 and not coef.requires_grad, name
        assert torch.isfinite(coef).all() and (coef >= 0).all(), (name, coef)
        assert coef[3] == 0, name  # π = 0: ratio 0
    assert pg_is_coefficient(pi, mu, adv)[0].item() == pytest.approx(math.exp(80), rel=1e-2)


def test_registry_dispatch():
    pi, mu, old, adv = _random_inputs(7, n=32)
    assert NEEDS_OLD_LOGPS == {"minirl", "dppo_decoupled"}
    assert {name for name, entry in TRUST_REGIONS.items() if entry.uses_top_k} == {"dppo"}
    fields = dict(epsilon=0.2, relax_alpha=0.1, divergence="binary_tv", ratio_cap=2.0)
    torch.testing.assert_close(_entry("grpo_clip", pi, mu, adv, **fields), grpo_clip_coefficient(pi, mu, adv))
    torch.testing.assert_close(
        _entry("clip_higher", pi, mu, adv, **fields), grpo_clip_coefficient(pi, mu, adv, 0.2, 0.28)
    )
    torch.testing.assert_close(
        _entry("relax_both", pi, mu, adv, **fields),
        relaxed_clip_coefficient(pi, mu, adv, alpha=0.1, relax="both", eps_low=0.2, eps_high=0.2),
    )
    torch.testing.assert_close(
        _entry("minirl", pi, mu, adv, old, epsilon=0.28), minirl_coefficient(pi, mu, adv, old, 0.28, 0.28)
    )
    torch.testing.assert_close(_entry("dppo", pi, mu, adv, **fields), dppo_coefficient(pi, mu, adv, ratio_cap=2.0))
    # Without a recompute the generating weights are the current ones: π_old = π.
    torch.testing.assert_close(_entry("minirl", pi, mu, adv), minirl_coefficient(pi, mu, adv, pi))
    with pytest.raises(TypeError):
        TRUST_REGIONS["ppo_kl"] = TRUST_REGIONS["dppo"]  # read-only: registered with `register_trust_region`


def test_register_trust_region_adds_one_entry_with_the_same_signature():
    from dppo_trl.core import registry

    @registry.register_trust_region("test_half_is", "half of π/μ")
    def _half(tokens, spec):
        return 0.5 * pg_is_coefficient(tokens.pi_logps, tokens.mu_logps, tokens.advantages)

    try:
        pi, mu, _, adv = _random_inputs(8, n=16)
        torch.testing.assert_close(_entry("test_half_is", pi, mu, adv), 0.5 * pg_is_coefficient(pi, mu, adv))
        with pytest.raises(ValueError, match="already registered"):
            registry.register_trust_region("test_half_is", "again")(_half)
    finally:
        del registry._REGISTRY["test_half_is"]


def test_docs_api_lists_the_registry():
    from pathlib import Path

    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text(encoding="utf-8")
    assert trust_region_table() in api, "docs/api.md's trust-region table is out of date: paste trust_region_table()"
