"""`use_liger_kernel=True` can never silently turn DPPO into GRPO, nor drop an MoE model's router aux loss.

TRL ≤ 1.8 routed `compute_loss` to Liger's fused GRPO loss when `use_liger_kernel=True`, which bypassed any
subclass's loss (and, on TRL releases that still have that route, the MoE aux loss: trl#7009). In TRL 1.16 the flag
only applies Liger's Triton *layer* kernels (RMSNorm, SwiGLU, RoPE, fused experts) and the loss is always
`_compute_loss`, where DPPO's trust region is applied and the aux loss added. transformers applies those kernels in
`Trainer.train()` (`apply_liger_kernel(self.model, self.args.liger_kernel_config)`, pinned in tests/trl_contract.py),
not when the trainer is built. These tests pin that, refuse the flag where Triton cannot run (CPU) and where Liger
would bypass LoRA on fused experts (before the model loads), check on CPU what `train()` would apply, and, on CUDA,
apply Liger exactly as `train()` does and compare the DPPO gradient and the router aux loss with Liger on against the
same model with Liger off.
"""

import inspect
import math

import pytest
import torch
from peft import LoraConfig
from trl import GRPOTrainer

from dppo_trl import DPPOConfig

EXPERT_LORA = LoraConfig(
    r=2,
    target_modules=["q_proj"],
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    task_type="CAUSAL_LM",
)


def test_trl_routes_no_loss_through_liger():
    for name in ("compute_loss", "_compute_loss"):
        source = inspect.getsource(getattr(GRPOTrainer, name)).lower()
        assert "liger" not in source, f"GRPOTrainer.{name} references Liger again: DPPO's loss could be bypassed"
    assert not hasattr(GRPOTrainer, "compute_liger_loss")


def test_refused_without_cuda(tiny_model_dir, tmp_path):
    """The config builds anywhere (a GPU config can be prepared on CPU); the trainer refuses a non-CUDA device, after
    GRPOTrainer's own checks (their order is tested in tests/integration/test_drop_in.py)."""
    from trainer_setup import make_trainer

    assert DPPOConfig(output_dir=str(tmp_path), use_cpu=True, use_liger_kernel=True).use_liger_kernel
    with pytest.raises(ValueError, match="use_liger_kernel=True applies Liger's Triton layer kernels.*runs on 'cpu'"):
        make_trainer(tiny_model_dir, tmp_path, use_liger_kernel=True)


def test_expert_lora_refused_before_the_model_loads(tmp_path):
    """Liger's SwiGLU kernel replaces the experts' forward, which with `target_parameters` is PEFT's adapter wrapper:
    refused on any device, before the model (here a path that does not exist) is loaded."""
    from trainer_setup import make_trainer

    with pytest.raises(ValueError, match=r"target_parameters=\['mlp.experts.down_proj', 'mlp.experts.gate_up_proj'\]"):
        make_trainer(str(tmp_path / "no-such-model"), tmp_path, peft_config=EXPERT_LORA, use_liger_kernel=True)
    with pytest.raises(ValueError, match=r'liger_kernel_config=\{"swiglu": False\}.*or use_liger_kernel=False'):
        make_trainer(str(tmp_path / "no-such-model"), tmp_path, peft_config=EXPERT_LORA, use_liger_kernel=True)


def test_moe_with_router_aux_loss_is_not_refused_for_liger(tiny_moe_model_dir, tmp_path):
    """With the experts left to PEFT (`swiglu` off) an MoE model with its router aux loss on meets only the device
    check: Liger keeps the aux loss (the router is not patched; TRL's fused head computes the loss from its logits)."""
    from trainer_setup import make_trainer

    with pytest.raises(ValueError, match="use_liger_kernel=True applies Liger's Triton layer kernels.*runs on 'cpu'"):
        make_trainer(
            tiny_moe_model_dir,
            tmp_path,
            peft_config=EXPERT_LORA,
            use_liger_kernel=True,
            liger_kernel_config={"swiglu": False},
        )


