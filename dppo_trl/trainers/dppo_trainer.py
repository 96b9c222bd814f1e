"""`DPPOTrainer`: GRPOTrainer with DPPO's divergence trust region anchored on the rollout engine's μ.

DPPO's loss is `dppo_trl.core.loss.policy_loss` (eq. 11 with the trust region of `args.trust_region`). `DPPOTrainer`
subclasses `HookedGRPOTrainer` (`dppo_trl.trainers.trl116.grpo`, the room where TRL 1.16's bridging lives) and
implements its policy-loss hook, one method that reads top to bottom:

    DPPOTrainer._policy_loss_terms(inputs, policy)          called by the parent's loss, where π first appears
      ├ batch = _with_behavior_invariants(inputs)              μ sanitised
      ├ loss_inputs = self._loss_inputs(batch, policy)         LossInputs(π, μ, A, ...), π at the engine's lists
      ├ outputs = policy_loss(self.trust_region_spec, loss_inputs)
      ├ self._log_trust_region(batch, loss_inputs, outputs)    `dppo/*` metrics, observers
      └ PolicyTerms(coef=w, extra=μ-KL, policy_extra=kept-set correction)
    which the parent aggregates: −A·w·∇log π as GRPOTrainer's own policy term (its entropy mask, β-KL — bias-corrected
    too —, the five aggregations, entropy bonus, MoE aux loss, gradient-accumulation scaling), plus the extra terms.

Generation attaches μ (the engine's log-probs), its top-K or kept-set lists and their validity to the batch.
`tests/integration/test_loss_gradient.py` checks the gradient against eq. 11 through the parent's real `_compute_loss`.
"""

from __future__ import annotations

import inspect
import logging
import math

import torch
from trl import GRPOTrainer
from trl.trainer.utils import maybe_gather_lm_head_ctx

from dppo_trl.backends.cpu.construction import trainer_construction_patches
from dppo_trl.backends.cpu.engine import EngineOptions
from dppo_trl.backends.cpu.threads import cpu_colocate_threads, trainer_cpu_threads
from dppo_trl.backends.cpu.weight_sync import bind_colocate_weight_sync
from dppo_trl.backends.http import bound_server_requests
from dppo_trl.core.functional import sanitize_behavior_logps
from dppo_trl.core.loss import LossInputs, LossOutputs, policy_loss
from dppo_trl.core.metrics import observer_record
from dppo_trl.core.sync_check import fresh_rollout_sums
from dppo_trl.hardening.checkpoints import GenerationCycleResumeCheck, staged_checkpoint
from dppo_trl.hardening.distributed import check_distributed_setup
from dppo_trl.hardening.inputs import check_trainer_inputs
from dppo_trl.hardening.model_card import DPPO_PAPER, write_model_card
from dppo_trl.hardening.training import hardened_training
from dppo_trl.kernels.engine_view import (
    EngineListView,
    engine_list_view,
    full,
    lm_head,
    logit_transform,
)
from dppo_trl.kernels.topk_logps import LogitTransform, chunked_topk_logps
from dppo_trl.trainers.config import DPPOConfig, sampling_truncation, truncates_sampling
from dppo_trl.trainers.kept_set import engine_lists, kept_set_overflow
from dppo_trl.trainers.metric_logging import log_trust_region_metrics
from dppo_trl.trainers.sync_check import SyncCheck
from dppo_trl.trainers.trl116.context_fit import ContextFit, fit_client_to_context, fit_engine_to_context
from dppo_trl.trainers.trl116.grpo import HookedGRPOTrainer, PolicyPass, PolicyTerms
from dppo_trl.trainers.vllm_topk import VLLMTopKCapture

logger = logging.getLogger(__name__)

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


