"""`DPPOTrainer`: GRPOTrainer with DPPO's divergence trust region anchored on the rollout engine's μ.

DPPO's loss is `dppo_trl.core.loss.policy_loss` (eq. 11 with the trust region of `args.trust_region`). `DPPOTrainer`
subclasses `HookedGRPOTrainer` (`dppo_trl.trainers.trl116.grpo`, the room where every trick on TRL 1.16's internals
lives) and uses its hooks only. The loss is the one both trainers share (`dppo_trl.trainers.dppo_loss.DPPOLoss`), run
after GRPOTrainer's own loss has returned:

    HookedGRPOTrainer._compute_loss(model, inputs)                 the room
      ├ GRPOTrainer._compute_loss(model, inputs with A = 0)        its forward, β-KL (bias-corrected against μ),
      │                                                            entropy bonus, MoE aux loss, metrics
      ├ DPPOLoss._per_token_policy_loss(inputs, forward)           forward = PolicyForward(π, μ, A, mask, entropy, ...)
      │   ├ loss_inputs = self._loss_inputs(inputs, forward)       LossInputs; π at the engine's lists (top-K, kept set)
      │   ├ outputs = policy_loss(self.trust_region_spec, loss_inputs)
      │   └ self._log_loss_call(...)                               `dppo/*` metrics, observers, the weight-sync check
      └ + the term under GRPOTrainer's masks (OPSM, entropy, IS), aggregated by its `loss_type`, and the μ-KL term

Generation (`_on_generation_batch`) attaches μ (the engine's log-probs), its top-K or kept-set lists and their
validity to the batch. `tests/integration/test_loss_gradient.py` checks the gradient against eq. 11 through the
parent's real `_compute_loss`.
"""

from __future__ import annotations

import logging
import math

import torch
from trl.trainer.utils import maybe_gather_lm_head_ctx

from dppo_trl.core.functional import sanitize_behavior_logps
from dppo_trl.core.loss import LossInputs, LossOutputs
from dppo_trl.core.metrics import observer_record
from dppo_trl.core.sync_check import fresh_rollout_sums
from dppo_trl.hardening.distributed import check_distributed_setup
from dppo_trl.hardening.inputs import check_trainer_inputs
from dppo_trl.hardening.model_card import DPPO_PAPER
from dppo_trl.kernels.engine_view import full, lm_head, logit_transform
from dppo_trl.kernels.topk_logps import chunked_topk_logps
from dppo_trl.trainers.config import DPPOConfig, sampling_truncation, truncates_sampling
from dppo_trl.trainers.dppo_loss import RECOMPUTED_LOGPS, BehaviorLists, DPPOLoss
from dppo_trl.trainers.kept_set import engine_lists, kept_set_overflow
from dppo_trl.trainers.metric_logging import log_trust_region_metrics
from dppo_trl.trainers.sync_check import SyncCheck
from dppo_trl.trainers.trl116.common import PolicyForward
from dppo_trl.trainers.trl116.grpo import (
    SAMPLING_LIST_IDS,
    SAMPLING_LIST_LOGPS,
    WEIGHTS_STEP,
    HookedGRPOTrainer,
    grpo_arguments,
    loss_mask,
)

__all__ = [
    "BEHAVIOR_KEPT_IDS",
    "BEHAVIOR_KEPT_LOGPS",
    "BEHAVIOR_KEPT_OVERFLOW",
    "BEHAVIOR_LOGPS",
    "BEHAVIOR_TOPK_IDS",
    "BEHAVIOR_TOPK_LOGPS",
    "BEHAVIOR_VALID",
    "RECOMPUTED_LOGPS",
    "DPPOTrainer",
]

logger = logging.getLogger(__name__)

# Extra per-row keys DPPOTrainer adds to the generation batch (batch-major, so TRL's shuffle/split keeps them aligned).
BEHAVIOR_LOGPS = "dppo_behavior_logps"
BEHAVIOR_VALID = "dppo_behavior_valid"
BEHAVIOR_TOPK_IDS = "dppo_behavior_topk_ids"
BEHAVIOR_TOPK_LOGPS = "dppo_behavior_topk_logps"
# Truncated sampling: the engine's N-entry lists (the room's `SAMPLING_LIST_*`), whose finite entries are the kept set,
# and the positions where the kept set may exceed the list.
BEHAVIOR_KEPT_IDS = "dppo_behavior_kept_ids"
BEHAVIOR_KEPT_LOGPS = "dppo_behavior_kept_logps"
BEHAVIOR_KEPT_OVERFLOW = "dppo_behavior_kept_overflow"


