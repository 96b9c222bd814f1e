"""`DPPOTrainer`: GRPOTrainer with DPPO's divergence trust region anchored on the rollout engine's μ.

The objective is `dppo_trl.core.divergence.dppo_coefficient` (eq. 11): per completion token the gradient is
`−A · w · ∇log π` with `w = min(π/μ, C) · M` (eq. 12's mask on the divergences of eqs. 13-16). The ablation
baselines of `dppo_trl.core.registry.TRUST_REGIONS` return a coefficient of the same form. This module is the glue that
makes GRPOTrainer's own loss compute it, without copying any of it:

GRPOTrainer's per-token policy term for the `dapo`/`grpo`/`dr_grpo`/`bnpo`/`luspo` aggregations is
`−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) · m`, with `r = exp(log π − old)` and `m` the off-policy mask returned by the
`get_off_policy_mask` hook. DPPOTrainer

1. writes μ (the engine's log-probs, not a recompute) into `old_per_token_logps` (`_generate_and_score_completions`);
2. opens the clip (`ε_low = 1`, `ε_high = ∞`), so the term is `−r·A·m`;
3. returns `m = w / r` from `get_off_policy_mask` (`parent_weight`), so the parent's term has gradient `−A·w·∇log π`.
   The hook stays TRL's static method (TRL's OPSM outside a DPPO loss call); the batch reaches it through the one
   per-call channel `_seam_call` (docs/theory.md). Every DPPO quantity (the view, `w`, D, the metrics, the observers'
   view, the μ-KL term) comes from `dppo_trl.core.objective`, the core the asynchronous trainer shares.

Every other part of the parent's loss — the aggregation (`loss_type`), β-KL against the reference, the entropy
bonus, the entropy mask, the MoE router aux loss, gradient-accumulation scaling, metrics — is GRPOTrainer's own.
`tests/test_loss_gradient.py` checks the gradient against eq. 11 through the parent's real `_compute_loss`, for each
aggregation, and `tests/test_trl_contract.py` pins the parent internals this relies on (`tests/trl_contract.py`).
"""

from __future__ import annotations

import contextlib
import fractions
import inspect
import logging
import math
import os
import textwrap
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from trl import GRPOTrainer
from trl.trainer.utils import maybe_gather_lm_head_ctx

from dppo_trl.backends.cpu.construction import trainer_construction_patches
from dppo_trl.backends.cpu.engine import EngineOptions
from dppo_trl.backends.cpu.http import bound_server_requests
from dppo_trl.backends.cpu.threads import cpu_colocate_threads, trainer_cpu_threads
from dppo_trl.backends.cpu.weight_sync import bind_colocate_weight_sync
from dppo_trl.core.objective import (
    TokenView,
    aggregate_per_token_loss,
    mu_kl_per_token,
    observer_record,
    trust_region_coefficient,
    trust_region_metrics,
    trust_region_stats,
)
from dppo_trl.core.registry import TRUST_REGIONS
from dppo_trl.hardening.checkpoints import GenerationCycleResumeCheck, latest_complete_checkpoint, staged_checkpoint
from dppo_trl.hardening.distributed import check_distributed_setup
from dppo_trl.hardening.inputs import check_trainer_inputs
from dppo_trl.hardening.model_card import dataset_for_card, finish_model_card
from dppo_trl.hardening.preemption import raise_if_preempted, record_jit_checkpoints, resume_command
from dppo_trl.kernels.topk_logps import LogitTransform, chunked_topk_logps, logps_at_ids_from_sampled
from dppo_trl.trainers.config import DPPOConfig
from dppo_trl.trainers.vllm_topk import VLLMTopKCapture, sanitize_behavior_logps

logger = logging.getLogger(__name__)

