"""`use_liger_kernel=True` can never silently turn DPPO into GRPO, nor drop an MoE model's router aux loss.

TRL ≤ 1.8 routed `compute_loss` to Liger's fused GRPO loss when `use_liger_kernel=True`, which bypassed any
subclass's loss (and, on TRL releases that still have that route, the MoE aux loss: trl#7009). In TRL 1.16 the flag
only applies Liger's Triton *layer* kernels (RMSNorm, SwiGLU, RoPE, fused experts) and the loss is always
`_compute_loss`, where DPPO's trust region is applied and the aux loss added. These tests pin that, refuse the flag
where Triton cannot run (CPU) and where Liger would bypass LoRA on fused experts (before the model loads), and, on
CUDA, check that the DPPO gradient and the router aux loss are unchanged with Liger's layer kernels applied.
"""

import inspect
import math

import pytest
import torch
from peft import LoraConfig
from trl import GRPOTrainer

from dppo_trl import AsyncDPPOConfig, DPPOConfig

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
    inputs, *_ = _crafted_batch(model.cpu(), torch.Generator().manual_seed(0))
    model.cuda()
    inputs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()}

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


@pytest.mark.gpu
def test_liger_layer_kernels_keep_the_dppo_gradient(tiny_model_dir, tmp_path):
    pytest.importorskip("liger_kernel")
    from references import dppo_per_token_loss
    from test_loss_gradient import ADVANTAGES, PROMPT_LEN, _crafted_batch
    from trainer_setup import ascii_reward, prompt_dataset

    from dppo_dev.tiny_models import build_byte_tokenizer
    from dppo_trl import DPPOTrainer
    from dppo_trl.core.functional import compute_divergence, trust_region_mask

    args = DPPOConfig(
        output_dir=str(tmp_path),
        bf16=False,
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
    inputs, ids, attn, mu, valid = _crafted_batch(model.cpu(), torch.Generator().manual_seed(0))
    model.cuda()
    inputs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()}
    model.zero_grad()
    trainer._compute_loss(model, inputs).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logits = model(input_ids=ids.cuda(), attention_mask=attn.cuda()).logits[:, PROMPT_LEN - 1 : -1]
    pi = torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    adv, mu, valid = ADVANTAGES.cuda().unsqueeze(1), mu.cuda(), valid.cuda()
    keep = (
        trust_region_mask(pi.detach(), mu, adv, compute_divergence("binary_tv", pi.detach(), mu), 0.02, 0.001) * valid
    )
    mask = inputs["completion_mask"].float()
    ((dppo_per_token_loss(pi, mu, adv, keep, 2.0) * mask).sum() / mask.sum()).backward()
    for name, param in model.named_parameters():
        if param.grad is not None:
            scale = param.grad.abs().max().item()
            assert (got[name] - param.grad).abs().max().item() <= 1e-3 * scale + 1e-7, name
