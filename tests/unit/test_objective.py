"""`dppo_trl.core.loss.policy_loss`, the loss both trainers call, against naive per-token references."""

import functools
import math

import pytest
import torch

from dppo_trl.core import baselines
from dppo_trl.core.functional import binary_kl, compute_divergence, dppo_coefficient, topk_tv
from dppo_trl.core.loss import COEF_MAX, LossInputs, policy_loss
from dppo_trl.core.metrics import observer_record, trust_region_metrics, trust_region_stats
from dppo_trl.core.registry import TRUST_REGIONS
from dppo_trl.core.spec import TrustRegionSpec
from dppo_trl.trainers.trl116.grpo import aggregate_per_token_loss

TokenView = LossInputs


def _args(**overrides):
    base = dict(
        trust_region="dppo",
        divergence="binary_tv",
        delta_low=0.05,
        delta_high=0.02,
        ratio_cap=3.0,
        epsilon=0.2,
        relax_alpha=0.1,
        mu_kl_coef=0.0,
    )
    return TrustRegionSpec(**{**base, **overrides})


def trust_region_coefficient(spec, view):
    outputs = policy_loss(spec, view)
    return outputs.coef, outputs.divergence


def _stats(spec, view, coef, div, max_staleness=None):
    spec = TrustRegionSpec(**{**spec.__dict__, "max_staleness": max_staleness})
    return trust_region_stats(spec, view, coef, div, spec.effective_divergence(view.has_topk))


def _relaxed(side, pi, mu, adv, old, s):
    return baselines.relaxed_clip_coefficient(pi, mu, adv, s.relax_alpha, side, s.epsilon, s.epsilon)


# What each registry entry computes, written with the math functions and the spec's fields.
_EXPECTED = {
    "dppo": lambda pi, mu, adv, old, s: dppo_coefficient(
        pi, mu, adv, s.divergence, s.delta_low, s.delta_high, s.ratio_cap
    ),
    "grpo_clip": lambda pi, mu, adv, old, s: baselines.grpo_clip_coefficient(pi, mu, adv, s.epsilon, s.epsilon),
    "clip_higher": lambda pi, mu, adv, old, s: baselines.grpo_clip_coefficient(pi, mu, adv, s.epsilon, 0.28),
    "cispo": lambda pi, mu, adv, old, s: baselines.cispo_coefficient(pi, mu, adv),
    "pg_is": lambda pi, mu, adv, old, s: baselines.pg_is_coefficient(pi, mu, adv),
    "minirl": lambda pi, mu, adv, old, s: baselines.minirl_coefficient(pi, mu, adv, old, s.epsilon, s.epsilon),
    "dppo_decoupled": lambda pi, mu, adv, old, s: baselines.dppo_decoupled_coefficient(
        pi, mu, adv, old, s.divergence, s.delta_low, s.delta_high, s.ratio_cap
    ),
    **{f"relax_{side}": functools.partial(_relaxed, side) for side in ("low", "high", "both")},
}


def _view(seed=0, batch=4, length=7, **extra):
    g = torch.Generator().manual_seed(seed)
    pi = torch.log(torch.rand(batch, length, generator=g).clamp(min=1e-4))
    mu = (pi + 0.6 * torch.randn(batch, length, generator=g)).clamp(max=0.0)
    tokens = torch.rand(batch, length, generator=g) > 0.15
    valid = torch.rand(batch, length, generator=g) > 0.1
    mu = torch.where(valid, mu, torch.zeros_like(mu))  # sanitised: finite where invalid
    adv = torch.tensor([1.0, -1.0, 0.0, 0.5][:batch]).unsqueeze(1)
    return TokenView(pi_logps=pi, mu_logps=mu, advantages=adv, tokens=tokens, valid=valid, **extra)


def _identity(t):
    return t


