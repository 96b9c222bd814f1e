"""The room for TRL 1.16's `GRPOTrainer`: `HookedGRPOTrainer` provides the hooks docs/upstream.md proposes.

`DPPOTrainer` subclasses `HookedGRPOTrainer` and implements its hooks; this module is where they are bridged onto
GRPOTrainer 1.16. Each part below is one row of docs/upstream.md's "GRPOTrainer" section, with the pins of
tests/trl_contract.py it needs; when TRL ships the hook, that part is deleted and the hook becomes TRL's:

| hook provided here | bridged on TRL 1.16 by | upstream.md |
|---|---|---|
| `_needs_old_per_token_logps()`: is GRPO's no-grad π_old pass needed | `_parent_recomputes_old_logps` restates TRL's condition; `_decline_old_pass` makes the first policy pass of the generation batch (the π_old pass, by source order) return `(None, None, None)` | grpo-1 |
| `_policy_loss_terms(inputs, policy)`: the per-token policy term as a coefficient `w` (`−A·w·∇log π`), with the batch | the static mask hook `get_off_policy_mask` is bound on the instance (`_StaticOnClassBoundOnInstance`); `off_policy_mask_threshold = ∞` makes TRL call it; the batch and the hidden states reach it through the slot `self._loss_call`, set for one parent call | grpo-2 |
| the ratio taken against `_anchor_logps(inputs)` (μ), GRPO's clip out of the way | μ is written, clamped, into `old_per_token_logps` (TRL's bias-corrected β-KL uses the same ratio); the clip is opened (`epsilon_low = 1`, `epsilon_high = ∞`); the weight at the mask slot is `opened_clip_weight(w)` = w / r | grpo-3 |
| `_aggregate(per_token, mask, inputs)`: a term aggregated like the policy term | `aggregate_per_token_loss` restates GRPOTrainer's five normalisers; a term that is part of the policy term gets TRL's entropy mask (`get_high_entropy_mask`) | grpo-4 |
| `policy.hidden`: the final hidden states the fused head projects | a forward hook on the backbone inside the parent's log-prob pass | kept |
| TRL's clip-rate metrics dropped | `PARENT_CLIP_METRICS`: always 0 with the clip opened | grpo-3 |
| LoRA weights merged out of place, gathered one decoder layer at a time, in every vLLM sync | `VLLMGeneration._iter_named_params`, the one walk TRL's colocate and server syncs (and the CPU ones) read, is `dppo_trl.weights.stream.merged_named_weights` on this trainer's instance (`merge_lora_out_of_place`) | grpo-7 |

A subclass implements `_policy_loss_terms` and may override `_needs_old_per_token_logps`, `_wants_hidden_states` and
`_anchor_logps`; it never touches the slot, the descriptor or the clip. `tests/integration/test_loss_gradient.py`
checks the gradient through GRPOTrainer's real `_compute_loss`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import is_peft_model
from torch import Tensor
from trl import GRPOTrainer

from dppo_trl.kernels.engine_view import backbone, last_hidden_state
from dppo_trl.trainers.trl116 import PARENT_CLIP_METRICS
from dppo_trl.weights.stream import in_place_fallback_message, merged_named_weights, out_of_place_problems

logger = logging.getLogger(__name__)

# The anchor is clamped here before GRPOTrainer exponentiates `log π − old`: exp(60) is finite in fp32, and the weight
# at the mask slot is computed against the clamped value, so the product stays exact.
_MU_FLOOR = -60.0


@dataclass(frozen=True)
class PolicyPass:
    """What the parent's log-prob pass of one loss call gives `_policy_loss_terms`.

    Attributes:
        advantages: A as GRPOTrainer holds it (`(B, 1)` or `(B, T)`).
        per_token_logps: log π of the completion tokens `(B, T)`, with their graph.
        entropies: the policy's entropy per token, when the parent computed it.
        hidden: the final hidden states of the completion tokens `(B, T, H)`, with their graph, when
            `_wants_hidden_states` asked for them.
        mask: the loss tokens (`completion_mask`, times `tool_mask` with tools).
    """

    advantages: Tensor
    per_token_logps: Tensor
    entropies: Tensor | None
    hidden: Tensor | None
    mask: Tensor


@dataclass(frozen=True)
class PolicyTerms:
    """What a subclass's policy loss hands GRPOTrainer per token.

    Attributes:
        coef: the detached coefficient w: the policy term becomes `−A·w·∇log π` (value `−A·w`), then GRPOTrainer's
            entropy mask, β-KL, aggregation, entropy bonus and aux loss apply to it as to its own.
        extra: a term aggregated like the policy term (`_aggregate`) but outside it (no entropy mask), or `None`.
        policy_extra: a term that is part of the policy term (entropy mask, then `_aggregate`), or `None`.
    """

    coef: Tensor
    extra: Tensor | None = None
    policy_extra: Tensor | None = None


@dataclass
class _LossCall:
    """The slot of one call into the parent: what the log-prob pass and the mask hook read and write."""

    want_hidden: bool
    batch: dict | None = None
    hidden: Tensor | None = None
    entropies: Tensor | None = None
    terms: PolicyTerms | None = None
    mask: Tensor | None = None


class _StaticOnClassBoundOnInstance(staticmethod):
    """A TRL static hook that stays TRL's on the class and is an instance method of the trainer on an instance.

    GRPOTrainer declares `get_off_policy_mask` static and calls it as `self.get_off_policy_mask(...)`; code that calls
    it on the class (`DPPOTrainer.get_off_policy_mask(...)`, as TRL's own tests do) gets TRL's function, and
    `trainer.get_off_policy_mask` is `trainer.<method_name>`, which can read the trainer's loss call.
    """

    def __init__(self, function, method_name: str):
        super().__init__(function)
        self.method_name = method_name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self.__func__
        return getattr(instance, self.method_name)


class HookedGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` 1.16 with the hooks of docs/upstream.md ("GRPOTrainer"); see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # grpo-2: the per-call slot the parent's seams read; `None` outside a call into the parent.
        self._loss_call: _LossCall | None = None
        # grpo-1: set while the parent generates a batch whose π_old pass is declined.
        self._decline_old_pass = False
        # grpo-3: open GRPO's ratio clip: the policy term's coefficient is the weight at the mask slot.
        self.epsilon_low, self.epsilon_high = 1.0, math.inf
        # grpo-2: a non-None threshold makes GRPOTrainer call `get_off_policy_mask`; the user's own OPSM threshold (if
        # any) still applies on top, through `self.args.off_policy_mask_threshold`.
        self.off_policy_mask_threshold = math.inf
        # grpo-7: every vLLM sync sends LoRA weights merged out of place.
        self._merges_lora_out_of_place = merge_lora_out_of_place(self)

    # ------------------------------------------------------------------------------------------------------------
    # The hooks a subclass implements or overrides
    # ------------------------------------------------------------------------------------------------------------
    def _policy_loss_terms(self, inputs: dict, policy: PolicyPass) -> PolicyTerms:
        """The per-token policy term of one loss call (upstream grpo-2/grpo-3)."""
        raise NotImplementedError

    def _needs_old_per_token_logps(self) -> bool:
        """Whether the generation batch needs GRPOTrainer's no-grad π_old pass (upstream grpo-1)."""
        return self._parent_recomputes_old_logps()

    def _wants_hidden_states(self, inputs: dict) -> bool:
        """Whether this loss call's `PolicyPass` carries the final hidden states."""
        return False

    def _anchor_logps(self, inputs: dict) -> Tensor | None:
        """The log-probs the policy ratio r (and TRL's bias-corrected β-KL) is taken against; `None`: TRL's π_old."""
        return None

    def _aggregate(self, per_token: Tensor, mask: Tensor, inputs: dict) -> Tensor:
        """A `(B, T)` per-token term aggregated exactly like GRPOTrainer's policy term (upstream grpo-4)."""
        return aggregate_per_token_loss(
            per_token,
            mask,
            self.args.loss_type,
            max_completion_length=self.args.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps,
            steps_per_generation=self.args.steps_per_generation,
            training=self.model.training,
        )

    def _logps_and_hidden(
        self, model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, batch_size: int, want_hidden: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The parent's fused log-prob pass outside a loss call: log π of the completion tokens and, when asked for,
        their final hidden states."""
        with self._calling_parent(_LossCall(want_hidden=want_hidden)) as call:
            logps, _, _ = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
            )
        return logps, call.hidden

    def _with_anchor_in_old_slot(self, batch: dict) -> dict:
        """`batch` with `_anchor_logps(batch)`, clamped, in GRPOTrainer's π_old slot (grpo-3)."""
        anchor = self._anchor_logps(batch)
        if anchor is None:
            return batch
        return {**batch, "old_per_token_logps": anchor.clamp(min=_MU_FLOOR)}

    # ------------------------------------------------------------------------------------------------------------
    # grpo-1: the declined π_old pass
    # ------------------------------------------------------------------------------------------------------------
    def _parent_recomputes_old_logps(self) -> bool:
        """GRPOTrainer 1.16's own condition for its no-grad π_old pass in `_generate_and_score_completions`
        (misaligned generation and optimisation, or vLLM IS correction; pinned in tests/trl_contract.py)."""
        steps_per_generation = self.args.steps_per_generation
        assert steps_per_generation is not None  # GRPOConfig.__post_init__ resolves None
        # restates-trl: begin GRPOTrainer._generate_and_score_completions (the π_old recompute condition)
        generate_every = steps_per_generation * self.args.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.args.use_vllm and self.args.vllm_importance_sampling_correction
        )
        # restates-trl: end

    def _generate_and_score_completions(self, inputs):
        """Parent's generation, declining its π_old pass when `_needs_old_per_token_logps()` says it is not needed."""
        self._decline_old_pass = self._parent_recomputes_old_logps() and not self._needs_old_per_token_logps()
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._decline_old_pass = False

    # ------------------------------------------------------------------------------------------------------------
    # grpo-2: the slot, the log-prob pass that fills it and the mask hook that reads it
    # ------------------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _calling_parent(self, call: _LossCall) -> Iterator[_LossCall]:
        """Make `call` the parent seams' slot for the duration of the block (cleared even on error)."""
        if self._loss_call is not None:
            raise RuntimeError("Calls into GRPOTrainer's loss are not re-entrant.")
        self._loss_call = call
        try:
            yield call
        finally:
            self._loss_call = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """Parent's fused log-prob pass; inside a call (`_calling_parent`), also keep the hidden states and entropies.
        While generating a batch whose π_old is declined, decline the parent's π_old pass: in GRPOTrainer 1.16 it is
        the first policy pass after sampling whenever `_parent_recomputes_old_logps()` (source order pinned), and
        `(None, None, None)` is what the parent then stores as "no π_old"."""
        if self._decline_old_pass:
            self._decline_old_pass = False
            return None, None, None
        capture = self._loss_call
        if capture is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        hiddens: list[Tensor] = []
        handle = None
        if capture.want_hidden:
            handle = backbone(self.accelerator.unwrap_model(model)).register_forward_hook(
                lambda _module, _inputs, out: hiddens.append(last_hidden_state(out))
            )
        try:
            result = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        finally:
            if handle is not None:
                handle.remove()
        if hiddens:
            # Hidden state at position i predicts token i+1, so the completion tokens are scored from [-T-1, -1).
            capture.hidden = torch.cat(hiddens, dim=0)[:, -logits_to_keep - 1 : -1]
        capture.entropies = result[1]
        return result

    def _compute_loss(self, model, inputs):
        """Parent's loss with the subclass's policy term at its mask slot, plus the terms it aggregates like it."""
        inputs = self._with_anchor_in_old_slot(inputs)
        call = _LossCall(want_hidden=self._wants_hidden_states(inputs), batch=inputs)
        with self._calling_parent(call):
            loss = super()._compute_loss(model, inputs)
        if call.terms is None or call.mask is None:
            raise RuntimeError("GRPOTrainer._compute_loss did not call `get_off_policy_mask`: see trl_contract.py.")
        if call.terms.extra is not None:
            loss = loss + self._aggregate(call.terms.extra, call.mask, inputs)
        if call.terms.policy_extra is not None:
            # Part of the policy term, so GRPOTrainer's entropy mask (if any) applies to it as well.
            policy_extra = call.terms.policy_extra
            if self.args.top_entropy_quantile < 1.0 and call.entropies is not None:
                policy_extra = policy_extra * self.get_high_entropy_mask(
                    call.entropies, call.mask, 1 - self.args.top_entropy_quantile
                )
            loss = loss + self._aggregate(policy_extra, call.mask, inputs)
        metrics = self._metrics["train" if self.model.training else "eval"]
        for key in PARENT_CLIP_METRICS:
            metrics.pop(key, None)
        return loss

    def _off_policy_mask(
        self,
        advantages: Tensor,
        per_token_logps: Tensor,
        sampling_per_token_logps: Tensor,
        mask: Tensor,
        off_policy_threshold: float,
    ) -> Tensor:
        """What `self.get_off_policy_mask(...)` is on an instance: the per-token weight GRPOTrainer's loss multiplies
        its policy term by. The subclass's policy term inside a loss call, TRL's OPSM mask anywhere else."""
        call = self._loss_call
        if call is None or call.batch is None:
            return GRPOTrainer.get_off_policy_mask(
                advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
            )
        terms = self._policy_loss_terms(
            call.batch, PolicyPass(advantages, per_token_logps, call.entropies, call.hidden, mask)
        )
        with torch.no_grad():
            old = call.batch.get("old_per_token_logps")
            weight = opened_clip_weight(terms.coef, per_token_logps, per_token_logps.detach() if old is None else old)
            if self.args.off_policy_mask_threshold is not None:
                weight = weight * GRPOTrainer.get_off_policy_mask(
                    advantages=advantages,
                    per_token_logps=per_token_logps,
                    sampling_per_token_logps=sampling_per_token_logps,
                    mask=mask,
                    off_policy_threshold=self.args.off_policy_mask_threshold,
                )
        call.terms, call.mask = terms, mask
        return weight.to(per_token_logps.dtype)

    get_off_policy_mask = _StaticOnClassBoundOnInstance(GRPOTrainer.get_off_policy_mask, "_off_policy_mask")


# ----------------------------------------------------------------------------------------------------------------
# grpo-7: the merged-weight walk of every vLLM sync
# ----------------------------------------------------------------------------------------------------------------
def merge_lora_out_of_place(trainer: GRPOTrainer) -> bool:
    """Make `trainer`'s vLLM syncs send a LoRA model's weights merged out of place, gathered one decoder layer at a
    time (`dppo_trl.weights.stream`); True if they do. `HookedGRPOTrainer` calls it for itself; a plain
    `GRPOTrainer` can be given it the same way.

    TRL 1.16's syncs all read `VLLMGeneration._iter_named_params()`: its colocate and server `sync_weights`, the
    server manifest (`_weight_metadata`, built from the same walk) and the CPU syncs of `dppo_trl.backends.cpu`. For
    a `PeftModel` it merges the adapters into the base in place and unmerges them after, which in bf16 does not give
    the base back, and under ZeRO-3 gathers the whole model first. The walk replaces it on this trainer's instance
    only, with TRL's names, dtypes and shapes (tests/meta/test_trl_contract.py). A model the walk cannot merge keeps
    TRL's, with a warning.
    """
    model = trainer.model
    if not trainer.args.use_vllm or not is_peft_model(model):
        return False
    fsdp_plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    problems = out_of_place_problems(model, getattr(fsdp_plugin, "fsdp_version", None))
    if problems:
        logger.warning(in_place_fallback_message(problems))
        return False
    trainer.vllm_generation._iter_named_params = functools.partial(
        merged_named_weights, model, trainer.accelerator.device
    )
    return True


# ----------------------------------------------------------------------------------------------------------------
# grpo-3 and grpo-4: GRPOTrainer's opened-clip term and its aggregation, restated
# ----------------------------------------------------------------------------------------------------------------
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
    # restates-trl: begin GRPOTrainer._compute_loss (the aggregation of the policy term)
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
    # restates-trl: end
    raise ValueError(f"aggregate_per_token_loss does not know loss_type={loss_type!r}.")
