"""`dppo_trl.kernels.engine_view`: the model helpers read the backbone and head a fused loss reads (a plain, a tied and a
PEFT model, whose logits they rebuild exactly), `full` gathers a real DTensor, and `engine_list_view` gives π at the
engine's listed ids: against float64 in the precisions users train in, entering the head gather it is given around
every read of the head (the kept set's backward included), and refusing to run without hidden states."""

import contextlib
import math

import pytest
import torch

from dppo_dev.tiny_models import build_tiny_model
from dppo_trl.core.functional import kept_log_mass
from dppo_trl.kernels.engine_view import (
    backbone,
    causal_lm,
    engine_list_view,
    full,
    last_hidden_state,
    lm_head,
    logit_transform,
)
from dppo_trl.kernels.topk_logps import LogitTransform

IDS = torch.tensor([[5, 17, 42, 9, 200, 31]])


@pytest.mark.parametrize("kind", ["untied", "tied", "peft"])
def test_model_helpers_rebuild_the_models_logits(kind):
    """The backbone's last hidden state through `lm_head` and `logit_transform` is the model's own logits, for a plain,
    a tied and a PEFT model (whose head and backbone are the wrapped base model's)."""
    model, _ = build_tiny_model(tie_word_embeddings=kind == "tied")
    base = model
    if kind == "peft":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert causal_lm(model) is base and backbone(model) is base.model
    weight, bias = lm_head(model)
    assert weight is base.get_output_embeddings().weight and bias is None
    if kind == "tied":
        assert weight is base.get_input_embeddings().weight
    with torch.no_grad():
        output = backbone(model)(input_ids=IDS)
        hidden = last_hidden_state(output)
        assert torch.equal(hidden, last_hidden_state(output.to_tuple()))
        logits = logit_transform(model, temperature=0.7)(hidden @ weight.t())
        torch.testing.assert_close(logits, model(input_ids=IDS).logits / 0.7, atol=1e-6, rtol=1e-6)
    assert logit_transform(model, 0.7) == LogitTransform(temperature=0.7)


