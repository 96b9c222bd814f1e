"""Truncated sampling without the engine: the core's π_kept, the overflow rule and the configs' choices.

The real-engine checks (fresh rollouts for top-k / top-p / min-p, overflow) are in tests/integration/test_truncated_sampling.py;
the gradient through GRPOTrainer's loss in tests/integration/test_loss_gradient.py.
"""

import math
import warnings

import pytest
import torch

from dppo_trl import DPPOConfig
from dppo_trl.core.functional import kept_log_mass, restrict_topk_to_kept
from dppo_trl.core.loss import LossInputs, policy_loss
from dppo_trl.core.metrics import trust_region_metrics
from dppo_trl.core.spec import TrustRegionSpec
from dppo_trl.trainers.kept_set import engine_lists, kept_set_overflow

NEG_INF = -math.inf


def _inputs(generator, **extra):
    shape = (3, 5)
    pi = torch.log_softmax(torch.randn(*shape, 7, generator=generator), -1)[..., 0].requires_grad_()
    mu = (pi.detach() + 0.05 * torch.randn(shape, generator=generator)).clamp(max=0.0)
    return LossInputs(
        pi_logps=pi,
        mu_logps=mu,
        advantages=torch.randn(3, generator=generator),
        tokens=torch.ones(shape, dtype=torch.bool),
        valid=torch.ones(shape, dtype=torch.bool),
        **extra,
    )


def test_kept_log_mass_is_the_kept_probability_with_its_gradient():
    logits = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    logps = torch.log_softmax(logits, -1)
    kept = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [1] * 6, [0] * 6], dtype=torch.bool)
    mass = kept_log_mass(logps, kept)
    want = torch.log((logps.exp() * kept).sum(-1))
    assert torch.allclose(mass[:3], want[:3]) and mass[3] == 0.0  # a row with no kept id: 0, not -inf
    assert mass[2].abs() < 1e-12  # the whole vocabulary kept: π_kept = π
    (grad,) = torch.autograd.grad(mass.sum(), logits)
    assert torch.isfinite(grad).all() and (grad[3] == 0).all()
    assert torch.autograd.gradcheck(lambda z: kept_log_mass(torch.log_softmax(z, -1), kept), (logits,))


def test_topk_lists_restricted_to_kept_ids():
    pi = torch.log(torch.tensor([[0.4, 0.2, 0.1, 0.05]]))
    mu = torch.tensor([[math.log(0.6), math.log(0.4), NEG_INF, NEG_INF]])
    restricted = restrict_topk_to_kept(pi, mu, torch.log(torch.tensor([0.6])))
    assert torch.allclose(restricted[0, :2].exp(), torch.tensor([0.4 / 0.6, 0.2 / 0.6]))
    assert (restricted[0, 2:] == NEG_INF).all()


@pytest.mark.parametrize("divergence", ["binary_tv", "binary_kl", "topk_tv", "topk_kl"])
def test_a_kept_set_holding_everything_changes_nothing_bit_for_bit(divergence):
    """Untruncated sampling is the field left `None`; a kept set whose mass is exactly 1 (log 0) and no overflow is
    the same loss, bit for bit: value, coefficient, divergence, stats and gradient."""
    spec = TrustRegionSpec(divergence=divergence, delta_low=0.01, delta_high=0.01, mu_kl_coef=0.1)
    outs, grads = [], []
    for kept in (False, True):
        generator = torch.Generator().manual_seed(0)
        extra = {}
        if divergence.startswith("topk_"):
            lists = torch.log_softmax(torch.randn(3, 5, 4, generator=generator), -1)
            extra = dict(pi_topk_logps=lists, mu_topk_logps=lists + 0.01)
        inputs = _inputs(generator, **extra)
        if kept:
            zeros = torch.zeros_like(inputs.mu_logps).requires_grad_()
            inputs = LossInputs(
                **{**inputs.__dict__, "kept_log_mass": zeros, "kept_overflow": torch.zeros_like(inputs.tokens)}
            )
        out = policy_loss(spec, inputs)
        (out.policy_loss.sum() + out.mu_kl.sum()).backward()
        outs.append(out)
        grads.append(inputs.pi_logps.grad)
    plain, kept = outs
    for name in ("policy_loss", "mu_kl", "coef", "divergence"):
        assert torch.equal(getattr(plain, name), getattr(kept, name)), name
    assert torch.equal(grads[0], grads[1])
    assert all(torch.equal(plain.stats[k], kept.stats[k]) for k in plain.stats)
    assert set(kept.stats) - set(plain.stats) == {"sum/kept_overflow"}


def test_overflow_positions_are_left_out_and_counted():
    spec = TrustRegionSpec(delta_low=0.01, delta_high=0.01)
    overflow = torch.zeros(3, 5, dtype=torch.bool)
    overflow[0, :2] = True
    inputs = _inputs(torch.Generator().manual_seed(1), kept_log_mass=torch.full((3, 5), -0.1), kept_overflow=overflow)
    out = policy_loss(spec, inputs)
    assert (out.coef[overflow] == 0).all() and (out.policy_loss[overflow] == 0).all()
    metrics = trust_region_metrics(out.stats, lambda t: t, lambda t: t)
    assert metrics["dppo/kept_set_overflow_ratio"] == pytest.approx(2 / 15)
    # π_kept = π / π(kept) is what the trust region compares: exp(0.1) larger than π.
    assert torch.allclose(inputs.compared_logps, inputs.pi_logps + 0.1)


