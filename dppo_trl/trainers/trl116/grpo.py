"""The room for TRL 1.16's `GRPOTrainer`: `HookedGRPOTrainer` provides the hooks docs/upstream.md proposes.

`DPPOTrainer` subclasses `HookedGRPOTrainer` and implements its hooks; this module is where they are bridged onto
GRPOTrainer 1.16, generation and loss. Each row below is one of docs/upstream.md's, with the pins of
tests/trl_contract.py it needs (`tests/meta/test_rooms.py` keeps the two tables equal); when TRL ships a hook, its
part is deleted and the hook becomes TRL's:

| hook the room provides | bridged on TRL 1.16 by | upstream.md |
|---|---|---|
| `_needs_old_per_token_logps()`: is GRPO's no-grad π_old pass needed | `_parent_recomputes_old_logps` restates TRL's condition; `_decline_old_pass` makes the first policy pass of the generation batch (the π_old pass, by source order) return `(None, None, None)` | grpo-1 |
| `_per_token_policy_loss(inputs, forward)`: the policy term per token, on the parent's forward (`PolicyForward`) | TRL's `_compute_loss` runs on the batch with zeroed advantages (its policy term: value 0, gradient 0) for its forward, β-KL, entropy bonus, aux loss and metrics; `_get_per_token_logps_and_entropies` keeps that forward's π, entropies and hidden states for the call (`_loss_call`); the term gets TRL's off-policy, entropy and IS masks (restated); TRL's clip rates and `policy_loss`, which then describe no policy term, are dropped | grpo-2 |
| `_anchor_logps(inputs)`: μ, the ratio's anchor, also for TRL's bias-corrected β-KL | written, clamped, into `old_per_token_logps` for the parent's loss call | grpo-3 |
| `_aggregate(per_token, mask, inputs)`: a term aggregated like the policy term | `aggregate_per_token_loss` restates GRPOTrainer's five normalisers | grpo-4 |
| `_rollout_logprobs()`: N log-probs per sampled token, in the batch as `SAMPLING_LIST_IDS` / `SAMPLING_LIST_LOGPS` | `VLLMTopKCapture` shadows `generate` on the trainer's `VLLMGeneration` and sets its `logprobs` (colocate: no detokenizing); `place_turns` places every tool-loop turn's lists | grpo-5 |
| each turn fitted to the engine's context, a turn with no room ending its rollout (`completions/context_*_turns`) | the engine's or the client's `generate` shadowed on its instance (`context_fit.py`); the `_tool_call_loop` override marks the tool loop | grpo-6 |
| LoRA weights merged out of place, one decoder layer at a time, in every vLLM sync | `VLLMGeneration._iter_named_params` on this trainer's instance is `dppo_trl.weights.stream.merged_named_weights` (`merge_lora_out_of_place`) | grpo-7 |
| the optimizer step whose weights sampled the batch, `inputs[WEIGHTS_STEP]` | `_last_loaded_step`, read after each generation | grpo-8 |
| the colocated CPU engine's arguments | TRL's `LLM` symbol swapped while the parent builds the engine (`dppo_trl.backends.cpu.construction`) | cpu-1 |
| the server client's class: CPU weight sync, API key | TRL's `VLLMClient` symbol swapped while the parent builds the client (`dppo_trl.backends.cpu.construction`) | cpu-2 |
| `forward.hidden`: the final hidden states the fused head projects | a forward hook on the backbone inside the parent's log-prob pass (`common.final_hidden_states`) | kept |
| `_on_generation_batch(output)`: the subclass's keys on every generation batch | the `_generate_and_score_completions` override | kept |
| `_check_vllm_server(model_config)`: the server's model config, once | `vllm_client.get_server_info()` on the main process | kept |
| bounded server requests; the CPU colocate sync | the client's session adapter remounted (`backends.http`); `sync_weights` bound on the instance (`backends.cpu.weight_sync`) | kept |
| the hardening in `train`, `_save_checkpoint`, `create_model_card`; a resume inside a generation cycle reported | `common.CommonRoom` (ordinary overrides); `GenerationCycleResumeCheck` | kept |

A subclass implements `_per_token_policy_loss` and may override the other hooks; it never touches the parent's
generation object, slots or private attributes. `tests/integration/test_loss_gradient.py` checks the gradient through
GRPOTrainer's real `_compute_loss`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import is_peft_model
from torch import Tensor
from trl import GRPOTrainer

from dppo_trl.backends.cpu.construction import trainer_construction_patches
from dppo_trl.backends.cpu.engine import EngineOptions
from dppo_trl.backends.cpu.threads import cpu_colocate_threads, trainer_cpu_threads
from dppo_trl.backends.cpu.weight_sync import bind_colocate_weight_sync
from dppo_trl.backends.http import bound_server_requests
from dppo_trl.hardening.checkpoints import GenerationCycleResumeCheck
from dppo_trl.trainers.trl116 import PARENT_CLIP_METRICS
from dppo_trl.trainers.trl116.common import CommonRoom, PolicyForward, PolicyTerms, final_hidden_states
from dppo_trl.trainers.trl116.context_fit import ContextFit, fit_client_to_context, fit_engine_to_context
from dppo_trl.trainers.trl116.vllm_topk import VLLMTopKCapture
from dppo_trl.weights.stream import in_place_fallback_message, merged_named_weights, out_of_place_problems

__all__ = [
    "SAMPLING_LIST_IDS",
    "SAMPLING_LIST_LOGPS",
    "WEIGHTS_STEP",
    "HookedGRPOTrainer",
    "aggregate_per_token_loss",
    "grpo_arguments",
    "loss_mask",
    "merge_lora_out_of_place",
]

logger = logging.getLogger(__name__)

# Generation-batch keys the room adds (batch-major, so TRL's shuffle and split keep them aligned). grpo-8: the optimizer
# step whose weights sampled each row. grpo-5: the engine's `_rollout_logprobs()` entries per completion token,
# `(B, T, N + 1)`: slot 0 the sampled token, then the others by rank (id -1, log-prob -inf: padding, tool results).
WEIGHTS_STEP = "weights_step"
SAMPLING_LIST_IDS = "sampling_list_ids"
SAMPLING_LIST_LOGPS = "sampling_list_logps"

# The anchor is clamped here in the π_old slot before GRPOTrainer exponentiates `log π − old` for its bias-corrected
# β-KL: exp(60) is finite in float32.
_MU_FLOOR = -60.0

# What TRL's loss logs about its policy term, which with zeroed advantages describes none: its clip rates (always 0)
# and, with the entropy bonus, `policy_loss` (the β-KL part only).
_PARENT_POLICY_METRICS = (*PARENT_CLIP_METRICS, "policy_loss")


def grpo_arguments(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """`GRPOTrainer(*args, **kwargs)`'s constructor arguments by parameter name."""
    bound = inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs)
    return {name: value for name, value in bound.arguments.items() if name != "self"}