class DPPOTrainer(DPPOLoss, HookedGRPOTrainer):
    """Trainer for Divergence Proximal Policy Optimization (DPPO).

    A drop-in replacement for [`~trl.GRPOTrainer`] — same constructor arguments — that takes a [`DPPOConfig`]. See the
    module docstring for how the loss composes with GRPOTrainer and `docs/theory.md` for the method.
    """

    args: DPPOConfig
    _tag_names = ["trl", "dppo", "grpo"]
    _name = "DPPO"
    _paper = DPPO_PAPER

    def __init__(self, *args, **kwargs):
        arguments = grpo_arguments(*args, **kwargs)
        config = arguments["args"] = _dppo_config(arguments)
        _validate_trainer_inputs(config, arguments)
        # Before the model is built: a wrong launch otherwise fails deep in DeepSpeed or silently runs plain DDP.
        check_distributed_setup(config)
        self.trust_region_spec = config.trust_region_spec()
        # Research hooks: each is called with the per-token tensors of every loss call (`_log_loss_call`).
        self.trust_region_observers: list = []
        self._has_rollout_func = arguments.get("rollout_func") is not None  # μ then comes from the user's engine
        super().__init__(**arguments)
        # After GRPOTrainer's own checks (its PEFT-on-lm_head and Liger-config errors come first, as with TRL) and
        # before `train()`, where transformers applies the Liger kernels (patching modules process-wide).
        self._check_liger_device()
        # The check of every weight sync (`dppo_trl/trainers/sync_check.py`): only where μ is the engine's; with
        # transformers generation there is no engine, and `anchor="recompute"` anchors on the trainer's own π_old.
        self._sync_check = SyncCheck(self.args, engine_mu=self.args.use_vllm and self.args.anchor == "behavior")

    # ------------------------------------------------------------------------------------------------------------
    # The loss (`DPPOLoss`): where this trainer's batch keeps μ and its lists, and what it logs
    # ------------------------------------------------------------------------------------------------------------
    def _anchor_logps(self, inputs: dict) -> torch.Tensor | None:
        """μ, the behavior policy's log-probs, NaN where invalid; `None` on-policy (μ ≡ π)."""
        batch = _with_behavior_invariants(inputs)
        if BEHAVIOR_LOGPS not in batch:
            return None
        return torch.where(batch[BEHAVIOR_VALID].bool(), batch[BEHAVIOR_LOGPS], math.nan)

    def _wants_hidden_states(self, inputs: dict) -> bool:
        """The final hidden states, for π at the engine's listed ids (top-K divergences, the kept set)."""
        return BEHAVIOR_KEPT_IDS in inputs or (self.trust_region_spec.uses_top_k and BEHAVIOR_TOPK_IDS in inputs)

    def _behavior_lists(self, inputs: dict, forward: PolicyForward) -> BehaviorLists | None:
        if BEHAVIOR_KEPT_IDS in inputs:
            return BehaviorLists(
                inputs[BEHAVIOR_KEPT_IDS],
                inputs[BEHAVIOR_KEPT_LOGPS],
                kept_set=True,
                overflow=inputs[BEHAVIOR_KEPT_OVERFLOW].bool(),
            )
        if self.trust_region_spec.uses_top_k and BEHAVIOR_TOPK_IDS in inputs:
            return BehaviorLists(inputs[BEHAVIOR_TOPK_IDS], inputs[BEHAVIOR_TOPK_LOGPS])
        return None

    def _log_loss_call(self, inputs: dict, loss_inputs: LossInputs, outputs: LossOutputs) -> None:
        """Once per loss call: hand the per-token view to `trust_region_observers`, log the `dppo/*` metrics and, in
        training, feed the weight-sync check."""
        mode = "train" if self.model.training else "eval"
        if self.trust_region_observers:
            record = {
                "completion_ids": inputs["completion_ids"],
                **observer_record(loss_inputs, outputs.coef, outputs.divergence),
                "mode": mode,
            }
            for observer in self.trust_region_observers:
                observer(record)
        log_trust_region_metrics(self, outputs.stats, mode)
        if mode == "train":
            step = self.state.global_step
            # Fresh: sampled by the weights synced at this step, which no optimizer update has changed since (with
            # steps_per_generation > gradient_accumulation_steps or num_iterations > 1, later steps reuse the batch).
            fresh = WEIGHTS_STEP in inputs and bool((inputs[WEIGHTS_STEP] == step).all())
            self._sync_check.loss_call(
                self,
                fresh_rollout_sums(loss_inputs) if fresh else None,
                fresh=fresh,
                fresh_tokens=f"vLLM sampled right after the weight sync that opened this step (the trainer's "
                f"weights after step {step}), trained before any optimizer update",
            )

    # ------------------------------------------------------------------------------------------------------------
    # Generation: μ and its lists on every batch
    # ------------------------------------------------------------------------------------------------------------
    def _needs_old_per_token_logps(self) -> bool:
        """The parent's π_old pass runs only when its π_old is used (`_discards_parent_old_logps`)."""
        return super()._needs_old_per_token_logps() and not self._discards_parent_old_logps()

    def _on_generation_batch(self, output: dict) -> dict:
        """The batch with μ (sanitised, counted in `dppo/invalid_behavior_logps`), its top-K or kept-set lists and,
        for the trust regions that need it, π_old."""
        mask = loss_mask(output)
        # The engine's lists the room asked for (`_rollout_logprobs`), as μ's top-K or kept set below.
        sampled_lists = (
            (output.pop(SAMPLING_LIST_IDS), output.pop(SAMPLING_LIST_LOGPS)) if SAMPLING_LIST_IDS in output else None
        )
        if self.trust_region_spec.region.needs_old_logps:
            recomputed = output.get("old_per_token_logps")
            if recomputed is None and self.args.use_vllm:
                recomputed, _ = self._recompute_policy(output, mask, want_topk=False)
            if recomputed is not None:
                output[RECOMPUTED_LOGPS] = recomputed.float()
        behavior, topk = self._behavior_policy(output, mask, sampled_lists)
        if behavior is not None:
            output = _with_behavior_invariants({**output, BEHAVIOR_LOGPS: behavior})
            invalid = (~output[BEHAVIOR_VALID] & mask.bool()).sum()
            mode = "train" if self.model.training else "eval"
            self._metric_sink(mode)["dppo/invalid_behavior_logps"].append(
                self.accelerator.gather(invalid).sum().item()
            )
        if topk is not None and self.args.kept_set_size is not None:
            ids, lists = topk[0], engine_lists(topk[1])
            output[BEHAVIOR_KEPT_IDS], output[BEHAVIOR_KEPT_LOGPS] = ids, lists
            top_k = sampling_truncation(self.args)[0]
            output[BEHAVIOR_KEPT_OVERFLOW] = kept_set_overflow(lists, self.args.kept_set_size, top_k) & mask.bool()
        elif topk is not None:
            output[BEHAVIOR_TOPK_IDS], output[BEHAVIOR_TOPK_LOGPS] = topk
        return output

    def _behavior_policy(self, output: dict, mask: torch.Tensor, sampled_lists: tuple | None):
        """Pick μ for this generation batch: `(behavior log-probs or None, (top-K ids, logps) or None)`.

        - vLLM / `rollout_func`: the engine's sampled-token log-probs; its lists (`sampled_lists`), when asked for.
        - transformers `generate`, off-policy: TRL's recompute of the generating weights (that *is* the engine).
        - transformers `generate`, on-policy: `None` — μ ≡ π.
        - `anchor="recompute"` (ablation): the trainer's π_old, recomputed here if the parent did not.
        """
        want_topk = self.trust_region_spec.uses_top_k
        topk = None
        if self.args.anchor == "recompute":
            behavior = output.get("old_per_token_logps")
            if behavior is None and not self.args.use_vllm:
                return None, None  # on-policy transformers generation: π_old ≡ π
            if behavior is None or want_topk:
                logps, topk = self._recompute_policy(output, mask, want_topk)
                behavior = logps if behavior is None else behavior
            return behavior, topk

        behavior = output.get("sampling_per_token_logps")
        if behavior is not None:
            if sampled_lists is not None:
                topk = sampled_lists
            elif want_topk:
                raise ValueError(
                    "Top-K DPPO needs μ's top-K log-probs from the engine; a `rollout_func` supplies only sampled-token "
                    "log-probs. Use a binary divergence with `rollout_func`."
                )
            return behavior, topk

        behavior = output.get("old_per_token_logps")
        if behavior is not None and want_topk:
            _, topk = self._recompute_policy(output, mask, want_topk=True)
        return behavior, topk

    @torch.no_grad()
    def _recompute_policy(self, output: dict, mask: torch.Tensor, want_topk: bool):
        """One no-grad pass of the current weights over the batch: sampled-token log-probs and, if asked, top-K.

        Uses the parent's fused log-prob pass, so no `[B, T, V]` logits are built; the top-K comes from the captured
        hidden states through a chunked vocabulary scan (a ZeRO-3 head gathered by TRL's `maybe_gather_lm_head_ctx`).
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
        unwrapped = self.accelerator.unwrap_model(self.model)
        weight, bias = lm_head(unwrapped)
        top_logps, top_ids = chunked_topk_logps(
            hidden[valid],
            full(weight),
            k,
            bias=full(bias),
            transform=logit_transform(unwrapped, self.args.temperature),
            gather=maybe_gather_lm_head_ctx,
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

    def _discards_parent_old_logps(self) -> bool:
        """Whether GRPOTrainer's no-grad π_old pass would be thrown away: μ comes from the engine (vLLM colocate or
        server, or a `rollout_func`), DPPO anchors on it, and no trust region of `dppo_trl.core.registry` asks for π_old.

        Kept: `anchor="recompute"` (the ablation anchors on π_old), `needs_old_logps` entries, and transformers
        generation, where the parent's recompute of the generating weights *is* μ.
        """
        engine_mu = self.args.use_vllm or self._has_rollout_func
        region = self.trust_region_spec.region
        return engine_mu and self.args.anchor == "behavior" and not region.needs_old_logps

    def _model_card_arguments(self) -> dict:
        args = self.args
        return {
            "vllm_mode": args.vllm_mode if args.use_vllm else None,
            "sampling": sampling_truncation(args),
            "settings": [
                ("loss_type", args.loss_type),
                ("beta", args.beta),
                ("learning_rate", args.learning_rate),
                ("num_generations", args.num_generations),
                ("temperature", args.temperature),
                ("generation", f"vLLM ({args.vllm_mode})" if args.use_vllm else "transformers"),
            ],
        }

    # ------------------------------------------------------------------------------------------------------------
    # Checks
    # ------------------------------------------------------------------------------------------------------------
    def _check_liger_device(self) -> None:
        """`use_liger_kernel=True` needs CUDA: Liger's Triton layer kernels fail on the first forward elsewhere."""
        if self.args.use_liger_kernel and self.accelerator.device.type != "cuda":
            raise ValueError(
                f"use_liger_kernel=True applies Liger's Triton layer kernels, which need a CUDA device; this trainer "
                f"runs on {self.accelerator.device.type!r}. Set use_liger_kernel=False. (With CUDA it only swaps "
                "RMSNorm/SwiGLU/RoPE kernels; the DPPO loss is always computed by DPPOTrainer.)"
            )

    def _check_vllm_server(self, model_config: dict) -> None:
        """Server mode: μ must be the processed (post-temperature) log-probs, and the server must allow K of them."""
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