# μ of a valid token is clamped here before GRPOTrainer exponentiates `log π − μ`: exp(60) is finite in fp32, and the
# weight returned by `get_off_policy_mask` is computed against the clamped value, so the product stays exact.
_MU_FLOOR = -60.0
# GRPOTrainer's clip metrics; with the clip opened they are always 0, so they are dropped to avoid misleading logs.
_GRPO_CLIP_METRICS = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)
# Extra per-row keys DPPOTrainer adds to the generation batch (batch-major, so TRL's shuffle/split keeps them aligned).
BEHAVIOR_LOGPS = "dppo_behavior_logps"
BEHAVIOR_VALID = "dppo_behavior_valid"
BEHAVIOR_TOPK_IDS = "dppo_behavior_topk_ids"
BEHAVIOR_TOPK_LOGPS = "dppo_behavior_topk_logps"
RECOMPUTED_LOGPS = "dppo_recomputed_logps"  # π_old, kept only for the ablations that need it


def parent_weight(coef: torch.Tensor, pi_logps: torch.Tensor, parent_old_logps: torch.Tensor) -> torch.Tensor:
    """The weight `m` for GRPOTrainer's opened-clip term `−r·A·m`, `r = exp(π − old)`, such that its gradient is
    `−A · coef · ∇log π`: `m = coef / r`, detached, computed in log space (r can underflow to 0 while 1/r overflows).
    Shared by DPPO and every baseline."""
    log_r = pi_logps - parent_old_logps
    return torch.where(coef > 0, torch.exp(torch.log(coef) - log_r), torch.zeros_like(coef))


@dataclass
class _SeamCall:
    """The one explicit channel from a DPPOTrainer method into the parent seams it calls (docs/theory.md).

    GRPOTrainer's `_compute_loss` computes π inside and hands it to two of its seams: the log-prob pass
    (`_get_per_token_logps_and_entropies`) and the mask hook (`get_off_policy_mask`, a static method). A DPPOTrainer
    method that calls into the parent opens one `_SeamCall` with `_seam_call(...)`; those seams read it through
    `_SEAM_CALL` for the duration of that call only, and write back what they saw. Nothing outlives the call.

    Attributes:
        want_hidden: the log-prob pass keeps the final hidden states (top-K divergences).
        inputs: loss calls only: the batch (μ, its validity, π_old, μ's top-K).
        on_mask: loss calls only: computes the weight the mask hook returns.
        hidden, entropies: written by the log-prob pass.
        view, coef, divergence, mask, mu_kl: written by the mask hook (mu_kl keeps π's graph).
    """

    want_hidden: bool
    inputs: dict | None = None
    on_mask: Callable[..., torch.Tensor] | None = field(default=None, repr=False)
    hidden: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    view: TokenView | None = None
    coef: torch.Tensor | None = None
    divergence: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    mu_kl: torch.Tensor | None = None


_SEAM_CALL: ContextVar[_SeamCall | None] = ContextVar("dppo_seam_call", default=None)


@contextlib.contextmanager
def _seam_call(call: _SeamCall) -> Iterator[_SeamCall]:
    """Make `call` visible to the parent's seams for the duration of the block (reset even on error)."""
    token = _SEAM_CALL.set(call)
    try:
        yield call
    finally:
        _SEAM_CALL.reset(token)