def test_async_config_refuses_liger(tmp_path):
    """TRL's AsyncGRPOTrainer refuses Liger only after loading the model; the config says so first."""
    # Imported here: the async trainer's CPU backend needs `requests`, which the GPU check's machine lacks, and this
    # file's gpu tests are collected there.
    from dppo_trl import AsyncDPPOConfig

    with pytest.raises(ValueError, match="use_liger_kernel=True: TRL's AsyncGRPOTrainer.*Set use_liger_kernel=False"):
        AsyncDPPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", use_liger_kernel=True)


@pytest.mark.gpu
def test_liger_keeps_the_moe_router_aux_loss(tiny_moe_model_dir, tmp_path, monkeypatch):
    """Liger's kernels applied as `Trainer.train` applies them leave the router aux loss of the loss unchanged."""
    pytest.importorskip("liger_kernel")
    from test_loss_gradient import _crafted_batch
    from trainer_setup import ascii_reward, prompt_dataset
    from transformers.integrations.liger import apply_liger_kernel
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from dppo_dev.tiny_models import build_byte_tokenizer
    from dppo_trl import DPPOTrainer

    # Liger swaps these module attributes process-wide; restored after the test.
    for name in ("apply_rotary_pos_emb", "Qwen3MoeRMSNorm", "Qwen3MoeExperts", "Qwen3MoeMLP"):
        monkeypatch.setattr(modeling_qwen3_moe, name, getattr(modeling_qwen3_moe, name))
    args = DPPOConfig(
        output_dir=str(tmp_path),
        bf16=False,
        report_to="none",
        save_strategy="no",
        use_liger_kernel=True,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
    )
    trainer = DPPOTrainer(
        model=tiny_moe_model_dir,
        reward_funcs=ascii_reward,
        args=args,
        train_dataset=prompt_dataset(),
        processing_class=build_byte_tokenizer(),
    )
    assert trainer.aux_loss_enabled
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model.train()
    assert all(p.is_cuda for p in model.parameters())
    inputs, *_ = _crafted_batch(model, torch.Generator().manual_seed(0))

    def aux_loss() -> float:
        trainer._metrics["train"]["aux_loss"].clear()
        trainer._compute_loss(model, inputs)
        return trainer._metrics["train"]["aux_loss"][-1]

    before = aux_loss()
    experts = model.model.layers[0].mlp.experts
    apply_liger_kernel(model, trainer.args.liger_kernel_config)  # as Trainer.train does (LIGER_APPLY_FRAGMENT)
    assert experts.forward.__func__ is not type(experts).forward  # Liger's fused experts are in place
    after = aux_loss()
    assert math.isfinite(before) and before > 0
    assert abs(after - before) <= 1e-3 * before


def test_train_would_apply_the_layer_kernels_without_the_fused_cross_entropy(tiny_model_dir, tmp_path):
    """What `Trainer.train()` applies, checked where Triton cannot run: the function it calls is transformers'
    `apply_liger_kernel` (the one the CUDA test below calls), with `args.liger_kernel_config`, which GRPOTrainer's
    `__init__` has set, before DPPOTrainer's refusal, to keep Liger's fused linear cross-entropy off (it would replace
    the model's forward and drop TRL's fused LM head). Nothing is applied when the trainer is built."""
    import transformers.trainer
    from trainer_setup import prompt_dataset, small_config
    from transformers.integrations.liger import apply_liger_kernel

    from dppo_dev.tiny_models import build_byte_tokenizer
    from dppo_trl import DPPOTrainer

    assert transformers.trainer.apply_liger_kernel is apply_liger_kernel
    args = small_config(tmp_path, use_liger_kernel=True)
    assert args.liger_kernel_config is None
    with pytest.raises(ValueError, match="use_liger_kernel=True applies Liger's Triton layer kernels"):
        DPPOTrainer(
            model=tiny_model_dir,
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=prompt_dataset(),
            processing_class=build_byte_tokenizer(),
        )
    assert args.liger_kernel_config == {"fused_linear_cross_entropy": False}