@pytest.mark.parametrize("divergence", ["binary_tv", "binary_kl"])
def test_dppo_coefficient_and_divergence_match_the_equations(divergence):
    args = _args(divergence=divergence)
    view = _view()
    coef, div = trust_region_coefficient(args, view)
    want_div = compute_divergence(divergence, view.pi_logps, view.mu_logps)
    assert torch.equal(div, want_div)
    want = dppo_coefficient(
        view.pi_logps, view.mu_logps, view.advantages.expand_as(view.pi_logps), divergence, 0.05, 0.02, 3.0
    )
    counted = view.tokens & view.valid
    assert torch.equal(coef, torch.where(counted, want, torch.zeros_like(want)))
    assert (coef[counted] == 0).any() and (coef[counted] > 0).any(), "both regimes exercised"
    assert not coef.requires_grad


@pytest.mark.parametrize("name", sorted(TRUST_REGIONS))
def test_every_registry_entry_goes_through_the_core(name):
    entry = TRUST_REGIONS[name]
    args = _args(trust_region=name)
    view = _view(seed=1)
    old = (view.pi_logps + 0.2).clamp(max=0.0)
    if entry.needs_old_logps:
        view = TokenView(**{**view.__dict__, "old_logps": old})
    coef, div = trust_region_coefficient(args, view)
    want = _EXPECTED[name](view.pi_logps, view.mu_logps, view.advantages.expand_as(view.pi_logps), old, args)
    want = torch.where(view.tokens & view.valid, want.clamp(max=COEF_MAX), torch.zeros_like(want))
    assert torch.equal(coef, want.float())
    assert torch.equal(div, compute_divergence("binary_tv", view.pi_logps, view.mu_logps))


def test_topk_divergence_uses_the_topk_tensors_and_falls_back_without_them():
    g = torch.Generator().manual_seed(2)
    view = _view(seed=2)
    pi_k = torch.log_softmax(torch.randn(4, 7, 6, generator=g), -1)[..., :4]
    mu_k = torch.log_softmax(torch.randn(4, 7, 6, generator=g), -1)[..., :4]
    args = _args(divergence="topk_tv")
    with_topk = TokenView(**{**view.__dict__, "pi_topk_logps": pi_k, "mu_topk_logps": mu_k})
    coef, div = trust_region_coefficient(args, with_topk)
    assert torch.equal(div, topk_tv(pi_k, mu_k))
    keep_ref = dppo_coefficient(
        view.pi_logps, view.mu_logps, view.advantages.expand(4, 7), "topk_tv", 0.05, 0.02, 3.0, pi_k, mu_k
    )
    assert torch.equal(coef, torch.where(view.tokens & view.valid, keep_ref, torch.zeros_like(keep_ref)))
    # μ ≡ π without top-K tensors (on-policy): D = 0 and nothing is masked.
    same = TokenView(**{**view.__dict__, "mu_logps": view.pi_logps, "valid": torch.ones_like(view.valid)})
    coef, div = trust_region_coefficient(args, same)
    assert torch.equal(div, torch.zeros_like(div))
    assert torch.equal(coef, view.tokens.float())