class DPPOTrainer(GRPOTrainer):
    """Trainer for Divergence Proximal Policy Optimization (DPPO).

    A drop-in replacement for [`~trl.GRPOTrainer`] — same constructor arguments — that takes a [`DPPOConfig`]. See the
    module docstring for how the loss composes with GRPOTrainer and `docs/theory.md` for the method.
    """

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
        # Before the model is built: a wrong launch otherwise fails deep in DeepSpeed or silently runs plain DDP.
        check_distributed_setup(config)
        # TRL's vLLM symbols are patched only while the parent builds the engine/client (CPU engine defaults; a
        # client with a file-based weight sync when the trainer's device is the CPU), then restored.
        with trainer_construction_patches(config.use_vllm, config.vllm_mode, EngineOptions.from_config(config)):
            super().__init__(*bound.args[1:], **bound.kwargs)
        # After GRPOTrainer's own checks (its PEFT-on-lm_head and Liger-config errors come first, as with TRL) and
        # before `train()`, where transformers applies the Liger kernels (patching modules process-wide).
        self._check_liger_device()
        if self.use_vllm:
            bind_colocate_weight_sync(self.vllm_generation)  # vLLM CPU colocate: on this trainer's instance only
            if self.vllm_mode == "server" and self.accelerator.is_main_process:
                bound_server_requests(self.vllm_generation.vllm_client, self.args.vllm_server_request_timeout)
        self.add_callback(GenerationCycleResumeCheck())  # warns when a resume lands inside a generation batch
        self._jit_checkpoints = record_jit_checkpoints(self)  # SIGTERM checkpoints, to report a preempted run

        # Open GRPO's ratio clip: DPPO's trust region is the mask returned by `get_off_policy_mask`.
        self.epsilon_low, self.epsilon_high = 1.0, math.inf
        # A non-None threshold makes GRPOTrainer call `get_off_policy_mask`; the user's own OPSM threshold (if any)
        # still applies on top, through `self.args.off_policy_mask_threshold`.
        self.off_policy_mask_threshold = math.inf
        # Research hooks: each is called with the per-token tensors of every loss call (`_log_trust_region`).
        self.trust_region_observers: list = []
        self._vllm_topk: VLLMTopKCapture | None = None
        if self.use_vllm:
            self._check_vllm_server()
            if self.args.uses_top_k and self.args.anchor == "behavior":
                self._vllm_topk = VLLMTopKCapture(self.vllm_generation, self.args.divergence_top_k)
                gen_kwargs = self.vllm_generation.generation_kwargs
                if self.vllm_mode == "colocate" and "stop" not in gen_kwargs:
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
        with self._parent_old_logps_skipped(self._discards_parent_old_logps()):
            output = super()._generate_and_score_completions(inputs)
        mask = (
            output["completion_mask"] if "tool_mask" not in output else output["completion_mask"] * output["tool_mask"]
        )

        if TRUST_REGIONS[self.args.trust_region].needs_old_logps:
            recomputed = output.get("old_per_token_logps")
            if recomputed is None and self.use_vllm:
                recomputed, _ = self._policy_forward(output, mask, want_topk=False)
            if recomputed is not None:
                output[RECOMPUTED_LOGPS] = recomputed.float()
        behavior, topk = self._behavior_policy(output, mask)
        if behavior is not None:
            output = _with_behavior_invariants({**output, BEHAVIOR_LOGPS: behavior})
            invalid = (~output[BEHAVIOR_VALID] & mask.bool()).sum()
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["dppo/invalid_behavior_logps"].append(self.accelerator.gather(invalid).sum().item())
        if topk is not None:
            output[BEHAVIOR_TOPK_IDS], output[BEHAVIOR_TOPK_LOGPS] = topk
        return output

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
        engine_mu = self.use_vllm or self.rollout_func is not None
        region = TRUST_REGIONS[self.args.trust_region]
        return engine_mu and self.args.anchor == "behavior" and not region.needs_old_logps

    @contextlib.contextmanager
    def _parent_old_logps_skipped(self, skip: bool):
        """For the duration of the parent's `_generate_and_score_completions`, make its π_old condition false.

        GRPOTrainer recomputes π_old when `gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0`
        (or for vLLM IS correction, which `DPPOConfig` refuses with `anchor="behavior"`). Inside that method
        `self.num_iterations` is read only by this condition (pinned in `tests/trl_contract.py`), so an exact
        `Fraction(GA, steps_per_generation)` makes the modulus 0 for any shape; the integer is restored on exit.
        Nothing else changes: the reference pass (β > 0), rewards and advantages are the parent's as before.
        Chosen over declining the policy call in `_get_per_token_logps_and_entropies`: the PEFT reference pass makes
        the same call with `self.model` (adapter disabled), so the two cannot be told apart there.
        """
        if not skip:
            yield
            return
        saved = self.num_iterations
        self.num_iterations = fractions.Fraction(self.args.gradient_accumulation_steps, self.args.steps_per_generation)
        try:
            yield
        finally:
            self.num_iterations = saved

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """Parent's fused log-prob pass; inside a DPPO call (`_seam_call`), also keep the hidden states and entropies."""
        capture = _SEAM_CALL.get()
        if capture is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        hiddens: list[torch.Tensor] = []
        handle = None
        if capture.want_hidden:
            handle = _backbone(self.accelerator.unwrap_model(model)).register_forward_hook(
                lambda _module, _inputs, out: hiddens.append(_last_hidden_state(out).detach())
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
        """Parent's loss, with DPPO's trust region supplied through `get_off_policy_mask`, plus the μ-KL term."""
        inputs = _with_behavior_invariants(inputs)
        call = _SeamCall(want_hidden=self.args.uses_top_k and BEHAVIOR_TOPK_IDS in inputs, inputs=inputs)
        call.on_mask = self._trust_region_weight
        with _seam_call(call):
            loss = super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        for key in _GRPO_CLIP_METRICS:
            self._metrics[mode].pop(key, None)
        if call.view is None:
            raise RuntimeError("GRPOTrainer._compute_loss did not call `get_off_policy_mask`: see trl_contract.py.")
        if call.mu_kl is not None:
            loss = loss + aggregate_per_token_loss(
                call.mu_kl,
                call.mask,
                self.loss_type,
                max_completion_length=self.max_completion_length,
                num_items_in_batch=inputs.get("num_items_in_batch"),
                num_processes=self.accelerator.num_processes,
                gradient_accumulation_steps=self.current_gradient_accumulation_steps,
                steps_per_generation=self.args.steps_per_generation,
                training=self.model.training,
            )
        self._log_trust_region(call, mode)
        return loss

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """TRL's static OPSM hook, unchanged outside a DPPO loss call.

        Inside `DPPOTrainer._compute_loss` (the parent's loss calls this hook with π) it returns DPPO's per-token
        weight `M · min(π/μ, C) / (π/μ)` (eqs. 11-12), times the user's OPSM mask if `off_policy_mask_threshold` is
        set; the call is reached through the `_SeamCall` that `_compute_loss` opened.
        """
        call = _SEAM_CALL.get()
        if call is None or call.on_mask is None:
            return GRPOTrainer.get_off_policy_mask(
                advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
            )
        return call.on_mask(call, advantages, per_token_logps, sampling_per_token_logps, mask)

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
        if self.use_vllm and self.vllm_mode == "colocate" and self.accelerator.device.type == "cpu":
            threads = cpu_colocate_threads(self.accelerator.num_processes)
        with trainer_cpu_threads(threads), self._server_failures():
            output = super().train(*args, **kwargs)
        raise_if_preempted(self._jit_checkpoints, self.accelerator.is_main_process)
        return output

    @contextlib.contextmanager
    def _server_failures(self):
        """Server mode: a failed request to the vLLM server (killed, hung, unreachable) ends training with an error
        naming the server, the last complete checkpoint and how to resume."""
        if not (self.use_vllm and self.vllm_mode == "server"):
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
            if behavior is None and not self.use_vllm:
                return None, None  # on-policy transformers generation: π_old ≡ π, the parent's own fallback
            if behavior is None or want_topk:
                logps, topk = self._policy_forward(output, mask, want_topk)
                behavior = logps if behavior is None else behavior
            return behavior, topk

        behavior = output.get("sampling_per_token_logps")
        if behavior is not None:
            if self._vllm_topk is not None:
                topk = self._vllm_topk.pop(output["completion_ids"], mask)
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
        with _seam_call(_SeamCall(want_hidden=want_topk)) as capture:
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=self.args.per_device_train_batch_size,
            )
        if not want_topk:
            return logps, None
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

    def _trust_region_weight(self, call, advantages, per_token_logps, sampling_per_token_logps, mask) -> torch.Tensor:
        """The detached weight the parent multiplies `−r·A` by (`parent_weight` of `trust_region_coefficient`).

        Called by the parent's mask hook, where π first appears; records the loss call's `TokenView`, coefficient
        and divergence (and the μ-KL term, which keeps π's graph) in `call` for `_compute_loss`.
        """
        batch, args = call.inputs, self.args
        with torch.no_grad():
            pi_logps = per_token_logps.detach().float()
            tokens = mask.bool()
            if BEHAVIOR_LOGPS not in batch:
                # On-policy transformers generation: μ ≡ π, so D = 0, r = 1 and nothing is masked.
                mu_logps, valid = pi_logps, torch.ones_like(tokens)
            else:
                mu_logps, valid = batch[BEHAVIOR_LOGPS].float(), batch[BEHAVIOR_VALID].bool()
            old = batch.get(RECOMPUTED_LOGPS)
            topk = self._pi_topk(call, pi_logps, tokens & valid) if call.want_hidden else (None, None)
            view = TokenView(
                pi_logps=pi_logps,
                mu_logps=mu_logps,
                advantages=advantages,
                tokens=tokens,
                valid=valid,
                old_logps=old.float() if old is not None else None,
                pi_topk_logps=topk[0],
                mu_topk_logps=topk[1],
                entropies=call.entropies,
            )
            coef, divergence = trust_region_coefficient(args, view)
            parent_old = batch.get("old_per_token_logps")
            weight = parent_weight(coef, pi_logps, pi_logps if parent_old is None else parent_old.float())
            if args.off_policy_mask_threshold is not None:
                weight = weight * GRPOTrainer.get_off_policy_mask(
                    advantages=advantages,
                    per_token_logps=per_token_logps,
                    sampling_per_token_logps=sampling_per_token_logps,
                    mask=mask,
                    off_policy_threshold=args.off_policy_mask_threshold,
                )
        call.view, call.coef, call.divergence, call.mask = view, coef, divergence, mask
        if args.mu_kl_coef > 0:
            call.mu_kl = mu_kl_per_token(args, per_token_logps, mu_logps, view.counted)
        return weight.to(per_token_logps.dtype)

    def _log_trust_region(self, call: _SeamCall, mode: str) -> None:
        """Once per loss call: hand the per-token view to `trust_region_observers`, log the `dppo/*` metrics."""
        if self.trust_region_observers:
            record = {
                "completion_ids": call.inputs["completion_ids"],
                **observer_record(call.view, call.coef, call.divergence),
                "mode": mode,
            }
            for observer in self.trust_region_observers:
                observer(record)
        stats = trust_region_stats(self.args, call.view, call.coef, call.divergence)
        metrics = trust_region_metrics(
            stats,
            reduce_sum=lambda t: self.accelerator.reduce(t, reduction="sum"),
            reduce_max=lambda t: self.accelerator.gather(t).view(-1, t.numel()).max(dim=0).values,
        )
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def _pi_topk(self, call: _SeamCall, pi_logps: torch.Tensor, valid: torch.Tensor):
        """π's log-probs at μ's TopK ∪ {y} ids, from the hidden states the call captured (no `[B, T, V]` logits)."""
        capture, batch = call, call.inputs
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

    def _lm_head_params(self):
        head = _unwrapped_causal_lm(self.accelerator.unwrap_model(self.model)).get_output_embeddings()
        return head.weight, getattr(head, "bias", None)

    def _logit_transform(self) -> LogitTransform:
        config = _unwrapped_causal_lm(self.accelerator.unwrap_model(self.model)).config
        return LogitTransform.from_model_config(config, temperature=self.temperature)

    def _check_vllm_server(self) -> None:
        """Server mode: μ must be the processed (post-temperature) log-probs, and the server must allow K of them."""
        if self.vllm_mode != "server" or not self.accelerator.is_main_process:
            return
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


