"""`DPPOTrainer`: GRPOTrainer with DPPO's divergence trust region anchored on the rollout engine's μ.

DPPO's loss is `dppo_trl.core.loss.policy_loss` (eq. 11 with the trust region of `args.trust_region`). This module is
the adapter that makes GRPOTrainer's own `_compute_loss` apply it, so the entropy mask, β-KL (bias-corrected too),
the five aggregations, the entropy bonus, the MoE aux loss and gradient-accumulation scaling stay TRL's:

    DPPOTrainer._compute_loss(model, inputs)
      └ GRPOTrainer._compute_loss(model, inputs)          π = self._get_per_token_logps_and_entropies(...)
          └ self.get_off_policy_mask(advantages, π, μ, mask)   ← DPPO's weight m, at TRL's per-token mask slot
            = self._off_policy_mask(...) → self._dppo_weight(call, ...)
                  └ policy_loss(spec, LossInputs(π, μ, A, ...)) → coef w, D, μ-KL, stats
                  └ m = opened_clip_weight(w, π, μ)
          per-token term −r·A·m (clip opened, r = π/μ) = eq. 11: value −A·w, gradient −A·w·∇log π
      + the μ-KL term, aggregated like the policy term; `dppo/*` metrics logged once

What TRL 1.16 offers no seam for, and how this adapter bridges it (each pinned in tests/trl_contract.py; the TRL
change that removes it is in docs/upstream.md):

1. μ is the parent's `old_per_token_logps` (the engine's log-probs written at generation), so `r = π/μ`;
2. the parent's ratio clip is opened (`epsilon_low = 1`, `epsilon_high = ∞`) and `off_policy_mask_threshold = ∞`
   makes the parent call its mask hook (a user's own OPSM threshold still multiplies in);
3. the mask hook is static in TRL (`_StaticOnClassBoundOnInstance` keeps it TRL's on the class and binds it on the
   instance) and receives π but not the batch: `_compute_loss` hands the batch to it through `self._loss_call`, an
   instance slot set for the duration of that one parent call and cleared after, even on error;
4. GRPOTrainer runs a no-grad π_old pass whenever generation and optimisation are misaligned; DPPO anchors on μ, so
   `_get_per_token_logps_and_entropies` declines that pass (`_decline_old_pass`) instead of paying a forward.

`tests/integration/test_loss_gradient.py` checks the gradient against eq. 11 through the parent's real `_compute_loss`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from trl import GRPOTrainer
from trl.trainer.utils import maybe_gather_lm_head_ctx

from dppo_trl.backends.cpu.construction import trainer_construction_patches
from dppo_trl.backends.cpu.engine import EngineOptions
from dppo_trl.backends.cpu.http import bound_server_requests
from dppo_trl.backends.cpu.threads import cpu_colocate_threads, trainer_cpu_threads
from dppo_trl.backends.cpu.weight_sync import bind_colocate_weight_sync
from dppo_trl.core.functional import kept_log_mass, sanitize_behavior_logps
from dppo_trl.core.loss import LossInputs, LossOutputs, aggregate_per_token_loss, opened_clip_weight, policy_loss
from dppo_trl.core.metrics import observer_record
from dppo_trl.hardening.checkpoints import GenerationCycleResumeCheck, latest_complete_checkpoint, staged_checkpoint
from dppo_trl.hardening.distributed import check_distributed_setup
from dppo_trl.hardening.inputs import check_trainer_inputs
from dppo_trl.hardening.model_card import dataset_for_card, finish_model_card
from dppo_trl.hardening.preemption import raise_if_preempted, record_jit_checkpoints, resume_command
from dppo_trl.kernels.topk_logps import (
    LogitTransform,
    chunked_topk_logps,
    logps_at_ids_from_sampled,
    logps_at_ids_with_grad,
)
from dppo_trl.trainers.config import DPPOConfig, sampling_truncation, truncates_sampling
from dppo_trl.trainers.context_fit import ContextFit, fit_client_to_context, fit_engine_to_context
from dppo_trl.trainers.kept_set import engine_lists, kept_set_overflow
from dppo_trl.trainers.metric_logging import log_trust_region_metrics
from dppo_trl.trainers.vllm_topk import VLLMTopKCapture

logger = logging.getLogger(__name__)

# μ of a valid token is clamped here before GRPOTrainer exponentiates `log π − μ`: exp(60) is finite in fp32, and the
# weight returned by `get_off_policy_mask` is computed against the clamped value, so the product stays exact.
_MU_FLOOR = -60.0
# Extra per-row keys DPPOTrainer adds to the generation batch (batch-major, so TRL's shuffle/split keeps them aligned).
BEHAVIOR_LOGPS = "dppo_behavior_logps"
BEHAVIOR_VALID = "dppo_behavior_valid"
BEHAVIOR_TOPK_IDS = "dppo_behavior_topk_ids"
BEHAVIOR_TOPK_LOGPS = "dppo_behavior_topk_logps"
RECOMPUTED_LOGPS = "dppo_recomputed_logps"  # π_old, kept only for the ablations that need it
# Truncated sampling: the engine's N-entry lists (`VLLMTopKCapture` slots), whose finite entries are the kept set, and
# the positions where the kept set may exceed the list.
BEHAVIOR_KEPT_IDS = "dppo_behavior_kept_ids"
BEHAVIOR_KEPT_LOGPS = "dppo_behavior_kept_logps"
BEHAVIOR_KEPT_OVERFLOW = "dppo_behavior_kept_overflow"


@dataclass
class _LossCall:
    """What one DPPOTrainer call into the parent hands the parent's seams, and what they hand back.

    Attributes:
        want_hidden: the log-prob pass keeps the final hidden states (top-K divergences, kept set).
        hidden_with_graph: ... with their graph (the kept set's log-mass needs the gradient of π at the kept ids).
        batch: loss calls only: the batch (μ, its validity, π_old, μ's top-K).
        hidden, entropies: written by the log-prob pass.
        inputs, outputs, mask: written by the mask hook: the core's inputs and outputs for this call.
    """

    want_hidden: bool
    hidden_with_graph: bool = False
    batch: dict | None = None
    hidden: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    inputs: LossInputs | None = None
    outputs: LossOutputs | None = None
    mask: torch.Tensor | None = None


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


class DPPOTrainer(GRPOTrainer):
    """Trainer for Divergence Proximal Policy Optimization (DPPO).

    A drop-in replacement for [`~trl.GRPOTrainer`] — same constructor arguments — that takes a [`DPPOConfig`]. See the
    module docstring for how the loss composes with GRPOTrainer and `docs/theory.md` for the method.
    """

    args: DPPOConfig
    _tag_names = ["trl", "dppo", "grpo"]
    _name = "DPPO"
    _paper = {
        "title": "Rethinking the Trust Region in LLM Reinforcement Learning",
        "id": "2602.04879",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{qi2026rethinking,
                title        = {{Rethinking the Trust Region in LLM Reinforcement Learning}},
                author       = {Penghui Qi and Xiangxin Zhou and Zichen Liu and Tianyu Pang and Chao Du and Min Lin and Wee Sun Lee},
                year         = 2026,
                eprint       = {arXiv:2602.04879},
            }"""),
    }

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs)
        params = bound.arguments
        config = params.get("args")
        if config is None:
            model = params["model"]
            model_name = model if isinstance(model, str) else model.config._name_or_path
            config = params["args"] = DPPOConfig(f"{model_name.split('/')[-1]}-DPPO")
        elif not isinstance(config, DPPOConfig):
            raise TypeError(
                f"DPPOTrainer needs a DPPOConfig, got {type(config).__name__}. Build `DPPOConfig(...)` with the same "
                "fields (it subclasses GRPOConfig and sets the defaults DPPO needs)."
            )
        _validate_trainer_inputs(config, params)
        self._has_rollout_func = params.get("rollout_func") is not None  # μ then comes from the user's engine
        # Before the model is built: a wrong launch otherwise fails deep in DeepSpeed or silently runs plain DDP.
        check_distributed_setup(config)
        # TRL's vLLM symbols are patched only while the parent builds the engine/client (CPU engine defaults; a
        # client with a file-based weight sync when the trainer's device is the CPU), then restored.
        with trainer_construction_patches(config.use_vllm, config.vllm_mode, EngineOptions.from_config(config)):
            super().__init__(*bound.args[1:], **bound.kwargs)
        # After GRPOTrainer's own checks (its PEFT-on-lm_head and Liger-config errors come first, as with TRL) and
        # before `train()`, where transformers applies the Liger kernels (patching modules process-wide).
        self._check_liger_device()
        if self.args.use_vllm:
            bind_colocate_weight_sync(self.vllm_generation)  # vLLM CPU colocate: on this trainer's instance only
            if self.args.vllm_mode == "server" and self.accelerator.is_main_process:
                bound_server_requests(self.vllm_generation.vllm_client, self.args.vllm_server_request_timeout)
        self.add_callback(GenerationCycleResumeCheck())  # warns when a resume lands inside a generation batch
        self._jit_checkpoints = record_jit_checkpoints(self)  # SIGTERM checkpoints, to report a preempted run

        self.trust_region_spec = self.args.trust_region_spec()
        # Seam 3 (module docstring): the per-call slot the parent's seams read; `None` outside a DPPO call.
        self._loss_call: _LossCall | None = None
        # Seam 4: set while the parent generates a batch whose π_old pass DPPO declines.
        self._decline_old_pass = False
        # Seam 2: open GRPO's ratio clip: DPPO's trust region is the weight returned by `get_off_policy_mask`.
        self.epsilon_low, self.epsilon_high = 1.0, math.inf
        # A non-None threshold makes GRPOTrainer call `get_off_policy_mask`; the user's own OPSM threshold (if any)
        # still applies on top, through `self.args.off_policy_mask_threshold`.
        self.off_policy_mask_threshold = math.inf
        # Research hooks: each is called with the per-token tensors of every loss call (`_log_trust_region`).
        self.trust_region_observers: list = []
        self._vllm_topk: VLLMTopKCapture | None = None
        # Truncated sampling with vLLM: N, the entries per token the engine lists; its finite ones are the kept set.
        self._kept_set_size = self.args.kept_set_size
        # Each turn's max_tokens fitted to the room left in the engine's context (`dppo_trl/trainers/context_fit.py`).
        self._context_fit = ContextFit()
        if self.args.use_vllm:
            server_model_config = self._check_vllm_server()
            if self.args.vllm_mode == "colocate":
                llm = self.vllm_generation.llm
                self._context_fit = ContextFit(llm.llm_engine.model_config.max_model_len)
                fit_engine_to_context(llm, self._context_fit)
            elif server_model_config is not None:  # the main process, the only one that talks to the server
                self._context_fit = ContextFit(int(server_model_config["max_model_len"]))
                fit_client_to_context(self.vllm_generation.vllm_client, self._context_fit)
            if self._kept_set_size is not None:
                self._vllm_topk = VLLMTopKCapture(self.vllm_generation, self._kept_set_size)
            elif self.args.uses_top_k and self.args.anchor == "behavior":
                self._vllm_topk = VLLMTopKCapture(self.vllm_generation, self.args.divergence_top_k)
            if self._vllm_topk is not None:
                gen_kwargs = self.vllm_generation.generation_kwargs
                if self.args.vllm_mode == "colocate" and "stop" not in gen_kwargs:
                    # TRL's colocate path reads token ids only; without this vLLM also decodes all K+1 candidate
                    # tokens of every position to text, which dominates generation on small models.
                    gen_kwargs.setdefault("detokenize", False)

    # ------------------------------------------------------------------------------------------------------------
    # Seams (each a thin wrapper around GRPOTrainer's method)
    # ------------------------------------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        """Generate with the parent, then make `old_per_token_logps` the behavior policy μ and attach μ's top-K."""
        if self._vllm_topk is not None:
            self._vllm_topk.reset()
        self._context_fit.reset()
        self._decline_old_pass = self._parent_recomputes_old_logps() and self._discards_parent_old_logps()
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._decline_old_pass = False
        self._log_context_fit()
        mask = (
            output["completion_mask"] if "tool_mask" not in output else output["completion_mask"] * output["tool_mask"]
        )

        if self.trust_region_spec.region.needs_old_logps:
            recomputed = output.get("old_per_token_logps")
            if recomputed is None and self.args.use_vllm:
                recomputed, _ = self._policy_forward(output, mask, want_topk=False)
            if recomputed is not None:
                output[RECOMPUTED_LOGPS] = recomputed.float()
        behavior, topk = self._behavior_policy(output, mask)
        if behavior is not None:
            output = _with_behavior_invariants({**output, BEHAVIOR_LOGPS: behavior})
            invalid = (~output[BEHAVIOR_VALID] & mask.bool()).sum()
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["dppo/invalid_behavior_logps"].append(self.accelerator.gather(invalid).sum().item())
        if topk is not None and self._kept_set_size is not None:
            ids, lists = topk[0], engine_lists(topk[1])
            output[BEHAVIOR_KEPT_IDS], output[BEHAVIOR_KEPT_LOGPS] = ids, lists
            top_k = sampling_truncation(self.args)[0]
            output[BEHAVIOR_KEPT_OVERFLOW] = kept_set_overflow(lists, self._kept_set_size, top_k) & mask.bool()
        elif topk is not None:
            output[BEHAVIOR_TOPK_IDS], output[BEHAVIOR_TOPK_LOGPS] = topk
        return output

    def _tool_call_loop(self, *args, **kwargs):
        """The parent's tool loop; while it runs, a turn whose prompt leaves the engine no room ends its rollout as
        truncated instead of raising (`ContextFit`)."""
        with self._context_fit.tool_loop():
            return super()._tool_call_loop(*args, **kwargs)

    def _log_context_fit(self) -> None:
        """Turns of this generation batch, over all processes, whose max_tokens was cut to the room left in the
        engine's context (`completions/context_clamped_turns`) or that had no room and ended their rollout
        (`completions/context_ended_turns`)."""
        if not self.args.use_vllm:
            return
        fit = self._context_fit
        counts = torch.tensor([fit.clamped_turns, fit.ended_turns], device=self.accelerator.device)
        clamped, ended = self.accelerator.reduce(counts, reduction="sum").tolist()
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["completions/context_clamped_turns"].append(float(clamped))
        self._metrics[mode]["completions/context_ended_turns"].append(float(ended))

    def _check_liger_device(self) -> None:
        """`use_liger_kernel=True` needs CUDA: Liger's Triton layer kernels fail on the first forward elsewhere."""
        if self.args.use_liger_kernel and self.accelerator.device.type != "cuda":
            raise ValueError(
                f"use_liger_kernel=True applies Liger's Triton layer kernels, which need a CUDA device; this trainer "
                f"runs on {self.accelerator.device.type!r}. Set use_liger_kernel=False. (With CUDA it only swaps "
                "RMSNorm/SwiGLU/RoPE kernels; the DPPO loss is always computed by DPPOTrainer.)"
            )

    def _discards_parent_old_logps(self) -> bool:
        """Whether GRPOTrainer's no-grad π_old pass would be thrown away: μ comes from the engine (vLLM colocate or
        server, or a `rollout_func`), DPPO anchors on it, and no trust region of `dppo_trl.core.registry` asks for π_old.

        Kept: `anchor="recompute"` (the ablation anchors on π_old), `needs_old_logps` entries, and transformers
        generation, where the parent's recompute of the generating weights *is* μ.
        """
        engine_mu = self.args.use_vllm or self._has_rollout_func
        region = self.trust_region_spec.region
        return engine_mu and self.args.anchor == "behavior" and not region.needs_old_logps

    def _parent_recomputes_old_logps(self) -> bool:
        """GRPOTrainer 1.16's own condition for its no-grad π_old pass in `_generate_and_score_completions`
        (misaligned generation and optimisation, or vLLM IS correction; pinned in tests/trl_contract.py)."""
        steps_per_generation = self.args.steps_per_generation
        assert steps_per_generation is not None  # GRPOConfig.__post_init__ resolves None
        generate_every = steps_per_generation * self.args.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.args.use_vllm and self.args.vllm_importance_sampling_correction
        )

    @contextlib.contextmanager
    def _calling_parent(self, call: _LossCall) -> Iterator[_LossCall]:
        """Make `call` the parent seams' slot for the duration of the block (cleared even on error)."""
        if self._loss_call is not None:
            raise RuntimeError("DPPOTrainer calls into GRPOTrainer are not re-entrant.")
        self._loss_call = call
        try:
            yield call
        finally:
            self._loss_call = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """Parent's fused log-prob pass; inside a DPPO call (`_calling_parent`), also keep the hidden states and
        entropies. While generating a batch whose π_old DPPO does not use, decline the parent's π_old pass: in
        GRPOTrainer 1.16 it is the first policy pass after sampling whenever `_parent_recomputes_old_logps()` (source
        order pinned), and `(None, None, None)` is what the parent then stores as "no π_old"."""
        if self._decline_old_pass:
            self._decline_old_pass = False
            return None, None, None
        capture = self._loss_call
        if capture is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        hiddens: list[torch.Tensor] = []
        handle = None
        if capture.want_hidden:
            handle = _backbone(self.accelerator.unwrap_model(model)).register_forward_hook(
                lambda _module, _inputs, out: hiddens.append(
                    _last_hidden_state(out) if capture.hidden_with_graph else _last_hidden_state(out).detach()
                )
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
        """Parent's loss with DPPO's per-token weight at its mask slot (`get_off_policy_mask`), plus the μ-KL term."""
        inputs = _with_behavior_invariants(inputs)
        kept = BEHAVIOR_KEPT_IDS in inputs
        call = _LossCall(
            want_hidden=kept or (self.args.uses_top_k and BEHAVIOR_TOPK_IDS in inputs),
            hidden_with_graph=kept,
            batch=inputs,
        )
        with self._calling_parent(call):
            loss = super()._compute_loss(model, inputs)
        if call.outputs is None or call.inputs is None or call.mask is None:
            raise RuntimeError("GRPOTrainer._compute_loss did not call `get_off_policy_mask`: see trl_contract.py.")
        mode = "train" if self.model.training else "eval"
        if call.outputs.mu_kl is not None:
            loss = loss + self._aggregate_like_policy(call.outputs.mu_kl, call.mask, inputs)
        if call.outputs.kept_correction is not None:
            # The parent's term has gradient −A·w·∇log π; this one adds A·w·∇log π(kept), so their sum is eq. 11 with
            # π_kept. It is part of the policy term, so GRPOTrainer's entropy mask (if any) applies to it as well.
            correction = call.outputs.kept_correction
            if self.args.top_entropy_quantile < 1.0 and call.entropies is not None:
                correction = correction * self.get_high_entropy_mask(
                    call.entropies, call.mask, 1 - self.args.top_entropy_quantile
                )
            loss = loss + self._aggregate_like_policy(correction, call.mask, inputs)
        self._log_trust_region(call, mode)
        return loss

    def _aggregate_like_policy(self, per_token: torch.Tensor, mask: torch.Tensor, inputs: dict) -> torch.Tensor:
        """A per-token term GRPOTrainer has no slot for, aggregated exactly like its policy term."""
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

    def _off_policy_mask(
        self,
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """What `self.get_off_policy_mask(...)` is on a DPPOTrainer: the per-token weight GRPOTrainer's loss multiplies
        its policy term by. DPPO's `opened_clip_weight` inside a DPPO loss call, TRL's OPSM mask anywhere else."""
        call = self._loss_call
        if call is None or call.batch is None:
            return GRPOTrainer.get_off_policy_mask(
                advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
            )
        return self._dppo_weight(call, advantages, per_token_logps, sampling_per_token_logps, mask)

    get_off_policy_mask = _StaticOnClassBoundOnInstance(GRPOTrainer.get_off_policy_mask, "_off_policy_mask")

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card with honest provenance and versions (`dppo_trl/hardening/model_card.py`), plus the DPPO settings."""
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags += ["dppo", f"dppo-{self.args.divergence.replace('_', '-')}"]
        model_name = model_name or (self.args.hub_model_id or os.path.normpath(self.args.output_dir)).split("/")[-1]
        hub_dataset, _ = dataset_for_card(dataset_name)  # a local path never reaches the card's metadata
        super().create_model_card(model_name=model_name, dataset_name=hub_dataset, tags=tags)
        path = os.path.join(self.args.output_dir, "README.md")
        if self.is_world_process_zero() and os.path.exists(path):
            finish_model_card(
                path,
                args=self.args,
                model_name_or_path=getattr(self.model.config, "_name_or_path", None),
                dataset_name=dataset_name,
                model_name=model_name,
                hub_model_id=self.hub_model_id,
                processing_class=self.processing_class,
                train_dataset=self.train_dataset,
            )
            with open(path, "a", encoding="utf-8") as card:
                card.write("\n" + dppo_card_section(self.args))

    def train(self, *args, **kwargs):
        """Parent's `train`; a CPU trainer with a colocated vLLM engine trains with a bounded thread count (restored
        afterwards), and a run stopped by SIGTERM (`enable_jit_checkpoint`) raises `TrainingPreempted` (exit 143)
        after its checkpoint instead of returning as if it had finished (`dppo_trl/hardening/preemption.py`)."""
        threads = None
        if self.args.use_vllm and self.args.vllm_mode == "colocate" and self.accelerator.device.type == "cpu":
            threads = cpu_colocate_threads(self.accelerator.num_processes)
        with trainer_cpu_threads(threads), self._server_failures():
            output = super().train(*args, **kwargs)
        raise_if_preempted(self._jit_checkpoints, self.accelerator.is_main_process)
        return output

    @contextlib.contextmanager
    def _server_failures(self):
        """Server mode: a failed request to the vLLM server (killed, hung, unreachable) ends training with an error
        naming the server, the last complete checkpoint and how to resume."""
        if not (self.args.use_vllm and self.args.vllm_mode == "server"):
            yield
            return
        import requests

        try:
            yield
        except requests.exceptions.RequestException as error:
            client = getattr(self.vllm_generation, "vllm_client", None)
            url = getattr(client, "base_url", f"http://{self.args.vllm_server_host}:{self.args.vllm_server_port}")
            latest = latest_complete_checkpoint(self._get_output_dir(trial=None))
            resume = (
                f"restart it and resume with `{resume_command(latest)}` (or `--resume_from_checkpoint latest` with "
                f"examples/train_dapo_math.py)"
                if latest
                else "restart it and train again (no checkpoint was saved)"
            )
            raise RuntimeError(
                f"The vLLM server at {url} stopped answering ({type(error).__name__}: {error}). Training stopped; "
                f"{resume}. Requests are bounded by vllm_server_request_timeout="
                f"{self.args.vllm_server_request_timeout} s."
            ) from error

    def _save_checkpoint(self, model, trial):
        """Parent's checkpoint, written under a staging name and renamed when complete (`dppo_trl/hardening/checkpoints.py`)."""
        with staged_checkpoint(self, trial):
            super()._save_checkpoint(model, trial)

    # ------------------------------------------------------------------------------------------------------------
    # DPPO glue
    # ------------------------------------------------------------------------------------------------------------
    def _behavior_policy(self, output: dict, mask: torch.Tensor):
        """Pick μ for this generation batch: `(behavior log-probs or None, (top-K ids, logps) or None)`.

        - vLLM / `rollout_func`: the engine's sampled-token log-probs; top-K from the engine.
        - transformers `generate`, off-policy: TRL's recompute of the generating weights (that *is* the engine).
        - transformers `generate`, on-policy: `None` — μ ≡ π and the parent falls back to `π.detach()`.
        - `anchor="recompute"` (ablation): the trainer's π_old, recomputed here if the parent did not.
        """
        want_topk = self.args.uses_top_k
        topk = None
        if self.args.anchor == "recompute":
            behavior = output.get("old_per_token_logps")
            if behavior is None and not self.args.use_vllm:
                return None, None  # on-policy transformers generation: π_old ≡ π, the parent's own fallback
            if behavior is None or want_topk:
                logps, topk = self._policy_forward(output, mask, want_topk)
                behavior = logps if behavior is None else behavior
            return behavior, topk

        behavior = output.get("sampling_per_token_logps")
        if behavior is not None:
            if self._vllm_topk is not None:
                prompts, lengths = _unpadded_prompts_and_lengths(output, self._tokenizer.pad_token_id)
                topk = self._vllm_topk.pop(output["completion_ids"], mask, prompts, lengths)
            elif want_topk:
                raise ValueError(
                    "Top-K DPPO needs μ's top-K log-probs from the engine; a `rollout_func` supplies only sampled-token "
                    "log-probs. Use a binary divergence with `rollout_func`."
                )
            return behavior, topk

        behavior = output.get("old_per_token_logps")
        if behavior is not None and want_topk:
            _, topk = self._policy_forward(output, mask, want_topk=True)
        return behavior, topk

    @torch.no_grad()
    def _policy_forward(self, output: dict, mask: torch.Tensor, want_topk: bool):
        """One no-grad pass of the current weights over the batch: sampled-token log-probs and, if asked, top-K.

        Uses the parent's fused log-prob pass, so no `[B, T, V]` logits are built; the top-K comes from the captured
        hidden states through a chunked vocabulary scan.
        """
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        logits_to_keep = output["completion_ids"].size(1)
        with self._calling_parent(_LossCall(want_hidden=want_topk)) as capture:
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=self.args.per_device_train_batch_size,
            )
        if not want_topk:
            return logps, None
        if capture.hidden is None:
            raise RuntimeError("DPPO top-K needs the policy's final hidden states, but none were captured.")
        k = self.args.divergence_top_k
        valid = mask.bool()
        weight, bias = self._lm_head_params()
        with maybe_gather_lm_head_ctx(weight, bias):
            top_logps, top_ids = chunked_topk_logps(
                capture.hidden[valid], _full(weight), k, bias=_full(bias), transform=self._logit_transform()
            )
        ids = torch.full((*mask.shape, k + 1), -1, dtype=torch.long, device=mask.device)
        slot_logps = torch.full((*mask.shape, k + 1), -math.inf, dtype=torch.float32, device=mask.device)
        sampled = output["completion_ids"][valid]
        # Slot 0 is the sampled token; slots 1..K are TopK(μ) without it (its slot is moved to the end as padding).
        not_sampled = top_ids != sampled.unsqueeze(-1)
        order = torch.argsort((~not_sampled).to(torch.int8), dim=-1, stable=True)
        rest_ids = torch.where(not_sampled, top_ids, -1).gather(-1, order)
        rest_logps = torch.where(not_sampled, top_logps, -math.inf).gather(-1, order)
        ids[valid] = torch.cat([sampled.unsqueeze(-1), rest_ids], dim=-1)
        slot_logps[valid] = torch.cat([logps[valid].float().unsqueeze(-1), rest_logps], dim=-1)
        return logps, (ids, slot_logps)

    def _dppo_weight(self, call: _LossCall, advantages, per_token_logps, sampling_per_token_logps, mask):
        """The detached weight the parent multiplies `−r·A` by: `opened_clip_weight` of the core's coefficient.

        Called by the parent's mask hook, where π first appears; records the core's inputs and outputs in `call`.
        """
        batch = call.batch
        assert batch is not None
        with torch.no_grad():
            tokens = mask.bool()
            if BEHAVIOR_LOGPS not in batch:
                # On-policy transformers generation: μ ≡ π, so D = 0, r = 1 and nothing is masked.
                mu_logps, valid = per_token_logps.detach().float(), torch.ones_like(tokens)
            else:
                mu_logps, valid = batch[BEHAVIOR_LOGPS].float(), batch[BEHAVIOR_VALID].bool()
            topk = None
            if call.want_hidden and BEHAVIOR_KEPT_IDS not in batch:
                topk = self._pi_topk(call, per_token_logps.detach().float(), tokens & valid)
        log_mass = overflow = None
        if BEHAVIOR_KEPT_IDS in batch:
            log_mass, overflow, topk = self._pi_kept(call, per_token_logps, tokens & valid)
        old = batch.get(RECOMPUTED_LOGPS)
        inputs = LossInputs(
            pi_logps=per_token_logps,
            mu_logps=mu_logps,
            advantages=advantages,
            tokens=tokens,
            valid=valid,
            old_logps=old.float() if old is not None else None,
            pi_topk_logps=topk[0] if topk else None,
            mu_topk_logps=topk[1] if topk else None,
            entropies=call.entropies,
            kept_log_mass=log_mass,
            kept_overflow=overflow,
        )
        outputs = policy_loss(self.trust_region_spec, inputs)
        with torch.no_grad():
            parent_old = batch.get("old_per_token_logps")
            weight = opened_clip_weight(
                outputs.coef, per_token_logps, per_token_logps.detach() if parent_old is None else parent_old
            )
            if self.args.off_policy_mask_threshold is not None:
                weight = weight * GRPOTrainer.get_off_policy_mask(
                    advantages=advantages,
                    per_token_logps=per_token_logps,
                    sampling_per_token_logps=sampling_per_token_logps,
                    mask=mask,
                    off_policy_threshold=self.args.off_policy_mask_threshold,
                )
        call.inputs, call.outputs, call.mask = inputs, outputs, mask
        return weight.to(per_token_logps.dtype)

    def _log_trust_region(self, call: _LossCall, mode: str) -> None:
        """Once per loss call: hand the per-token view to `trust_region_observers`, log the `dppo/*` metrics."""
        assert call.inputs is not None and call.outputs is not None and call.batch is not None
        if self.trust_region_observers:
            record = {
                "completion_ids": call.batch["completion_ids"],
                **observer_record(call.inputs, call.outputs.coef, call.outputs.divergence),
                "mode": mode,
            }
            for observer in self.trust_region_observers:
                observer(record)
        log_trust_region_metrics(self, call.outputs.stats, mode)

    def _pi_topk(self, call: _LossCall, pi_logps: torch.Tensor, valid: torch.Tensor):
        """π's log-probs at μ's TopK ∪ {y} ids, from the hidden states the call captured (no `[B, T, V]` logits)."""
        capture, batch = call, call.batch
        assert batch is not None
        ids, mu_topk = batch[BEHAVIOR_TOPK_IDS], batch[BEHAVIOR_TOPK_LOGPS].float()
        if capture.hidden is None:
            raise RuntimeError("DPPO top-K needs the policy's final hidden states, but none were captured.")
        weight, bias = self._lm_head_params()
        pi_topk = torch.full_like(mu_topk, -math.inf)
        with maybe_gather_lm_head_ctx(weight, bias):
            pi_topk[valid] = logps_at_ids_from_sampled(
                capture.hidden[valid],
                _full(weight),
                ids[valid],
                ids[valid][:, 0],
                pi_logps[valid],
                bias=_full(bias),
                transform=self._logit_transform(),
            )
        # Rows outside `valid` must not leak into the divergence: give both sides identical padding.
        mu_topk = torch.where(valid.unsqueeze(-1), mu_topk, torch.full_like(mu_topk, -math.inf))
        return pi_topk, mu_topk

    def _pi_kept(self, call: _LossCall, pi_logps: torch.Tensor, valid: torch.Tensor):
        """Truncated sampling: `(log π(kept), overflow, top-K lists or None)` for the core.

        π's log-probs at the engine's listed ids come from the hidden states with their graph
        (`logps_at_ids_with_grad`, J + 1 dot products per token, no `[B, T, V]` logits), so log π(kept) carries the
        gradient of every kept id; the kept ids are those with a finite μ in the engine's list. Under a top-K
        divergence its lists are the first K + 1 slots (y_t and TopK(μ)), restricted to the kept ids by the core.
        """
        batch = call.batch
        assert batch is not None
        if call.hidden is None:
            raise RuntimeError("DPPO's kept set needs the policy's final hidden states, but none were captured.")
        ids, mu_lists = batch[BEHAVIOR_KEPT_IDS], batch[BEHAVIOR_KEPT_LOGPS].float()
        weight, bias = self._lm_head_params()
        pi_lists = torch.full(mu_lists.shape, -math.inf, dtype=torch.float32, device=mu_lists.device)
        # ZeRO-3: the head is gathered for the forward here and again by the gather's own backward (as TRL's head does).
        with maybe_gather_lm_head_ctx(weight, bias):
            pi_lists[valid] = logps_at_ids_with_grad(
                call.hidden[valid],
                _full(weight),
                ids[valid],
                ids[valid][:, 0],
                pi_logps[valid].float(),
                bias=_full(bias),
                transform=self._logit_transform(),
            )
        kept = torch.isfinite(mu_lists) & (ids >= 0) & valid.unsqueeze(-1)
        log_mass = kept_log_mass(pi_lists, kept)
        topk = None
        if self.args.uses_top_k:
            width = self.args.divergence_top_k + 1
            mu_topk = torch.where(
                valid.unsqueeze(-1), mu_lists[..., :width], torch.full_like(mu_lists[..., :width], -math.inf)
            )
            topk = (pi_lists[..., :width].detach(), mu_topk)
        return log_mass, batch[BEHAVIOR_KEPT_OVERFLOW].bool(), topk

    def _lm_head_params(self):
        head = _unwrapped_causal_lm(self.accelerator.unwrap_model(self.model)).get_output_embeddings()
        return head.weight, getattr(head, "bias", None)

    def _logit_transform(self) -> LogitTransform:
        config = _unwrapped_causal_lm(self.accelerator.unwrap_model(self.model)).config
        return LogitTransform.from_model_config(config, temperature=self.args.temperature)

    def _check_vllm_server(self) -> dict | None:
        """Server mode: μ must be the processed (post-temperature) log-probs, and the server must allow K of them.
        Returns the server's model config on the process that talks to it (`None` elsewhere)."""
        if self.args.vllm_mode != "server" or not self.accelerator.is_main_process:
            return None
        model_config = self.vllm_generation.vllm_client.get_server_info()["model_config"]
        if model_config.get("logprobs_mode") != "processed_logprobs":
            raise ValueError(
                f"The vLLM server runs with `--logprobs-mode {model_config.get('logprobs_mode')}`: its log-probs are "
                "not the distribution it sampled from, so they cannot anchor DPPO. Restart `trl vllm-serve` (GPU) with "
                "`--logprobs-mode processed_logprobs`, or use `python -m dppo_trl.backends.cpu.vllm_server` (CPU), which sets it."
            )
        max_logprobs = model_config.get("max_logprobs")
        k = self.args.divergence_top_k
        if self.args.uses_top_k and max_logprobs is not None and 0 <= max_logprobs < k:
            raise ValueError(
                f"divergence_top_k={k} exceeds the vLLM server's `--max-logprobs {max_logprobs}`. Restart the server "
                f"with `--max-logprobs {k}` (or -1), or lower divergence_top_k."
            )
        n = self.args.kept_set_size
        if n is not None and max_logprobs is not None and 0 <= max_logprobs < n:
            raise ValueError(
                f"Truncated sampling needs the engine's kept set: {n} log-probs per token (`kept_set_logprobs`), more "
                f"than the vLLM server's `--max-logprobs {max_logprobs}`. Restart the server with `--max-logprobs {n}` "
                f"(or -1), or set kept_set_logprobs ≤ {max_logprobs}."
            )
        return model_config


