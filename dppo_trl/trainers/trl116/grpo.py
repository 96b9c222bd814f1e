"""The room for TRL 1.16's `GRPOTrainer` (work in progress: its helpers first)."""

from __future__ import annotations

import torch
from torch import Tensor


def opened_clip_weight(coef: Tensor, pi_logps: Tensor, parent_old_logps: Tensor) -> Tensor:
    """The weight `m` that turns GRPO's opened-clip term `−r·A·m`, `r = exp(log π − old)`, into eq. 11: `m = w / r`,
    so `−r·A·m` has value `−A·w` and gradient `−A·w·∇log π`. Detached, computed in log space (r can underflow to 0
    while 1/r overflows); 0 where `w` is 0."""
    log_r = pi_logps.detach().float() - parent_old_logps.float()
    return torch.where(coef > 0, torch.exp(torch.log(coef) - log_r), torch.zeros_like(coef))


def aggregate_per_token_loss(
    per_token: Tensor,
    mask: Tensor,
    loss_type: str,
    *,
    max_completion_length: int,
    num_items_in_batch: Tensor | float | None = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    training: bool = True,
) -> Tensor:
    """Aggregate a `(B, T)` per-token loss exactly as `GRPOTrainer._compute_loss` aggregates its policy term.

    Used for the μ-KL term of `DPPOTrainer`, the one term GRPOTrainer has no per-token slot for (it must act on A = 0
    tokens, so it cannot ride on the policy weight). The normalisers of TRL 1.16, gradient-accumulation scaling
    included (`training=False`: none, as in eval):

    - `grpo`: per-sequence token mean, then the batch mean, / accumulation steps;
    - `bnpo`: token mean over the micro-batch, / accumulation steps;
    - `dr_grpo`: sum / (B · max_completion_length), / accumulation steps;
    - `dapo`: sum / (num_items_in_batch / num_processes), × steps_per_generation / accumulation steps (training);
    - `luspo`: per-sequence sum, then the batch mean, / accumulation steps.

    `tests/integration/test_mu_kl.py` pins this against GRPOTrainer's real `_compute_loss` for every supported `loss_type`.
    """
    mask = mask.to(per_token.dtype)
    accumulation = gradient_accumulation_steps if training else 1.0
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_completion_length) / accumulation
    if loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError("loss_type='dapo' needs `num_items_in_batch` (the generation batch's token count).")
        items = torch.as_tensor(num_items_in_batch, dtype=per_token.dtype, device=per_token.device)
        normalizer = items.clamp(min=1.0) / num_processes
        if training:
            normalizer = normalizer * gradient_accumulation_steps / steps_per_generation
        return (per_token * mask).sum() / normalizer
    if loss_type == "luspo":
        return (per_token * mask).sum(-1).mean() / accumulation
    raise ValueError(f"aggregate_per_token_loss does not know loss_type={loss_type!r}.")