def _naive_metrics(args, view, coef, div, staleness=None, max_staleness=None):
    """Token-by-token Python reference of the documented `dppo/*` metrics."""
    B, T = view.pi_logps.shape
    rows = []
    for b in range(B):
        for t in range(T):
            if not view.tokens[b, t]:
                continue
            rows.append((b, t))
    counted = [(b, t) for b, t in rows if view.valid[b, t]]

    def mean(values):
        return sum(values) / len(values) if values else 0.0

    def pi(b, t):
        return math.exp(float(view.pi_logps[b, t]))

    def mu(b, t):
        return math.exp(float(view.mu_logps[b, t]))

    adv = view.advantages.expand(B, T)
    masked = [(b, t) for b, t in counted if coef[b, t] <= 0]
    out = {
        "dppo/mask_ratio": len(masked) / len(counted),
        "dppo/mask_ratio_pos_adv": mean([float(coef[b, t] <= 0) for b, t in counted if adv[b, t] > 0]),
        "dppo/mask_ratio_neg_adv": mean([float(coef[b, t] <= 0) for b, t in counted if adv[b, t] < 0]),
        "dppo/divergence_mean": mean([float(div[b, t]) for b, t in counted]),
        "dppo/divergence_max": max(float(div[b, t]) for b, t in counted),
        "dppo/mismatch_abs_mean": mean([abs(pi(b, t) - mu(b, t)) for b, t in counted]),
        "dppo/mismatch_abs_max": max(abs(pi(b, t) - mu(b, t)) for b, t in counted),
        "dppo/mismatch_kl_mean": mean(
            [float(binary_kl(view.pi_logps[b, t], view.mu_logps[b, t])) for b, t in counted]
        ),
        "dppo/ratio_mean": mean([pi(b, t) / mu(b, t) for b, t in counted]),
        "dppo/ratio_max": max(pi(b, t) / mu(b, t) for b, t in counted),
        "dppo/ratio_capped_frac": mean([float(pi(b, t) / mu(b, t) > args.ratio_cap) for b, t in counted]),
        "dppo/invalid_behavior_ratio": 1 - len(counted) / len(rows),
        "dppo/masked_mu_prob_mean": mean([mu(b, t) for b, t in masked]),
    }
    if args.mu_kl_coef > 0:
        out["dppo/mu_kl_mean"] = mean([float(view.pi_logps[b, t] - view.mu_logps[b, t]) ** 2 for b, t in counted])
    if staleness is not None:
        full = staleness if staleness.dim() == 2 else staleness.unsqueeze(1).expand(B, T)
        for s in range(max_staleness + 1):
            bucket = [(b, t) for b, t in counted if min(int(full[b, t]), max_staleness) == s]
            if bucket:
                out[f"dppo/staleness_{s}/mask_ratio"] = mean([float(coef[b, t] <= 0) for b, t in bucket])
                out[f"dppo/staleness_{s}/mismatch_abs_mean"] = mean([abs(pi(b, t) - mu(b, t)) for b, t in bucket])
    return out


def _assert_metrics_close(got, want):
    assert set(got) == set(want), set(got) ^ set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("staleness_shape", [None, "row", "token"])
def test_metrics_match_a_naive_reference(staleness_shape):
    args = _args(mu_kl_coef=1e-3)
    g = torch.Generator().manual_seed(3)
    staleness = {
        None: None,
        "row": torch.tensor([0, 2, 2, 5]),  # 5 > max_staleness: lands in the last bucket
        "token": torch.randint(0, 3, (4, 7), generator=g),  # bucket 3 stays empty: not reported
    }[staleness_shape]
    view = _view(seed=3, staleness=staleness)
    coef, div = trust_region_coefficient(args, view)
    stats = _stats(args, view, coef, div, max_staleness=3)
    got = trust_region_metrics(stats, _identity, _identity)
    _assert_metrics_close(got, _naive_metrics(args, view, coef, div, staleness, 3))
    if staleness_shape == "row":
        assert "dppo/staleness_3/mask_ratio" in got and "dppo/staleness_1/mask_ratio" not in got


def test_metrics_reduce_over_processes_like_one_big_batch():
    """Two 'processes' (halves of a batch) reduced with the callables give the metrics of the whole batch."""
    args = _args()
    view = _view(seed=4, batch=4, staleness=torch.tensor([0, 1, 0, 1]))
    coef, div = trust_region_coefficient(args, view)
    whole = trust_region_metrics(_stats(args, view, coef, div, max_staleness=1), _identity, _identity)

    def half(rows):
        part = TokenView(**{k: (v[rows] if torch.is_tensor(v) else v) for k, v in view.__dict__.items()})
        return _stats(args, part, coef[rows], div[rows], max_staleness=1)

    first, second = half(slice(0, 2)), half(slice(2, 4))

    def stacked(stats, prefix):
        return torch.stack([v.float() for k, v in stats.items() if k.startswith(prefix)])

    got = trust_region_metrics(
        first,
        reduce_sum=lambda t: t + stacked(second, "sum/"),
        reduce_max=lambda t: torch.maximum(t, stacked(second, "max/")),
    )
    _assert_metrics_close(got, whole)