def dppo_card_section(args: DPPOConfig) -> str:
    """Markdown section with the DPPO settings, appended to TRL's model card."""
    rows = [
        ("divergence", args.divergence),
        ("delta_low / delta_high", f"{args.delta_low} / {args.delta_high}"),
        ("ratio_cap (C)", args.ratio_cap),
        ("anchor", args.anchor),
        ("top-K (K)", args.divergence_top_k if args.uses_top_k else "–"),
        (
            "truncated sampling",
            "–"
            if args.kept_set_size is None
            else "top_k={}, top_p={}, min_p={}: π over the engine's kept set (N = {})".format(
                *sampling_truncation(args), args.kept_set_size
            ),
        ),
        ("loss_type", args.loss_type),
        ("beta", args.beta),
        ("learning_rate", args.learning_rate),
        ("num_generations", args.num_generations),
        ("temperature", args.temperature),
        ("generation", f"vLLM ({args.vllm_mode})" if args.use_vllm else "transformers"),
    ]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return (
        "## DPPO configuration\n\nTrained with [dppo-trl](https://arxiv.org/abs/2602.04879) "
        "(Divergence Proximal Policy Optimization).\n\n| setting | value |\n|---|---|\n" + table + "\n"
    )


def _validate_trainer_inputs(config: DPPOConfig, params: dict) -> None:
    """Checks that need the trainer's arguments, not only the config (run before anything is built)."""
    if config.uses_top_k and params.get("rollout_func") is not None:
        raise ValueError(
            f"divergence={config.divergence!r} needs μ's top-K log-probs from the engine; a `rollout_func` supplies "
            "only sampled-token log-probs. Use divergence='binary_tv' or 'binary_kl' with `rollout_func`."
        )
    if truncates_sampling(config) and params.get("rollout_func") is not None:
        raise ValueError(
            "Truncated sampling (top_k > 0, top_p < 1 or min_p > 0) with a `rollout_func`: the rollout returns "
            "sampled-token log-probs only, so the engine's kept set is unknown and π/μ would be biased. Sample "
            "untruncated in the rollout and set top_k=0, top_p=1.0, min_p=0.0."
        )
    check_trainer_inputs(config, params)  # datasets, chat template, lengths (dppo_trl/hardening/inputs.py)


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


