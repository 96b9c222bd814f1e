"""π at the engine's listed ids: the policy side of μ's per-token lists, written once for both trainers.

The engine lists, per sampled token, a few ids with μ's log-probs (slot 0 the sampled token, then the others by rank,
`-1` padding): μ's top-K for the top-K divergences, or N processed log-probs whose finite entries are the sampler's
kept set under truncated sampling. `engine_list_view` gathers π at the same ids from the policy's final hidden states
(no `[N, V]` logits, `dppo_trl.kernels.topk_logps`) and returns the `LossInputs` fields they give. Every tensor is
aligned with the trainer's token shape: `(B, T)` rows for `DPPOTrainer`, the packed `(N,)` loss terms for
`AsyncDPPOTrainer`, with the lists in a trailing dimension.

The model helpers below read the transformers model a trainer hands its parent (`PreTrainedModel`, under PEFT too).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch import Tensor

from dppo_trl.core.functional import kept_log_mass
from dppo_trl.kernels.topk_logps import HeadGather, LogitTransform, logps_at_ids_from_sampled, logps_at_ids_with_grad


def causal_lm(model: Any) -> Any:
    """The `PreTrainedModel` carrying the LM head (under PEFT, the wrapped base model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone(model: Any) -> torch.nn.Module:
    """The decoder whose output the fused LM head projects (`PreTrainedModel.base_model`)."""
    return causal_lm(model).base_model


def last_hidden_state(output: Any) -> Tensor:
    """The final hidden states of a backbone's forward output (a `ModelOutput` or a tuple)."""
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


@overload
def full(param: Tensor) -> Tensor: ...
@overload
def full(param: None) -> None: ...
def full(param: Tensor | None) -> Tensor | None:
    """FSDP2 exposes sharded parameters as DTensors; the projections need the full tensor."""
    if param is not None and hasattr(param, "full_tensor"):
        return param.full_tensor()
    return param


def lm_head(model: Any) -> tuple[Tensor, Tensor | None]:
    """The LM head's `(weight, bias)` parameters as the model holds them (gather or un-shard them before use)."""
    head = causal_lm(model).get_output_embeddings()
    return head.weight, getattr(head, "bias", None)


def logit_transform(model: Any, temperature: float) -> LogitTransform:
    """The transform TRL's fused head applies to this model's logits at the sampling temperature."""
    return LogitTransform.from_model_config(causal_lm(model).config, temperature=temperature)


@dataclass(frozen=True)
class EngineListView:
    """The `LossInputs` fields one loss call gets from the engine's lists (`None`: not asked for)."""

    pi_topk_logps: Tensor | None = None
    mu_topk_logps: Tensor | None = None
    kept_log_mass: Tensor | None = None


def engine_list_view(
    hidden: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    transform: LogitTransform,
    ids: Tensor,
    mu_lists: Tensor,
    pi_logps: Tensor,
    valid: Tensor,
    *,
    kept_set: bool,
    top_k: int | None,
    gather: HeadGather | None = None,
) -> EngineListView:
    """π and μ at the engine's listed ids of every `valid` token.

    Args:
        hidden: the policy's final hidden states `(..., H)`, aligned with the tokens (with their graph for `kept_set`).
        weight, bias, transform: the LM head and its logit transform (`lm_head`, `logit_transform`).
        ids: `(..., L)` the listed ids, slot 0 the sampled token, `-1` padding.
        mu_lists: `(..., L)` μ's log-probs at `ids` (`-inf` for a token the sampler dropped).
        pi_logps: `(...)` log π of the sampled tokens (with their graph for `kept_set`).
        valid: `(...)` bool, the tokens whose μ is valid; the others get identical `-inf` padding on both sides.
        kept_set: truncated sampling: the finite entries of `mu_lists` are the kept set, and π's log-mass over it
            (`kept_log_mass`, with the gradient of every kept id through `logps_at_ids_with_grad`) is returned.
        top_k: K of a top-K divergence: the first K + 1 slots of both sides (π's detached) are its lists.
        gather: makes a ZeRO-3 head whole while it is read, its backward's reads included (TRL's
            `maybe_gather_lm_head_ctx`; `dppo_trl.kernels.topk_logps.HeadGather`); `None`: the head is used as given.
    """
    if hidden is None:
        raise RuntimeError(
            "π at the engine's listed ids needs the policy's final hidden states, but none were captured."
        )
    at_ids = logps_at_ids_with_grad if kept_set else logps_at_ids_from_sampled
    pi_lists = torch.full(mu_lists.shape, -math.inf, dtype=torch.float32, device=mu_lists.device)
    listed = ids[valid]
    # Only log π(kept) needs a gradient; without it no graph is built over the gathered head rows.
    with contextlib.nullcontext() if kept_set else torch.no_grad():
        pi_lists[valid] = at_ids(
            hidden[valid],
            full(weight),
            listed,
            listed[:, 0],
            pi_logps[valid].float(),
            bias=full(bias),
            transform=transform,
            gather=gather,
        )
    pi_topk = mu_topk = log_mass = None
    if top_k is not None:
        width = top_k + 1
        padding = torch.full_like(mu_lists[..., :width], -math.inf)
        mu_topk = torch.where(valid.unsqueeze(-1), mu_lists[..., :width], padding)
        pi_topk = pi_lists[..., :width].detach()
    if kept_set:
        kept = torch.isfinite(mu_lists) & (ids >= 0) & valid.unsqueeze(-1)
        log_mass = kept_log_mass(pi_lists, kept)
    return EngineListView(pi_topk_logps=pi_topk, mu_topk_logps=mu_topk, kept_log_mass=log_mass)