def test_binary_kl_is_not_computed_twice_when_it_is_the_divergence(monkeypatch):
    import dppo_trl.core.metrics as metrics

    calls = []
    real = metrics.binary_kl
    monkeypatch.setattr(metrics, "binary_kl", lambda *a: calls.append(1) or real(*a))
    policy_loss(_args(divergence="binary_kl"), _view(seed=5))
    assert calls == []


def test_observer_record_and_mu_kl_per_token():
    view = _view(seed=6, entropies=torch.rand(4, 7))
    args = _args(mu_kl_coef=0.5)
    coef, div = trust_region_coefficient(args, view)
    record = observer_record(view, coef, div)
    assert torch.equal(record["valid"], view.tokens & view.valid)
    assert torch.equal(record["keep"], (coef > 0).float())
    assert record["advantages"].shape == (4, 7)

    pi = view.pi_logps.clone().requires_grad_(True)
    mu = view.mu_logps.clone()
    mu[~view.valid] = float("nan")  # unsanitised μ must still give 0, not NaN
    outputs = policy_loss(args, LossInputs(**{**view.__dict__, "pi_logps": pi, "mu_logps": mu}))
    penalty = outputs.mu_kl
    counted = view.tokens & view.valid
    assert all(torch.isfinite(v).all() for v in outputs.stats.values())
    want = torch.where(counted, 0.5 * (view.pi_logps - mu) ** 2, torch.zeros_like(mu))
    assert torch.allclose(penalty, want)
    penalty.sum().backward()
    assert torch.allclose(pi.grad, torch.where(counted, (view.pi_logps - mu), torch.zeros_like(mu)))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo", "luspo"])
@pytest.mark.parametrize("training", [True, False])
def test_aggregation_matches_the_written_normalisers(loss_type, training):
    g = torch.Generator().manual_seed(7)
    per_token = torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    mask[1] = 0  # an empty row
    got = aggregate_per_token_loss(
        per_token,
        mask,
        loss_type,
        max_completion_length=8,
        num_items_in_batch=torch.tensor(40.0),
        num_processes=2,
        gradient_accumulation_steps=4,
        steps_per_generation=2,
        training=training,
    )
    gas = 4 if training else 1
    rows = [
        sum(per_token[b, t].item() for t in range(5) if mask[b, t]) / max(1.0, mask[b].sum().item()) for b in range(3)
    ]
    total = sum(per_token[b, t].item() for b in range(3) for t in range(5) if mask[b, t])
    want = {
        "grpo": sum(rows) / 3 / gas,
        "bnpo": total / mask.sum().item() / gas,
        "dr_grpo": total / (3 * 8) / gas,
        "dapo": total / (40.0 / 2 * (4 / 2 if training else 1)),
        "luspo": sum(sum(per_token[b, t].item() for t in range(5) if mask[b, t]) for b in range(3)) / 3 / gas,
    }[loss_type]
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_sequence_advantages_of_shape_b_are_one_value_per_row():
    view = _view(seed=8)
    flat = TokenView(**{**view.__dict__, "advantages": view.advantages.squeeze(1)})
    args = _args()
    assert all(
        torch.equal(a, b) for a, b in zip(trust_region_coefficient(args, view), trust_region_coefficient(args, flat))
    )
    coef, div = trust_region_coefficient(args, view)
    assert _stats(args, flat, coef, div).keys() == _stats(args, view, coef, div).keys()
    assert torch.equal(observer_record(flat, coef, div)["advantages"], observer_record(view, coef, div)["advantages"])