def test_full_gathers_a_dtensor_and_passes_the_rest():
    """FSDP2's sharded parameters are DTensors: `full` returns the whole tensor (one rank here, a real gloo group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    whole = torch.arange(12.0).view(4, 3)
    assert full(whole) is whole and full(None) is None
    # An in-process vLLM engine started earlier in the session leaves its one-rank group behind; reuse it then.
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.get_world_size() == 1
        sharded = distribute_tensor(whole, init_device_mesh("cpu", (1,)), [Shard(0)])
        gathered = full(sharded)
        assert type(gathered) is torch.Tensor and torch.equal(gathered, whole)
    finally:
        if created:
            dist.destroy_process_group()


def _lists(generator, vocab=50, hidden_size=8, width=4):
    hidden = torch.randn(2, 3, hidden_size, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=generator, requires_grad=True)
    bias = torch.randn(vocab, generator=generator, requires_grad=True)
    full_logps = torch.log_softmax(hidden @ weight.t() + bias, -1)
    ids = torch.stack([torch.randperm(vocab, generator=generator)[:width] for _ in range(6)]).view(2, 3, width)
    ids[0, 1, 2:] = -1  # a short list
    pi_lists = full_logps.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, -math.inf)
    kept = (ids >= 0) & (torch.arange(width) < 3)
    mu_lists = pi_lists.detach().masked_fill(~kept, -math.inf)
    return hidden, weight, bias, ids, mu_lists, pi_lists[..., 0], full_logps


def test_engine_list_view_enters_the_head_gather_around_every_read():
    """The gather (TRL's `maybe_gather_lm_head_ctx` under ZeRO-3) is entered with the head's parameters for the lists'
    read, and again in the kept set's backward, which runs after the caller's own contexts have closed."""
    generator = torch.Generator().manual_seed(0)
    hidden, weight, bias, ids, mu_lists, pi_logps, full_logps = _lists(generator)
    valid = torch.ones(2, 3, dtype=torch.bool)
    entered = []

    @contextlib.contextmanager
    def gather(*params):
        entered.append(params)
        yield

    args = (hidden, weight, bias, LogitTransform(), ids, mu_lists, pi_logps, valid)
    topk = engine_list_view(*args, kept_set=False, top_k=2, gather=gather)
    assert len(entered) == 1 and entered[0][0] is weight and entered[0][1] is bias
    want = full_logps.detach().gather(-1, ids[..., :3].clamp(min=0)).masked_fill(ids[..., :3] < 0, -math.inf)
    torch.testing.assert_close(topk.pi_topk_logps, want)
    view = engine_list_view(*args, kept_set=True, top_k=None, gather=gather)
    assert len(entered) == 2
    view.kept_log_mass.sum().backward()
    assert len(entered) == 3 and all(p[0] is weight for p in entered)
    expected = kept_log_mass(
        full_logps.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, -math.inf), ~mu_lists.isinf()
    )
    torch.testing.assert_close(view.kept_log_mass, expected.detach())


def test_engine_list_view_needs_hidden_states():
    generator = torch.Generator().manual_seed(0)
    _, weight, bias, ids, mu_lists, pi_logps, _ = _lists(generator)
    with pytest.raises(RuntimeError, match="needs the policy's final hidden states"):
        engine_list_view(
            None, weight, bias, LogitTransform(), ids, mu_lists, pi_logps, torch.ones(2, 3, dtype=torch.bool),
            kept_set=False, top_k=2,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# π at the engine's lists in the precision users train in
# ---------------------------------------------------------------------------------------------------------------------

# bf16's unit roundoff: 8 significant bits, so one rounding moves a value by at most 2^-8 of itself.
U_BF16 = 2.0**-8
PRECISIONS = {
    "fp32": (torch.float32, False),
    # float32 weights; the fused head's tiles run in bf16 under autocast (as in a bf16-autocast forward).
    "fp32-weights-bf16-autocast": (torch.float32, True),
    "bf16-weights": (torch.bfloat16, False),
}


@pytest.mark.parametrize("kept_set", [False, True], ids=["topk-lists", "kept-set"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_engine_list_view_in_bf16_against_float64(precision, kept_set):
    """`engine_list_view` as the trainers call it: log π(y) from TRL's own fused head (its chunked log-prob kernel,
    in the precision given), then π at the engine's listed ids from the same hidden states and head rows, top-K lists
    and (truncated sampling) the kept set's log-mass with its gradient, against the full float64 softmax of the very
    inputs given.

    What bf16 can promise (u = 2^-8): the gather itself upcasts its bf16 inputs and works in float32, exactly but for
    float32 rounding; log π(y) comes from TRL's head, whose logit tiles are bf16 GEMM outputs (≤ u·|z| each) under
    bf16, so every listed log-prob inherits that: allowed 4u·max(1, max|z|) (measured ≤ 0.64u·max|z|). The kept mass's
    gradient flows through both kernels' bf16 GEMMs and is rounded once more to the parameters' dtype: allowed 8u of
    each gradient's norm (measured ≤ 2.1u; the head's and the gather's parts partly cancel, which
    tests/unit/test_topk_logps.py::test_logps_at_ids_with_grad_in_bf16 bounds by the parts). float32: 2e-5 and 1e-4 (summation order over H = 64 and V = 301)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from dppo_trl.kernels.engine_view import engine_list_view
    from dppo_trl.kernels.topk_logps import LogitTransform

    dtype, autocast = PRECISIONS[precision]
    generator = torch.Generator().manual_seed(0)
    batch, length, hidden_size, vocab, width, top_k = 2, 5, 64, 301, 5, 2
    hidden = torch.randn(batch, length, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(vocab, hidden_size, generator=generator)).to(dtype).requires_grad_()
    transform = LogitTransform(temperature=0.7)
    full64 = torch.log_softmax(transform(hidden.double() @ weight.double().t()), -1)
    sampled = torch.multinomial(full64.detach().exp().view(-1, vocab), 1, generator=generator).view(batch, length)
    others = torch.stack([torch.randperm(vocab, generator=generator)[: width - 1] for _ in range(batch * length)])
    ids = torch.cat([sampled.view(-1, 1), others], dim=1).view(batch, length, width)
    ids[0, 1, 3:] = -1  # a short list
    kept = (torch.rand(ids.shape, generator=generator) < 0.7) | (torch.arange(width) == 0)
    kept &= ids >= 0
    pi_lists64 = full64.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, -math.inf)
    mu_lists = (pi_lists64.detach() + 0.05 * torch.randn(ids.shape, generator=generator, dtype=torch.float64)).float()
    if kept_set:
        mu_lists = mu_lists.masked_fill(~kept, -math.inf)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, 4] = False  # a token whose μ is invalid: padding on both sides

    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        flat = hidden.reshape(-1, hidden_size)
        pi_logps = ChunkedLogProbFunction.apply(
            flat, weight, None, sampled.reshape(-1), transform.temperature, 64, None, 1.0, ()
        )[0].view(batch, length)
        view = engine_list_view(
            hidden, weight, None, transform, ids, mu_lists, pi_logps, valid, kept_set=kept_set, top_k=top_k
        )

    low_precision = dtype == torch.bfloat16 or autocast
    max_logit = transform(hidden.double() @ weight.double().t()).abs().max().item()
    tolerance = 4 * U_BF16 * max(1.0, max_logit) if low_precision else 2e-5
    listed = valid.unsqueeze(-1) & (ids >= 0)
    want_topk = pi_lists64[..., : top_k + 1].detach()
    assert view.pi_topk_logps.dtype == torch.float32 and not view.pi_topk_logps.requires_grad
    assert torch.isneginf(view.pi_topk_logps[~listed[..., : top_k + 1]]).all()
    error = (view.pi_topk_logps.double() - want_topk)[listed[..., : top_k + 1]].abs().max().item()
    assert error <= tolerance, error / U_BF16
    assert torch.equal(view.mu_topk_logps[valid], mu_lists[..., : top_k + 1][valid])
    if not kept_set:
        assert view.kept_log_mass is None
        return
    kept_mass64 = kept_log_mass(pi_lists64, kept & valid.unsqueeze(-1))
    assert (view.kept_log_mass.double() - kept_mass64.detach())[valid].abs().max().item() <= tolerance
    weights = torch.randn(batch, length, generator=generator).masked_fill(~valid, 0.0)
    grads = torch.autograd.grad((view.kept_log_mass * weights).sum(), (hidden, weight))
    hidden64, weight64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    full = torch.log_softmax(transform(hidden64 @ weight64.t()), -1)
    mass = kept_log_mass(full.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, -math.inf), kept & valid.unsqueeze(-1))
    expected = torch.autograd.grad((mass * weights.double()).sum(), (hidden64, weight64))
    for name, grad, want, given in zip(("hidden", "weight"), grads, expected, (hidden, weight), strict=True):
        assert grad.dtype == given.dtype, name
        relative = ((grad.double() - want).norm() / want.norm()).item()
        assert relative <= (8 * U_BF16 if low_precision else 1e-4), (name, relative / U_BF16)
