"""DPPO's loss on either TRL parent, written once: the one hook both rooms call, top to bottom.

`DPPOTrainer` and `AsyncDPPOTrainer` both mix in `DPPOLoss`. Their rooms (`dppo_trl.trainers.trl116`) run the parent's
forward and hand the hook the same typed forward (`PolicyForward`: π, μ, A, the loss tokens, entropy, hidden states,
sampling version); each trainer says only where its batch keeps μ's lists (`_behavior_lists`) and what it logs
(`_log_loss_call`):

    DPPOLoss._per_token_policy_loss(inputs, forward)        called by the room after the parent's forward
      ├ loss_inputs = self._loss_inputs(inputs, forward)     LossInputs(π, μ, A, staleness, ...); with μ's lists,
      │                                                      π at the engine's listed ids (`_engine_list_view`)
      ├ outputs = policy_loss(self.trust_region_spec, loss_inputs)
      ├ self._log_loss_call(inputs, loss_inputs, outputs)    `dppo/*` metrics, observers, the weight-sync check
      └ PolicyTerms(policy=eq. 11 per token, extra=the μ-KL term)

which the room masks, aggregates and scales as its parent does its own policy term.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from trl.trainer.utils import maybe_gather_lm_head_ctx

from dppo_trl.core.functional import sanitize_behavior_logps
from dppo_trl.core.loss import LossInputs, LossOutputs, policy_loss
from dppo_trl.core.spec import TrustRegionSpec
from dppo_trl.kernels.engine_view import EngineListView, engine_list_view, lm_head, logit_transform
from dppo_trl.trainers.trl116.common import PolicyForward, PolicyTerms

__all__ = ["RECOMPUTED_LOGPS", "BehaviorLists", "DPPOLoss"]

# Batch key: π_old, the trainer's recompute of the generating weights, kept only for the baselines that need it.
RECOMPUTED_LOGPS = "dppo_recomputed_logps"


@dataclass(frozen=True)
class BehaviorLists:
    """μ's per-token lists of one loss call, at the forward's tokens.

    Attributes:
        ids: `(..., L)` the listed ids, slot 0 the sampled token, `-1` padding.
        logps: `(..., L)` μ at `ids` (`-inf`: a token the sampler dropped).
        kept_set: truncated sampling: the finite entries are the sampler's kept set (N + 1 slots); else μ's top-K.
        overflow: truncated sampling: the tokens whose kept set the list may not hold in full.
    """

    ids: Tensor
    logps: Tensor
    kept_set: bool = False
    overflow: Tensor | None = None


class DPPOLoss:
    """DPPO's `_per_token_policy_loss` for either room; see the module docstring."""

    # Set by the trainers (the spec before their parent is built) and by transformers' Trainer.
    trust_region_spec: TrustRegionSpec
    args: Any
    accelerator: Any
    model: Any

    def _per_token_policy_loss(self, inputs: dict[str, Any], forward: PolicyForward) -> PolicyTerms:
        """DPPO's per-token terms of one loss call: eq. 11 as the policy term, the μ-KL term as an extra one."""
        loss_inputs = self._loss_inputs(inputs, forward)
        outputs = policy_loss(self.trust_region_spec, loss_inputs)
        self._log_loss_call(inputs, loss_inputs, outputs)
        return PolicyTerms(policy=outputs.policy_loss, extra=outputs.mu_kl)

    def _loss_inputs(self, inputs: dict[str, Any], forward: PolicyForward) -> LossInputs:
        """The core's per-token inputs of one loss call: π from the parent's forward, μ (sanitised) and, when the batch
        carries μ's lists and the hidden states were asked for, π at the engine's listed ids."""
        tokens = forward.tokens.bool()
        if forward.old_log_probs is None:
            # On-policy transformers generation: μ ≡ π, so D = 0, r = 1 and nothing is masked.
            mu_logps, valid = forward.log_probs.detach().float(), torch.ones_like(tokens)
        else:
            mu_logps, valid = sanitize_behavior_logps(forward.old_log_probs)
        old = inputs.get(RECOMPUTED_LOGPS)
        loss_inputs = LossInputs(
            pi_logps=forward.log_probs,
            mu_logps=mu_logps,
            advantages=forward.advantages,
            tokens=tokens,
            valid=valid,
            old_logps=None if old is None else forward.at_tokens(old).float(),
            entropies=None if forward.entropy is None else forward.entropy.detach(),
            staleness=forward.staleness,
        )
        lists = self._behavior_lists(inputs, forward) if self._wants_hidden_states(inputs) else None
        if lists is None:
            return loss_inputs
        view = self._engine_list_view(forward, lists, tokens & valid)
        return dataclasses.replace(
            loss_inputs,
            pi_topk_logps=view.pi_topk_logps,
            mu_topk_logps=view.mu_topk_logps,
            kept_log_mass=view.kept_log_mass,
            kept_overflow=lists.overflow,
        )

    def _engine_list_view(self, forward: PolicyForward, lists: BehaviorLists, valid: Tensor) -> EngineListView:
        """π at the engine's listed ids (`engine_view.engine_list_view`) from the forward's final hidden states: μ's
        top-K lists, or the kept set, whose log π(kept) carries the gradient of every kept id. Under ZeRO-3 the
        kernels gather the head with TRL's `maybe_gather_lm_head_ctx` around every read of it, backward included."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        weight, bias = lm_head(unwrapped)
        spec = self.trust_region_spec
        return engine_list_view(
            forward.hidden,
            weight,
            bias,
            logit_transform(unwrapped, self.args.temperature),
            lists.ids,
            lists.logps.float(),
            forward.log_probs,
            valid,
            kept_set=lists.kept_set,
            top_k=spec.divergence_top_k if spec.uses_top_k else None,
            gather=maybe_gather_lm_head_ctx,
        )

    def _rollout_logprobs(self) -> int | None:
        """Entries per token the rollout asks the engine for: N (truncated sampling, whose first K + 1 slots are also
        the top-K lists), else K (a top-K divergence anchored on the engine's μ), else none."""
        if self.args.kept_set_size is not None:
            return self.args.kept_set_size
        spec = self.trust_region_spec
        return spec.divergence_top_k if spec.uses_top_k and self.args.anchor == "behavior" else None

    # ------------------------------------------------------------------------------------------------------------
    # What each trainer says about its own batch
    # ------------------------------------------------------------------------------------------------------------
    def _wants_hidden_states(self, inputs: dict[str, Any]) -> bool:
        """Whether this loss call reads π at μ's lists, for which the room keeps the final hidden states."""
        raise NotImplementedError

    def _behavior_lists(self, inputs: dict[str, Any], forward: PolicyForward) -> BehaviorLists | None:
        """μ's lists in this loss call's batch, at the forward's tokens (`None`: none to read)."""
        raise NotImplementedError

    def _log_loss_call(self, inputs: dict[str, Any], loss_inputs: LossInputs, outputs: LossOutputs) -> None:
        """Once per loss call: the `dppo/*` metrics and whatever else the trainer reports."""
        raise NotImplementedError