def test_packed_token_lists_give_the_same_metrics():
    """The asynchronous trainer packs tokens as flat `(N,)` lists: the core is element-wise, so flattening the
    counted tokens (with per-token advantages and staleness) gives the same coefficient and metrics."""
    args = _args(mu_kl_coef=1e-3)
    view = _view(seed=9, staleness=torch.tensor([0, 1, 2, 1]))
    coef, div = trust_region_coefficient(args, view)
    keep = view.tokens
    packed = TokenView(
        pi_logps=view.pi_logps[keep],
        mu_logps=view.mu_logps[keep],
        advantages=view.advantages.expand(4, 7)[keep],
        tokens=torch.ones(int(keep.sum()), dtype=torch.bool),
        valid=view.valid[keep],
        staleness=view.staleness.unsqueeze(1).expand(4, 7)[keep],
    )
    packed_coef, packed_div = trust_region_coefficient(args, packed)
    assert torch.equal(packed_coef, coef[keep]) and torch.equal(packed_div, div[keep])
    got = trust_region_metrics(_stats(args, packed, packed_coef, packed_div, max_staleness=2), _identity, _identity)
    want = trust_region_metrics(_stats(args, view, coef, div, max_staleness=2), _identity, _identity)
    _assert_metrics_close(got, want)


@pytest.mark.parametrize("name", sorted(TRUST_REGIONS))
def test_policy_loss_is_eq_11_in_value_and_gradient(name):
    """The per-token loss is −A·w in value and −A·w·∇log π in gradient, 0 outside the counted tokens, for every
    registry entry; the μ-KL term adds τ·(log π − log μ)² and its gradient."""
    view = _view(seed=10)
    old = (view.pi_logps + 0.2).clamp(max=0.0)
    pi = view.pi_logps.clone().requires_grad_(True)
    spec = _args(trust_region=name, mu_kl_coef=0.1)
    outputs = policy_loss(spec, LossInputs(**{**view.__dict__, "pi_logps": pi, "old_logps": old}))
    adv = view.advantages.expand_as(pi)
    counted = view.tokens & view.valid
    assert torch.allclose(outputs.policy_loss, -adv * outputs.coef)
    assert torch.equal(outputs.policy_loss[~counted], torch.zeros_like(pi)[~counted])
    (outputs.policy_loss + outputs.mu_kl).sum().backward()
    want = -adv * outputs.coef + torch.where(counted, 0.2 * (view.pi_logps - view.mu_logps), torch.zeros_like(pi))
    assert torch.allclose(pi.grad, want, atol=1e-6)


def test_spec_resolves_defaults_once_and_validates():
    assert TrustRegionSpec().delta_low == 0.15 and TrustRegionSpec(divergence="binary_kl").delta_high == 0.05
    assert TrustRegionSpec().ratio_cap == 20.0
    with pytest.raises(ValueError, match="ratio_cap"):
        TrustRegionSpec(ratio_cap=math.inf)
    with pytest.raises(ValueError, match="sampled-token baseline"):
        TrustRegionSpec(trust_region="grpo_clip", divergence="topk_tv")


def test_the_core_computes_a_loss_with_trl_absent():
    """`dppo_trl.core` imports torch only: in a process where `trl`, `transformers`, `accelerate`, `peft` and `vllm`
    cannot be imported, the loss is computed and differentiated."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {"trl", "transformers", "accelerate", "peft", "vllm", "datasets"}:
                    raise ImportError(f"{name} is blocked")

        sys.meta_path.insert(0, Block())
        import torch
        from dppo_trl.core.loss import LossInputs, policy_loss
        from dppo_trl.core.spec import TrustRegionSpec

        pi = torch.log(torch.tensor([[0.5, 0.2, 0.9]])).requires_grad_(True)
        mu = torch.log(torch.tensor([[0.3, 0.25, 0.9]]))
        ones = torch.ones(1, 3, dtype=torch.bool)
        out = policy_loss(TrustRegionSpec(divergence="binary_kl"), LossInputs(pi, mu, torch.tensor([1.0]), ones, ones))
        out.policy_loss.sum().backward()
        assert torch.isfinite(pi.grad).all()
        loaded = {m.split(".")[0] for m in sys.modules}
        assert not loaded & {"trl", "transformers", "accelerate", "peft", "vllm"}, loaded
        print("ok", out.coef.tolist())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr[-2000:]