def _dppo_config(arguments: dict) -> DPPOConfig:
    """The trainer's `args`: a `DPPOConfig` (a default one named after the model when none is given)."""
    config = arguments.get("args")
    if config is None:
        model = arguments["model"]
        model_name = model if isinstance(model, str) else model.config.name_or_path
        return DPPOConfig(f"{model_name.split('/')[-1]}-DPPO")
    if not isinstance(config, DPPOConfig):
        raise TypeError(
            f"DPPOTrainer needs a DPPOConfig, got {type(config).__name__}. Build `DPPOConfig(...)` with the same "
            "fields (it subclasses GRPOConfig and sets the defaults DPPO needs)."
        )
    return config


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


def _with_behavior_invariants(inputs: dict) -> dict:
    """A copy of a batch in which μ upholds what the loss relies on, whoever built the batch.

    μ (`BEHAVIOR_LOGPS`, or `old_per_token_logps` when a caller supplies only that) is sanitised: NaN, ±inf or
    positive values become invalid (weight 0; counted in `dppo/invalid_behavior_ratio`). Generation applies it once;
    the loss applies it again (a few element-wise ops) so it never depends on its caller.
    """
    source = BEHAVIOR_LOGPS if BEHAVIOR_LOGPS in inputs else "old_per_token_logps"
    if inputs.get(source) is None:
        return inputs  # on-policy: μ ≡ π
    mu_logps, valid = sanitize_behavior_logps(inputs[source])
    if BEHAVIOR_VALID in inputs:
        valid = valid & inputs[BEHAVIOR_VALID].bool()
    mu_logps = torch.where(valid, mu_logps, torch.zeros_like(mu_logps))
    return {**inputs, BEHAVIOR_LOGPS: mu_logps, BEHAVIOR_VALID: valid}