@dataclass
class _LossCall:
    """One call into the parent's loss: what its policy pass gave (π, entropies and, when asked for, hidden states)."""

    want_hidden: bool
    logps: Tensor | None = None
    entropies: Tensor | None = None
    hidden: Tensor | None = None


class HookedGRPOTrainer(CommonRoom, GRPOTrainer):
    """`GRPOTrainer` 1.16 with the hooks of docs/upstream.md ("GRPOTrainer"); see the module docstring. Takes
    `GRPOTrainer`'s arguments."""

    def __init__(self, *args: Any, **kwargs: Any):
        arguments = grpo_arguments(*args, **kwargs)
        config = arguments.get("args")
        # cpu-1, cpu-2: TRL's vLLM symbols are swapped only while the parent builds the engine or the client (the CPU
        # engine's settings; on a CPU trainer, a client with a file-based weight sync), then restored.
        with trainer_construction_patches(
            bool(getattr(config, "use_vllm", False)),
            getattr(config, "vllm_mode", "colocate"),
            EngineOptions.from_config(config),
            device=None if config is None else config.device,
        ):
            super().__init__(**arguments)
        # grpo-2: the parent's policy pass of one loss call; `None` outside a call into the parent.
        self._loss_call: _LossCall | None = None
        # grpo-1: set while the parent generates a batch whose π_old pass is declined.
        self._decline_old_pass = False
        # grpo-7: every vLLM sync sends LoRA weights merged out of place.
        self._merges_lora_out_of_place = merge_lora_out_of_place(self)
        # grpo-5 and grpo-6: the per-turn records of the engine's lists, and each turn fitted to its context.
        self._vllm_topk: VLLMTopKCapture | None = None
        self._context_fit = ContextFit()
        self.add_callback(GenerationCycleResumeCheck())  # warns when a resume lands inside a generation batch
        if self.args.use_vllm:
            self._open_engine()

    def _open_engine(self) -> None:
        """What the room sets on TRL's generation object once it is built (this trainer's instances only)."""
        generation = self.vllm_generation
        bind_colocate_weight_sync(generation)  # vLLM CPU colocate
        if self.args.vllm_mode == "colocate":
            llm = generation.llm
            self._context_fit = ContextFit(llm.llm_engine.model_config.max_model_len)
            fit_engine_to_context(llm, self._context_fit)
        elif self.accelerator.is_main_process:  # server mode: the one process that talks to the server
            client = generation.vllm_client
            bound_server_requests(client, getattr(self.args, "vllm_server_request_timeout", None))
            model_config = client.get_server_info()["model_config"]
            self._check_vllm_server(model_config)
            self._context_fit = ContextFit(int(model_config["max_model_len"]))
            fit_client_to_context(client, self._context_fit)
        n = self._rollout_logprobs()
        if n is not None:
            self._vllm_topk = VLLMTopKCapture(generation, n)
            if self.args.vllm_mode == "colocate" and "stop" not in generation.generation_kwargs:
                # TRL's colocate path reads token ids only; without this vLLM also decodes all N + 1 listed tokens of
                # every position to text, which dominates generation on small models.
                generation.generation_kwargs.setdefault("detokenize", False)

    # ------------------------------------------------------------------------------------------------------------
    # The hardening's parent-specific parts (`CommonRoom`)
    # ------------------------------------------------------------------------------------------------------------
    def _watched_server(self) -> tuple[str | None, str]:
        if not (self.args.use_vllm and self.args.vllm_mode == "server"):
            return None, ""
        client = getattr(self.vllm_generation, "vllm_client", None)  # built on the main process only
        url = getattr(client, "base_url", f"http://{self.args.vllm_server_host}:{self.args.vllm_server_port}")
        timeout = getattr(self.args, "vllm_server_request_timeout", None)
        return url, f"Requests are bounded by vllm_server_request_timeout={timeout} s."

    def _training_context(self) -> contextlib.AbstractContextManager:
        """A CPU trainer with a colocated vLLM engine trains with a bounded thread count (restored afterwards)."""
        threads = None
        if self.args.use_vllm and self.args.vllm_mode == "colocate" and self.accelerator.device.type == "cpu":
            threads = cpu_colocate_threads(self.accelerator.num_processes)
        return trainer_cpu_threads(threads)

    # ------------------------------------------------------------------------------------------------------------
    # The hooks a subclass implements or overrides
    # ------------------------------------------------------------------------------------------------------------
    def _per_token_policy_loss(self, inputs: dict, forward: PolicyForward) -> PolicyTerms:
        """The per-token policy term of one loss call, on the parent's forward (upstream grpo-2)."""
        raise NotImplementedError

    def _needs_old_per_token_logps(self) -> bool:
        """Whether the generation batch needs GRPOTrainer's no-grad π_old pass (upstream grpo-1)."""
        return self._parent_recomputes_old_logps()

    def _wants_hidden_states(self, inputs: dict) -> bool:
        """Whether this loss call's `PolicyForward` carries the final hidden states."""
        return False

    def _anchor_logps(self, inputs: dict) -> Tensor | None:
        """μ as the batch holds it (NaN where the engine reported none): `PolicyForward.old_log_probs`, and what TRL's
        bias-corrected β-KL takes its ratio against (upstream grpo-3); `None`: μ ≡ π."""
        return None

    def _rollout_logprobs(self) -> int | None:
        """Log-probs per sampled token the engine is asked for, in the batch as `SAMPLING_LIST_*` (upstream grpo-5);
        `None`: the sampled token's only (TRL's)."""
        return None

    def _check_vllm_server(self, model_config: dict) -> None:
        """Server mode, main process: the server's model config (`get_server_info()["model_config"]`), once."""

    def _on_generation_batch(self, output: dict) -> dict:
        """The generation batch with the subclass's keys (batch-major, so TRL's shuffle and split keep them aligned)."""
        return output

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

    # ------------------------------------------------------------------------------------------------------------
    # Generation: grpo-1 (the declined π_old pass), grpo-5, grpo-6, grpo-8
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
        """Parent's generation (its π_old pass declined when `_needs_old_per_token_logps()` says it is not needed),
        then the room's keys and the subclass's (`_on_generation_batch`)."""
        self._decline_old_pass = self._parent_recomputes_old_logps() and not self._needs_old_per_token_logps()
        if self._vllm_topk is not None:
            self._vllm_topk.reset()
        self._context_fit.reset()
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._decline_old_pass = False
        if self.args.use_vllm:
            self._log_context_fit()
            # GRPOTrainer loads the trainer's weights into the engine before generating whenever the optimizer step
            # changed, and records that step.
            completion_ids = output["completion_ids"]
            output[WEIGHTS_STEP] = torch.full(
                (completion_ids.size(0),), self._last_loaded_step, dtype=torch.long, device=completion_ids.device
            )
        if self._vllm_topk is not None:
            processing: Any = self.processing_class
            pad_token_id = getattr(processing, "tokenizer", processing).pad_token_id
            prompts, lengths = _unpadded_prompts_and_lengths(output, pad_token_id)
            output[SAMPLING_LIST_IDS], output[SAMPLING_LIST_LOGPS] = self._vllm_topk.pop(
                output["completion_ids"], loss_mask(output), prompts, lengths
            )
        return self._on_generation_batch(output)

    def _tool_call_loop(self, *args, **kwargs):
        """The parent's tool loop; while it runs, a turn whose prompt leaves the engine no room ends its rollout as
        truncated instead of raising (`ContextFit`)."""
        with self._context_fit.tool_loop():
            return super()._tool_call_loop(*args, **kwargs)

    def _log_context_fit(self) -> None:
        """Turns of this generation batch, over all processes, whose max_tokens was cut to the room left in the
        engine's context (`completions/context_clamped_turns`) or that had no room and ended their rollout
        (`completions/context_ended_turns`)."""
        fit = self._context_fit
        counts = torch.tensor([fit.clamped_turns, fit.ended_turns], device=self.accelerator.device)
        clamped, ended = self.accelerator.reduce(counts, reduction="sum").tolist()
        sink = self._metric_sink("train" if self.model.training else "eval")
        sink["completions/context_clamped_turns"].append(float(clamped))
        sink["completions/context_ended_turns"].append(float(ended))

    # ------------------------------------------------------------------------------------------------------------
    # The loss: grpo-2, grpo-3, grpo-4
    # ------------------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _calling_parent(self, call: _LossCall) -> Iterator[_LossCall]:
        """Make `call` the record of the parent's policy pass for the duration of the block (cleared even on error)."""
        if self._loss_call is not None:
            raise RuntimeError("Calls into GRPOTrainer's loss are not re-entrant.")
        self._loss_call = call
        try:
            yield call
        finally:
            self._loss_call = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """Parent's fused log-prob pass; inside a call (`_calling_parent`), also keep its π, entropies and, when asked
        for, hidden states. While generating a batch whose π_old is declined, decline the parent's π_old pass: in
        GRPOTrainer 1.16 it is the first policy pass after sampling whenever `_parent_recomputes_old_logps()` (source
        order pinned), and `(None, None, None)` is what the parent then stores as "no π_old"."""
        if self._decline_old_pass:
            self._decline_old_pass = False
            return None, None, None
        call = self._loss_call
        if call is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        if call.logps is not None:
            raise RuntimeError("GRPOTrainer's loss ran a second policy pass in one call: see tests/trl_contract.py.")
        capture: contextlib.AbstractContextManager[list[Tensor]] = (
            final_hidden_states(self.accelerator.unwrap_model(model))
            if call.want_hidden
            else contextlib.nullcontext([])
        )
        with capture as hiddens:
            result = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        if hiddens:
            # Hidden state at position i predicts token i+1, so the completion tokens are scored from [-T-1, -1).
            call.hidden = torch.cat(hiddens, dim=0)[:, -logits_to_keep - 1 : -1]
        call.logps, call.entropies = result[0], result[1]
        return result

    def _compute_loss(self, model, inputs):
        """TRL's loss on the batch with zeroed advantages (its forward, β-KL, entropy bonus, aux loss and metrics),
        plus the subclass's per-token policy loss on that forward, masked and aggregated as TRL masks and aggregates
        its own policy term."""
        anchor = self._anchor_logps(inputs)
        if anchor is not None:
            # grpo-3: TRL's bias-corrected β-KL takes its ratio against this slot.
            inputs = {**inputs, "old_per_token_logps": torch.nan_to_num(anchor, nan=0.0).clamp(min=_MU_FLOOR)}
        call = _LossCall(want_hidden=self._wants_hidden_states(inputs))
        silenced = {**inputs, "advantages": torch.zeros_like(inputs["advantages"])}
        with self._calling_parent(call):
            loss = super()._compute_loss(model, silenced)
        if call.logps is None:
            raise RuntimeError("GRPOTrainer._compute_loss made no policy pass: see tests/trl_contract.py.")
        sink = self._metric_sink("train" if self.model.training else "eval")
        for key in _PARENT_POLICY_METRICS:
            sink.pop(key, None)
        mask = loss_mask(inputs)
        forward = PolicyForward(
            log_probs=call.logps,
            old_log_probs=anchor,
            advantages=inputs["advantages"],
            tokens=mask.bool(),
            entropy=call.entropies,
            hidden=call.hidden,
        )
        terms = self._per_token_policy_loss(inputs, forward)
        per_token = self._masked_like_the_policy_term(terms.policy, inputs, forward.log_probs, call.entropies, mask)
        if terms.extra is not None:
            per_token = per_token + terms.extra
        return loss + self._aggregate(per_token, mask, inputs)

    def _masked_like_the_policy_term(
        self, per_token_loss: Tensor, inputs: dict, per_token_logps: Tensor, entropies: Tensor | None, mask: Tensor
    ) -> Tensor:
        """`per_token_loss` under the masks GRPOTrainer 1.16 puts on its own policy term after the loss type's
        surrogate: the off-policy sequence mask (`off_policy_mask_threshold`), the entropy mask (`top_entropy_quantile`)
        and the vLLM IS ratio (`vllm_importance_sampling_correction`)."""
        # restates-trl: begin GRPOTrainer._compute_loss (the masks on the policy term)
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old_per_token_logps = inputs.get("old_per_token_logps")
        old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
        if self.off_policy_mask_threshold is not None:
            sampling_per_token_logps = inputs.get("sampling_per_token_logps", old_per_token_logps)
            off_policy_mask = self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=sampling_per_token_logps,
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
            per_token_loss = per_token_loss * off_policy_mask
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            per_token_loss = per_token_loss * entropy_mask
        if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
        # restates-trl: end
        return per_token_loss