def test_overflow_rule():
    lists = torch.tensor(
        [
            [[-0.1, -2.5, NEG_INF, NEG_INF]],  # 2 finite of N = 3: the kept set is listed
            [[-1.0, -0.9, -2.0, NEG_INF]],  # 3 finite: it may be larger
            [[-3.0, -0.5, -1.0, -2.0]],  # sampled outside the top 3: all 3 listed are kept, so more may be
            [[-0.1, float("nan"), NEG_INF, NEG_INF]],  # an unreported entry: unknown
        ]
    )
    assert kept_set_overflow(lists, 3, top_k=0).squeeze(-1).tolist() == [False, True, True, True]
    # Server mode: vLLM's OpenAI layer sends a dropped token's -inf as -9999.0.
    floored = torch.where(lists == NEG_INF, torch.full_like(lists, -9999.0), lists)
    assert torch.equal(engine_lists(floored).isinf(), lists.isinf())
    assert kept_set_overflow(engine_lists(floored), 3, top_k=0).squeeze(-1).tolist() == [False, True, True, True]
    # top_k ≤ N bounds the kept set: it always fits (an unreported entry still leaves it unknown).
    assert kept_set_overflow(lists, 3, top_k=3).squeeze(-1).tolist() == [False, False, False, True]


def _config(tmp_path, **kwargs):
    return DPPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "n"),
    [
        ({}, None),
        ({"top_k": 5}, 5),
        ({"top_p": 0.9}, 20),
        ({"min_p": 0.05, "top_k": 40}, 20),
        ({"top_p": 0.9, "vllm_mode": "server"}, 64),
        ({"top_k": 50, "vllm_mode": "server"}, 50),
        ({"top_p": 0.9, "kept_set_logprobs": 8}, 8),
        ({"top_k": 5, "divergence": "topk_tv", "divergence_top_k": 8}, 8),
        ({"generation_kwargs": {"top_p": 0.9}}, 20),
        ({"top_p": 0.9, "anchor": "recompute"}, None),
        ({"top_p": 0.9, "use_vllm": False}, None),
    ],
)
def test_kept_set_size(tmp_path, kwargs, n):
    kwargs = {"use_vllm": True, **kwargs}
    with warnings.catch_warnings():
        # Supported sampling warns about nothing (anchor='recompute' warns that it is an ablation).
        warnings.simplefilter("ignore" if kwargs.get("anchor") == "recompute" else "error", UserWarning)
        config = _config(tmp_path, **kwargs)
    assert config.kept_set_size == n


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 50}, "top_k=50 keeps 50 tokens at every position.*Use top_k ≤ 20"),
        ({"top_p": 0.9, "kept_set_logprobs": 21}, "kept_set_logprobs=21 exceeds vLLM's `max_logprobs`"),
        ({"top_p": 0.9, "kept_set_logprobs": 0}, "kept_set_logprobs must be ≥ 1"),
        ({"repetition_penalty": 1.1}, "repetition_penalty=1.1 reshapes.*Set repetition_penalty=1.0"),
        ({"generation_kwargs": {"presence_penalty": 0.5}}, "presence_penalty=0.5 reshapes"),
    ],
)
def test_unsupported_sampling_is_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, use_vllm=True, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "n"),
    [
        ({}, None),
        ({"top_p": 0.9}, 64),
        ({"top_k": 5}, 5),
        ({"top_k": 100, "min_p": 0.1}, 64),
        ({"top_p": 0.9, "kept_set_logprobs": 8}, 8),
        ({"top_p": 0.9, "divergence": "topk_tv", "divergence_top_k": 8, "kept_set_logprobs": 4}, 8),
    ],
)
def test_async_config_kept_set_size_is_server_modes(tmp_path, kwargs, n):
    """AsyncDPPOConfig chooses N as DPPOConfig does in server mode (same function), without a warning."""
    from dppo_trl import AsyncDPPOConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        config = AsyncDPPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)
    assert config.kept_set_size == n
    sync = _config(tmp_path, use_vllm=True, vllm_mode="server", **kwargs)
    assert sync.kept_set_size == n


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 100}, "top_k=100 keeps 100 tokens at every position.*kept_set_logprobs ≥ top_k"),
        ({"top_p": 0.9, "kept_set_logprobs": 0}, "kept_set_logprobs must be ≥ 1"),
        ({"repetition_penalty": 1.1}, "repetition_penalty=1.1 reshapes"),
    ],
)
def test_async_config_refuses_what_no_kept_set_fixes(tmp_path, kwargs, message):
    from dppo_trl import AsyncDPPOConfig

    with pytest.raises(ValueError, match=message):
        AsyncDPPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)
