"""`use_liger_kernel=True` can never silently turn DPPO into GRPO.

TRL ≤ 1.8 routed `compute_loss` to Liger's fused GRPO loss when `use_liger_kernel=True`, which bypassed any
subclass's loss. In TRL 1.16 the flag only applies Liger's Triton *layer* kernels (RMSNorm, SwiGLU, RoPE) and the loss
is always `_compute_loss`, where DPPO's trust region is applied. These tests pin that, refuse the flag where Triton
cannot run (CPU), and, on CUDA, check that the DPPO gradient is unchanged with Liger's layer kernels on.
"""

import inspect

import pytest
import torch
from trl import GRPOTrainer

from dppo_trl import DPPOConfig


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
