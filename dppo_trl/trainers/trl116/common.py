"""What both TRL 1.16 rooms share: the policy-loss hook's types, the capture of the final hidden states, TRL's metric
sink and the hardening wired into transformers' `Trainer` methods.

Both rooms (`grpo.HookedGRPOTrainer`, `async_grpo.HookedAsyncGRPOTrainer`) call one hook after their parent's forward,
`_per_token_policy_loss(inputs, forward: PolicyForward) -> PolicyTerms`, with the same typed forward; a trainer that
implements it once (`dppo_trl.trainers.dppo_loss.DPPOLoss`) runs on either parent. `CommonRoom`, a base of both rooms,
overrides the three `Trainer` methods the hardening needs (`train`, `_save_checkpoint`, `create_model_card`: ordinary
`super()` wrappers, `HARDENING_OVERRIDDEN_METHODS` in tests/trl_contract.py) and reads TRL's metric sink, so no trainer
module names either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dppo_trl.hardening.checkpoints import staged_checkpoint
from dppo_trl.hardening.model_card import write_model_card
from dppo_trl.hardening.training import hardened_training
from dppo_trl.kernels.engine_view import backbone, last_hidden_state

__all__ = ["CommonRoom", "PolicyForward", "PolicyTerms", "final_hidden_states"]


@dataclass(frozen=True)
class PolicyForward:
    """What the parent's forward of one loss call gives `_per_token_policy_loss`, at its loss tokens, in the parent's
    layout: `(B, T)` completion rows (GRPOTrainer) or the `(N,)` loss terms of one packed row (AsyncGRPOTrainer);
    per-token lists keep a trailing dimension.

    Attributes:
        log_probs: log π of each token, with its graph.
        old_log_probs: μ, the log-probs the policy ratio is taken against (the engine's, sanitised or not; NaN where
            the engine reported none); `None`: μ ≡ π (on-policy transformers generation).
        advantages: A as the parent holds it (`(B,)`/`(B, 1)` per sequence, or one per token).
        tokens: bool, the tokens the parent's loss counts (`completion_mask`, times `tool_mask` with tools; every
            loss term of a packed row).
        entropy: the policy's entropy per token, when the parent's forward computed it.
        hidden: the final hidden states the fused head projects `(..., H)`, with their graph, when
            `_wants_hidden_states` asked for them.
        model_version: the policy version that sampled each token, and `staleness`, the versions trained since; `None`
            where the parent does not carry them (GRPOTrainer).
        selected: where the loss terms sit in the batch's packed row (`token_index >= 0`); `None` where the batch's
            per-token tensors already have the tokens' layout.
    """

    log_probs: Tensor
    old_log_probs: Tensor | None
    advantages: Tensor
    tokens: Tensor
    entropy: Tensor | None = None
    hidden: Tensor | None = None
    model_version: Tensor | None = None
    staleness: Tensor | None = None
    selected: Tensor | None = None

    def at_tokens(self, value: Tensor) -> Tensor:
        """A per-position tensor of the batch (`inputs[key]`) at this forward's tokens."""
        return value if self.selected is None else value[self.selected]


@dataclass(frozen=True)
class PolicyTerms:
    """What `_per_token_policy_loss` hands its room, per token, with π's graph.

    Attributes:
        policy: the per-token policy loss. The room treats it as its parent treats its own policy term (GRPOTrainer:
            the off-policy sequence mask, the entropy mask, the vLLM IS ratio, then the aggregation; AsyncGRPOTrainer:
            the normalisation by tokens per process and gradient accumulation).
        extra: a per-token term aggregated like the policy term but outside its masks, or `None`.
    """

    policy: Tensor
    extra: Tensor | None = None


@contextlib.contextmanager
def final_hidden_states(model: Any) -> Iterator[list[Tensor]]:
    """Inside the block, every forward of `model`'s backbone (the decoder the fused LM head projects) appends its final
    hidden states, with their graph, to the yielded list."""
    kept: list[Tensor] = []
    handle = backbone(model).register_forward_hook(
        lambda _module, _inputs, output: kept.append(last_hidden_state(output))
    )
    try:
        yield kept
    finally:
        handle.remove()


class CommonRoom:
    """Both rooms' base: TRL's metric sink, and the hardening (dppo_trl/hardening/) in transformers' `train`,
    `_save_checkpoint` and `create_model_card`. A room says what differs by parent (`_watched_server`,
    `_training_context`) and the trainer what its card shows (`_model_card_arguments`)."""

    # Set by TRL's trainers (pinned: `TRAINER_ATTRIBUTES`, `ASYNC_TRAINER_ATTRIBUTES`).
    _metrics: dict[str, Any]
    args: Any

    def _metric_sink(self, mode: str) -> dict[str, list[float]]:
        """TRL's metrics of `mode` (`"train"`, `"eval"`): a list per key, averaged into the next log."""
        return self._metrics[mode]

    def _watched_server(self) -> tuple[str | None, str]:
        """The vLLM server the run depends on (`None`: none) and how soon the trainer notices it has died."""
        return None, ""

    def _training_context(self) -> contextlib.AbstractContextManager:
        """What else `train()` runs inside (the CPU colocate thread bound)."""
        return contextlib.nullcontext()

    def _model_card_arguments(self) -> dict[str, Any]:
        """What the trainer's card says beyond TRL's (`write_model_card`'s `vllm_mode`, `sampling`, `settings`)."""
        raise NotImplementedError

    def train(self, *args, **kwargs):
        """Parent's `train` inside the hardening (`dppo_trl/hardening/training.py`): a SIGTERM checkpoint
        (`enable_jit_checkpoint`) ends in `TrainingPreempted` (exit 143) instead of returning as if the run had
        finished, and a dead vLLM server in `VLLMServerError`."""
        server_url, bound = self._watched_server()
        with hardened_training(self, server_url, bound), self._training_context():
            return super().train(*args, **kwargs)  # type: ignore[misc]

    def _save_checkpoint(self, model, trial):
        """Parent's checkpoint, written under a staging name and renamed when complete
        (`dppo_trl/hardening/checkpoints.py`)."""
        with staged_checkpoint(self, trial):
            super()._save_checkpoint(model, trial)  # type: ignore[misc]

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card with honest provenance and versions, plus the DPPO settings (`write_model_card`)."""
        write_model_card(
            self,
            super().create_model_card,  # type: ignore[misc]
            model_name=model_name,
            dataset_name=dataset_name,
            tags=tags,
            **self._model_card_arguments(),
        )