def _with_behavior_invariants(inputs: dict) -> dict:
    """A copy of a batch in which μ upholds what the loss relies on, whoever built the batch.

    μ (`BEHAVIOR_LOGPS`, or `old_per_token_logps` when a caller supplies only that) is sanitised: NaN, ±inf or
    positive values become invalid (weight 0; counted in `dppo/invalid_behavior_ratio`), and what the parent
    exponentiates is clamped at `_MU_FLOOR`, so `exp(log π − old)` cannot overflow. Generation applies it once; the
    loss applies it again (a few element-wise ops) so it never depends on its caller.
    """
    source = BEHAVIOR_LOGPS if BEHAVIOR_LOGPS in inputs else "old_per_token_logps"
    if inputs.get(source) is None:
        return inputs  # on-policy: the parent falls back to π.detach(), μ ≡ π
    mu_logps, valid = sanitize_behavior_logps(inputs[source])
    if BEHAVIOR_VALID in inputs:
        valid = valid & inputs[BEHAVIOR_VALID].bool()
    mu_logps = torch.where(valid, mu_logps, torch.zeros_like(mu_logps))
    return {
        **inputs,
        BEHAVIOR_LOGPS: mu_logps,
        BEHAVIOR_VALID: valid,
        "old_per_token_logps": mu_logps.clamp(min=_MU_FLOOR),
    }


def _unwrapped_causal_lm(model):
    """The `PreTrainedModel` carrying the LM head (under PEFT, the wrapped base model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _backbone(model):
    """The decoder whose output the fused LM head projects (`PreTrainedModel.base_model`)."""
    return _unwrapped_causal_lm(model).base_model


def _last_hidden_state(output) -> torch.Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def _full(param):
    """FSDP2 exposes sharded parameters as DTensors; the projections need the full tensor."""
    if param is not None and hasattr(param, "full_tensor"):
        return param.full_tensor()
    return param