def _liger_layers(model) -> dict[str, list]:
    """The modules Liger 0.8.5 patches on a Qwen3 instance (`_apply_liger_kernel_to_instance`): the decoder's RMSNorms
    and MLPs get Liger's `forward` bound on the instance."""
    base = model.model
    norms = [base.norm] + [m for layer in base.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    return {"rms_norm": norms, "swiglu": [layer.mlp for layer in base.layers]}


def _bound_forward(module):
    """The function bound as `forward` on the instance itself (how Liger patches an existing module), or None."""
    return getattr(module.__dict__.get("forward"), "__func__", None)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "weights, tolerance",
    [
        # float32: Triton's kernels round in another order than PyTorch's, a few float32 ulps per op through two
        # layers; allowed 1e-4 of each parameter gradient's norm.
        pytest.param("float32", 1e-4, id="fp32-weights"),
        # bf16: both paths round to bf16 after every op, at different points (Liger's RMSNorm rounds once after a
        # float32 computation): a few u = 2^-8 per parameter gradient, as tests/integration/test_loss_gradient_bf16.py's
        # lanes measure against float64 (≤ 4.8u); allowed 16u.
        pytest.param("bfloat16", 16 * 2.0**-8, id="bf16-weights"),
    ],
)
def test_liger_layer_kernels_keep_the_dppo_gradient(tiny_model_dir, tmp_path, weights, tolerance):
    """Liger applied the way `Trainer.train()` applies it, on CUDA throughout: its RMSNorm, SwiGLU and RoPE are in
    place, and DPPO's gradient through GRPOTrainer's real loss (the crafted batch of tests/integration/test_loss_gradient.py,
    every regime of eq. 12) equals the same model's with Liger off, within the stated tolerance; the trust-region
    mask is the same. Liger's class-level patches of transformers' Qwen3 module are put back afterwards."""
    pytest.importorskip("liger_kernel")
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from test_loss_gradient import _crafted_batch
    from trainer_setup import ascii_reward, prompt_dataset
    from transformers.integrations.liger import apply_liger_kernel
    from transformers.models.qwen3 import modeling_qwen3

    from dppo_dev.tiny_models import build_byte_tokenizer
    from dppo_trl import DPPOTrainer

    args = DPPOConfig(
        output_dir=str(tmp_path),
        bf16=weights == "bfloat16",
        model_init_kwargs={"dtype": weights},
        report_to="none",
        save_strategy="no",
        use_liger_kernel=True,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        delta_low=0.02,
        delta_high=0.001,
        ratio_cap=2.0,
    )
    trainer = DPPOTrainer(
        model=tiny_model_dir,
        reward_funcs=ascii_reward,
        args=args,
        train_dataset=prompt_dataset(),
        processing_class=build_byte_tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model.train()
    assert all(p.is_cuda for p in model.parameters()) and next(model.parameters()).dtype == getattr(torch, weights)
    inputs, *_ = _crafted_batch(model, torch.Generator().manual_seed(0))
    masks = []
    trainer.trust_region_observers.append(lambda record: masks.append(record["keep"]))

    def dppo_gradient() -> dict[str, torch.Tensor]:
        model.zero_grad()
        trainer._compute_loss(model, inputs).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = dppo_gradient()
    patched_globals = {
        name: getattr(modeling_qwen3, name) for name in ("apply_rotary_pos_emb", "Qwen3RMSNorm", "Qwen3MLP")
    }
    try:
        # What `Trainer.train()` does first (tests/trl_contract.py, LIGER_APPLY_FRAGMENT).
        apply_liger_kernel(trainer.model, trainer.args.liger_kernel_config)
        layers = _liger_layers(model)
        assert all(_bound_forward(m) is LigerRMSNorm.forward for m in layers["rms_norm"]), layers["rms_norm"]
        assert all(_bound_forward(m) is LigerSwiGLUMLP.forward for m in layers["swiglu"]), layers["swiglu"]
        assert modeling_qwen3.apply_rotary_pos_emb is liger_rotary_pos_emb
        # TRL's config kept Liger's fused linear cross-entropy off: the forward (TRL's fused head's) is not Liger's.
        assert not model.forward.__func__.__module__.startswith("liger_kernel")
        assert all(p.is_cuda for p in model.parameters())
        with_liger = dppo_gradient()
    finally:
        for name, value in patched_globals.items():
            setattr(modeling_qwen3, name, value)
    assert len(masks) == 2 and torch.equal(masks[0], masks[1])
    assert (masks[0] == 0).any() and (masks[0] == 1).any()
    assert set(with_liger) == set(plain)
    for name, grad in plain.items():
        error = (with_liger[name].double() - grad.double()).norm() / grad.double().norm()
        assert error <= tolerance, (name, error.item())