class DPPOTrainer(HookedGRPOTrainer):
    """Trainer for Divergence Proximal Policy Optimization (DPPO).

    A drop-in replacement for [`~trl.GRPOTrainer`] — same constructor arguments — that takes a [`DPPOConfig`]. See the
    module docstring for how the loss composes with GRPOTrainer and `docs/theory.md` for the method.
    """

    args: DPPOConfig
    _tag_names = ["trl", "dppo", "grpo"]
    _name = "DPPO"
    _paper = DPPO_PAPER

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
        with trainer_construction_patches(
            config.use_vllm, config.vllm_mode, EngineOptions.from_config(config), device=config.device
        ):
            super().__init__(*bound.args[1:], **bound.kwargs)
        # After GRPOTrainer's own checks (its PEFT-on-lm_head and Liger-config errors come first, as with TRL) and
        # before `train()`, where transformers applies the Liger kernels (patching modules process-wide).
        self._check_liger_device()
        if self.args.use_vllm:
            bind_colocate_weight_sync(self.vllm_generation)  # vLLM CPU colocate: on this trainer's instance only
            if self.args.vllm_mode == "server" and self.accelerator.is_main_process:
                bound_server_requests(self.vllm_generation.vllm_client, self.args.vllm_server_request_timeout)
        self.add_callback(GenerationCycleResumeCheck())  # warns when a resume lands inside a generation batch

        self.trust_region_spec = self.args.trust_region_spec()
        # The check of every weight sync (`dppo_trl/trainers/sync_check.py`): only where μ is the engine's; with
        # transformers generation there is no engine, and `anchor="recompute"` anchors on the trainer's own π_old.
        self._sync_check = SyncCheck(self.args, engine_mu=self.args.use_vllm and self.args.anchor == "behavior")
        # The optimizer step whose weights sampled the training batch being consumed (TRL syncs the engine before a
        # generation whenever the step changed); `None` before the first generation.
        self._rollout_weights_step: int | None = None
        # Research hooks: each is called with the per-token tensors of every loss call (`_log_trust_region`).
        self.trust_region_observers: list = []
        self._vllm_topk: VLLMTopKCapture | None = None
        # Truncated sampling with vLLM: N, the entries per token the engine lists; its finite ones are the kept set.
        self._kept_set_size = self.args.kept_set_size
        # Each turn's max_tokens fitted to the room left in the engine's context (`dppo_trl/trainers/trl116/context_fit.py`).
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
            elif self.trust_region_spec.uses_top_k and self.args.anchor == "behavior":
                self._vllm_topk = VLLMTopKCapture(self.vllm_generation, self.args.divergence_top_k)
            if self._vllm_topk is not None:
                gen_kwargs = self.vllm_generation.generation_kwargs
                if self.args.vllm_mode == "colocate" and "stop" not in gen_kwargs:
                    # TRL's colocate path reads token ids only; without this vLLM also decodes all K+1 candidate
                    # tokens of every position to text, which dominates generation on small models.
                    gen_kwargs.setdefault("detokenize", False)

    # ------------------------------------------------------------------------------------------------------------
    # The loss: one hook of the parent, top to bottom
    # ------------------------------------------------------------------------------------------------------------
    def _policy_loss_terms(self, inputs: dict, policy: PolicyPass) -> PolicyTerms:
        """DPPO's per-token policy term for the parent to aggregate: eq. 11's coefficient w, the μ-KL term and (truncated
        sampling) the kept-set correction."""
        batch = _with_behavior_invariants(inputs)
        loss_inputs = self._loss_inputs(batch, policy)
        outputs = policy_loss(self.trust_region_spec, loss_inputs)
        self._log_trust_region(batch, loss_inputs, outputs)
        return PolicyTerms(coef=outputs.coef, extra=outputs.mu_kl, policy_extra=outputs.kept_correction)

    def _loss_inputs(self, batch: dict, policy: PolicyPass) -> LossInputs:
        """The core's per-token inputs of one loss call: π from the parent's pass, μ and its lists from the batch."""
        per_token_logps = policy.per_token_logps
        with torch.no_grad():
            tokens = policy.mask.bool()
            if BEHAVIOR_LOGPS not in batch:
                # On-policy transformers generation: μ ≡ π, so D = 0, r = 1 and nothing is masked.
                mu_logps, valid = per_token_logps.detach().float(), torch.ones_like(tokens)
            else:
                mu_logps, valid = batch[BEHAVIOR_LOGPS].float(), batch[BEHAVIOR_VALID].bool()
        view = EngineListView()
        if self._wants_hidden_states(batch):
            view = self._engine_list_view(batch, policy.hidden, per_token_logps, tokens & valid)
        old = batch.get(RECOMPUTED_LOGPS)
        return LossInputs(
            pi_logps=per_token_logps,
            mu_logps=mu_logps,
            advantages=policy.advantages,
            tokens=tokens,
            valid=valid,
            old_logps=old.float() if old is not None else None,
            pi_topk_logps=view.pi_topk_logps,
            mu_topk_logps=view.mu_topk_logps,
            entropies=policy.entropies,
            kept_log_mass=view.kept_log_mass,
            kept_overflow=batch[BEHAVIOR_KEPT_OVERFLOW].bool() if BEHAVIOR_KEPT_IDS in batch else None,
        )

    # ------------------------------------------------------------------------------------------------------------
    # What the parent asks of the batch (`HookedGRPOTrainer`'s other hooks)
    # ------------------------------------------------------------------------------------------------------------
    def _needs_old_per_token_logps(self) -> bool:
        """The parent's π_old pass runs only when its π_old is used (`_discards_parent_old_logps`)."""
        return super()._needs_old_per_token_logps() and not self._discards_parent_old_logps()

    def _wants_hidden_states(self, inputs: dict) -> bool:
        """The final hidden states, for π at the engine's listed ids (top-K divergences, the kept set)."""
        return BEHAVIOR_KEPT_IDS in inputs or (self.trust_region_spec.uses_top_k and BEHAVIOR_TOPK_IDS in inputs)

    def _anchor_logps(self, inputs: dict) -> torch.Tensor | None:
        """μ, the behavior policy's log-probs (sanitised), once the batch carries them."""
        return _with_behavior_invariants(inputs).get(BEHAVIOR_LOGPS)

    # ------------------------------------------------------------------------------------------------------------
    # Generation
    # ------------------------------------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        """Generate with the parent, then attach μ (also as the anchor in the parent's π_old slot) and its lists."""
        if self._vllm_topk is not None:
            self._vllm_topk.reset()
        self._context_fit.reset()
        output = super()._generate_and_score_completions(inputs)
        if self.model.training and self._sync_check.enabled:
            # GRPOTrainer loads the trainer's weights into the engine before generating whenever the optimizer step
            # changed, and records that step (`_last_loaded_step`, pinned in tests/trl_contract.py).
            self._rollout_weights_step = self._last_loaded_step
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
        return self._with_anchor_in_old_slot(output)

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

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card with honest provenance and versions, plus the DPPO settings (`write_model_card`, shared
        with AsyncDPPOTrainer)."""
        write_model_card(
            self,
            super().create_model_card,
            model_name=model_name,
            dataset_name=dataset_name,
            tags=tags,
            vllm_mode=self.args.vllm_mode if self.args.use_vllm else None,
            sampling=sampling_truncation(self.args),
            settings=[
                ("loss_type", self.args.loss_type),
                ("beta", self.args.beta),
                ("learning_rate", self.args.learning_rate),
                ("num_generations", self.args.num_generations),
                ("temperature", self.args.temperature),
                ("generation", f"vLLM ({self.args.vllm_mode})" if self.args.use_vllm else "transformers"),
            ],
        )

    def train(self, *args, **kwargs):
        """Parent's `train` inside the hardening both trainers share (`dppo_trl/hardening/training.py`): a SIGTERM
        checkpoint (`enable_jit_checkpoint`) ends in `TrainingPreempted` (exit 143) instead of returning as if the
        run had finished, and a dead vLLM server in `VLLMServerError`. A CPU trainer with a colocated vLLM engine
        trains with a bounded thread count (restored afterwards)."""
        threads = None
        if self.args.use_vllm and self.args.vllm_mode == "colocate" and self.accelerator.device.type == "cpu":
            threads = cpu_colocate_threads(self.accelerator.num_processes)
        server_url = None
        if self.args.use_vllm and self.args.vllm_mode == "server":
            client = getattr(self.vllm_generation, "vllm_client", None)  # built on the main process only
            server_url = getattr(
                client, "base_url", f"http://{self.args.vllm_server_host}:{self.args.vllm_server_port}"
            )
        bound = f"Requests are bounded by vllm_server_request_timeout={self.args.vllm_server_request_timeout} s."
        with hardened_training(self, server_url, bound), trainer_cpu_threads(threads):
            return super().train(*args, **kwargs)

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
        want_topk = self.trust_region_spec.uses_top_k
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
        logps, hidden = self._logps_and_hidden(
            self.model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=self.args.per_device_train_batch_size,
            want_hidden=want_topk,
        )
        if not want_topk:
            return logps, None
        if hidden is None:
            raise RuntimeError("DPPO top-K needs the policy's final hidden states, but none were captured.")
        k = self.args.divergence_top_k
        valid = mask.bool()
        weight, bias = lm_head(self.accelerator.unwrap_model(self.model))
        with maybe_gather_lm_head_ctx(weight, bias):
            top_logps, top_ids = chunked_topk_logps(
                hidden[valid], full(weight), k, bias=full(bias), transform=self._logit_transform()
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

    def _log_trust_region(self, batch: dict, inputs: LossInputs, outputs: LossOutputs) -> None:
        """Once per loss call: hand the per-token view to `trust_region_observers`, log the `dppo/*` metrics."""
        mode = "train" if self.model.training else "eval"
        if self.trust_region_observers:
            record = {
                "completion_ids": batch["completion_ids"],
                **observer_record(inputs, outputs.coef, outputs.divergence),
                "mode": mode,
            }
            for observer in self.trust_region_observers:
                observer(record)
        log_trust_region_metrics(self, outputs.stats, mode)
        if mode == "train":
            step = self.state.global_step
            # Fresh: sampled by the weights synced at this step, which no optimizer update has changed since (with
            # steps_per_generation > gradient_accumulation_steps or num_iterations > 1, later steps reuse the batch).
            fresh = self._rollout_weights_step == step
            self._sync_check.loss_call(
                self,
                fresh_rollout_sums(inputs) if fresh else None,
                fresh=fresh,
                fresh_tokens=f"vLLM sampled right after the weight sync that opened this step (the trainer's "
                f"weights after step {step}), trained before any optimizer update",
            )

    def _engine_list_view(self, batch: dict, hidden, pi_logps: torch.Tensor, valid: torch.Tensor) -> EngineListView:
        """π at the engine's listed ids of this batch: μ's top-K lists, or the kept set's (truncated sampling)."""
        kept = BEHAVIOR_KEPT_IDS in batch
        ids, mu_lists = (
            (batch[BEHAVIOR_KEPT_IDS], batch[BEHAVIOR_KEPT_LOGPS])
            if kept
            else (batch[BEHAVIOR_TOPK_IDS], batch[BEHAVIOR_TOPK_LOGPS])
        )
        weight, bias = lm_head(self.accelerator.unwrap_model(self.model))
        # ZeRO-3: the head is gathered for the forward here and again by the gather's own backward (as TRL's head does).
        with maybe_gather_lm_head_ctx(weight, bias):
            return engine_list_view(
                hidden,
                weight,
                bias,
                self._logit_transform(),
                ids,
                mu_lists.float(),
                pi_logps,
                valid,
                kept_set=kept,
                top_k=self.trust_region_spec.divergence_top_k if self.trust_region_spec.uses_top_k else None,
                gather=maybe_gather_lm_head_ctx,
            )

    def _logit_transform(self) -> LogitTransform:
        return logit_transform(self.accelerator.unwrap_model(self.model), self.args.temperature)

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
        if self.trust_region_spec.uses_top_k and max_logprobs is not None and 0 <= max_logprobs < k:
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


def _validate_trainer_inputs(config: DPPOConfig, params: dict) -> None:
    """Checks that need the trainer's arguments, not only the config (run before anything is built)."""
    if config.trust_region_spec().uses_top_k and params.get("rollout_func") is not None:
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
    positive values become invalid (weight 0; counted in `dppo/invalid_behavior_ratio`). Generation applies it once;
    the loss applies it again (a few element-wise ops) so it never depends on its caller.
    """
    source = BEHAVIOR_LOGPS if BEHAVIOR_LOGPS in inputs else "old_per_token_logps"
    if inputs.get(source) is None:
        return inputs  # on-policy: the parent falls back to π.detach(), μ ≡ π
    mu_logps, valid = sanitize_behavior_logps(inputs[source])
    if BEHAVIOR_VALID in inputs:
        valid = valid & inputs[BEHAVIOR_VALID].bool()
    mu_logps = torch.where(valid, mu_logps, torch.zeros_like(mu_logps))
    return {**inputs, BEHAVIOR_LOGPS: mu_logps, BEHAVIOR_VALID: valid}