def dppo_card_section(args: DPPOConfig) -> str:
    """Markdown section with the DPPO settings, appended to TRL's model card."""
    rows = [
        ("divergence", args.divergence),
        ("delta_low / delta_high", f"{args.delta_low} / {args.delta_high}"),
        ("ratio_cap (C)", args.ratio_cap),
        ("anchor", args.anchor),
        ("top-K (K)", args.divergence_top_k if args.uses_top_k else "–"),
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
    has_tools = bool(params.get("tools")) or params.get("environment_factory") is not None
    if config.uses_top_k and has_tools:
        raise ValueError(
            f"divergence={config.divergence!r} does not support tool calling (`tools` / `environment_factory`): "
            "tool results are spliced between generate calls, so μ's top-K is not defined for every token. Use "
            "divergence='binary_tv' or 'binary_kl' with tools."
        )
    if config.uses_top_k and params.get("rollout_func") is not None:
        raise ValueError(
            f"divergence={config.divergence!r} needs μ's top-K log-probs from the engine; a `rollout_func` supplies "
            "only sampled-token log-probs. Use divergence='binary_tv' or 'binary_kl' with `rollout_func`."
        )
    check_trainer_inputs(config, params)  # datasets, chat template, lengths (dppo_trl/hardening/inputs.py)


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