def loss_mask(batch: dict) -> Tensor:
    """The tokens GRPOTrainer's loss counts: `completion_mask`, times `tool_mask` with tools (as TRL builds it)."""
    # restates-trl: begin GRPOTrainer._compute_loss (the loss mask)
    mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
    # restates-trl: end
    return mask


def _unpadded_prompts_and_lengths(output: dict, pad_token_id: int) -> tuple[list[list[int]], list[int]]:
    """Each row's prompt ids without left padding, and its completion length, from a generation batch.

    The length is the row's `completion_mask` count; a row that `mask_truncated_completions` zeroed has none, and
    ends (being truncated) on a token that is not padding, so its length is up to its last non-pad token.
    """
    prompts = [
        ids[mask.bool()].tolist() for ids, mask in zip(output["prompt_ids"], output["prompt_mask"], strict=True)
    ]
    lengths = output["completion_mask"].sum(dim=1).tolist()
    for b, n in enumerate(lengths):
        if n == 0:
            real = (output["completion_ids"][b] != pad_token_id).nonzero()
            lengths[b] = int(real[-1]) + 1 if len(real) else 0
    return prompts, [int(n) for n in lengths]


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
# grpo-4: GRPOTrainer's aggregation of its policy term, restated
# ----------------------------------------------------------------------------------------------------------------
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

    Used for the subclass's per-token policy loss and its extra term (`HookedGRPOTrainer._compute_loss`), added to
    TRL's loss computed with zeroed advantages. The normalisers of TRL 1.16, gradient-accumulation scaling included
    (`training=False`: none, as in eval):

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
