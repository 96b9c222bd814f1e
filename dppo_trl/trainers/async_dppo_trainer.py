"""`AsyncDPPOTrainer`: DPPO's trust region on TRL's experimental asynchronous trainer (`AsyncGRPOTrainer`).

In TRL's asynchronous trainer a rollout worker samples from a vLLM server while the trainer trains; a sample may be
up to `max_staleness` policy versions old when it is trained on, and μ — the server's log-probs of the sampled tokens
(`--logprobs-mode processed_logprobs`) — is the only record of the policy that sampled it. That is exactly DPPO's
anchor: the trust region is taken against μ, however stale.

`AsyncDPPOTrainer` subclasses `HookedAsyncGRPOTrainer` (`dppo_trl.trainers.trl116.async_grpo`, the room where TRL
1.16's bridging lives: the sampling version carried to the batch, TRL's loss run for its forward, the rollout worker
that asks for μ's lists, the CPU paths) and shares its loss with `DPPOTrainer` (`dppo_trl.trainers.dppo_loss.DPPOLoss`,
see docs/theory.md "Asynchronous DPPO"):

    DPPOLoss._per_token_policy_loss(inputs, forward)            called by the room after TRL's loss and its one forward
      ├ loss_inputs = self._loss_inputs(inputs, forward)         LossInputs(π, μ, A, staleness, ...), π at the
      │                                                          engine's lists (top-K, kept set)
      ├ outputs = policy_loss(self.trust_region_spec, loss_inputs)
      ├ self._log_loss_call(...)                                 `dppo/*`, by staleness too; the weight-sync check
      └ per-token eq. 11 (+ μ-KL), which the room sums and scales as TRL scales its own policy term

Top-K divergences (`topk_tv`, `topk_kl`) and truncated sampling (`top_k`, `top_p`, `min_p`): the worker asks the
server for K, or N = `kept_set_size`, log-probs per token (`_rollout_logprobs`); the lists ride to the batch
(`BEHAVIOR_TOPK_*`, `dppo_trl.trainers.async_topk`) and `dppo_trl.kernels.engine_view` gives the core π at their ids
from the final hidden states of TRL's one forward: μ's top-K, or log π(kept) with its gradient and the overflow
positions (`kept_set.kept_set_overflow`), so the core's per-token term has eq. 11's gradient with π_kept as it stands.

Tree attention (`AsyncDPPOConfig.tree_attention`): TRL builds the model with `attn_implementation="tree_fa3"`, a
FlashAttention-3 kernel from the Hub. The choice is resolved before the model is built; unless that kernel is chosen
(and can run), the room registers `dppo_trl.kernels.tree_attention.tree_attention_sdpa` (or the float32 reference)
under TRL's name only while its training step (forward and backward) or loss runs, then restores TRL's registration.

On CPU (no CUDA, or `use_cpu=True`) the room applies `dppo_trl.backends.cpu.async_cpu`'s paths: no peak-FLOPs
lookup, and the file-based weight transfer to `python -m dppo_trl.backends.cpu.vllm_server`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig

from dppo_trl.backends.tree_attention import TREE_ATTENTION_CHOICES, TreeAttentionChoice, resolve_tree_attention
from dppo_trl.core.loss import LossInputs, LossOutputs
from dppo_trl.core.registry import TRUST_REGIONS
from dppo_trl.core.sync_check import fresh_rollout_sums
from dppo_trl.hardening.model_card import DPPO_PAPER
from dppo_trl.trainers.config import (
    KEPT_SET_SERVER_LOGPROBS,
    TrustRegionFields,
    check_kept_set,
    resolve_kept_set_size,
    sampling_truncation,
)
from dppo_trl.trainers.dppo_loss import BehaviorLists, DPPOLoss
from dppo_trl.trainers.kept_set import engine_lists, kept_set_overflow
from dppo_trl.trainers.metric_logging import log_trust_region_metrics
from dppo_trl.trainers.sync_check import SyncCheck
from dppo_trl.trainers.trl116.async_grpo import (
    SAMPLE_VERSION,
    HookedAsyncGRPOTrainer,
    KeepForwardOutputs,
    SampleMetrics,
    SampleVersionCollator,
    SampleVersionQueue,
    runs_on_cpu,
)
from dppo_trl.trainers.trl116.async_topk import BEHAVIOR_TOPK_IDS, BEHAVIOR_TOPK_LOGPS
from dppo_trl.trainers.trl116.common import PolicyForward

__all__ = [
    "SAMPLE_VERSION",
    "AsyncDPPOConfig",
    "AsyncDPPOTrainer",
    "KeepForwardOutputs",
    "SampleMetrics",
    "SampleVersionCollator",
    "SampleVersionQueue",
]


logger = logging.getLogger(__name__)


@dataclass
class AsyncDPPOConfig(TrustRegionFields, AsyncGRPOConfig):
    r"""
    Configuration for [`AsyncDPPOTrainer`]: every `trl.experimental.async_grpo.AsyncGRPOConfig` field, plus DPPO's
    trust-region fields with the same meaning, defaults and validation as in [`DPPOConfig`]: `divergence`,
    `delta_low`, `delta_high`, `divergence_top_k`, `ratio_cap`, `mu_kl_coef`, `anchor`, `trust_region`, `relax_alpha`,
    and the weight-sync check `sync_mismatch_threshold`, `sync_mismatch_action` (see its docstring and docs/api.md).
    Asynchronously the check reads the tokens sampled by the version a sync just published (staleness 0) at the first
    optimizer step after that sync, before any further update; how many syncs that covers depends on
    `gradient_accumulation_steps` and `max_staleness` (docs/async.md, "Weight-sync check").

    Every divergence works asynchronously; the top-K ones ask the server for `divergence_top_k` log-probs per token
    (the server's `--max-logprobs` must allow it; `python -m dppo_trl.backends.cpu.vllm_server` allows any).

    Asynchronous limits, refused at construction with the fix:

    - `anchor` must be `behavior`: the policy that sampled a stale sample is gone, so there is no π_old to recompute.
    - `trust_region` must not need π_old (`minirl`, `dppo_decoupled`), for the same reason.

    Truncated sampling (`top_k > 0`, `top_p < 1` or `min_p > 0`) is supported as in [`DPPOTrainer`]: the worker asks
    the server for N = `kept_set_size` log-probs per token (`kept_set_logprobs`, default `top_k` when ≤ 64, else 64),
    whose finite entries are the sampler's kept set, and π is compared as π_kept over it; positions whose kept set may
    exceed N are left out and counted (`dppo/kept_set_overflow_ratio`).

    The parent's `epsilon`/`epsilon_high` clip is not DPPO's trust region; only the `grpo_clip`-family ablations read
    `epsilon`.

    `tree_attention` picks the attention over TRL's packed tree rows (docs/async.md, "Tree attention"): `"auto"` runs
    TRL's FlashAttention-3 kernel where it loads and runs (CUDA, `kernels` installed, the Hub kernel reachable), else
    `dppo_trl.kernels.tree_attention.tree_attention_sdpa`, and logs one line saying which and why.
    """

    kept_set_logprobs: int | None = field(
        default=None,
        metadata={
            "help": "Truncated sampling (top_k > 0, top_p < 1 or min_p > 0): the number N of log-probs the server "
            f"lists per token, whose finite ones are the sampler's kept set. `None`: `top_k` when ≤ "
            f"{KEPT_SET_SERVER_LOGPROBS}, else {KEPT_SET_SERVER_LOGPROBS} (the server's `--max-logprobs` must allow "
            "it). As `DPPOConfig.kept_set_logprobs`."
        },
    )

    tree_attention: str = field(
        default="auto",
        metadata={
            "help": "Attention over the packed tree rows: 'auto' (TRL's FlashAttention-3 Hub kernel where it loads "
            "and runs on a CUDA device, else 'sdpa'; one log line says which and why), 'fa3' (TRL's kernel; refused "
            "before the model is built when it cannot load or run), 'sdpa' (one PyTorch SDPA call per tree segment, "
            "any device, no O(L^2) score matrix), 'eager' (the float32 plain-PyTorch reference, O(L^2) memory).",
            "choices": list(TREE_ATTENTION_CHOICES),
        },
    )

    @property
    def kept_set_size(self) -> int | None:
        """N, the log-probs per token the worker asks the server for so the loss can read the kept set; `None` when
        the server samples untruncated (as `DPPOConfig.kept_set_size` in server mode)."""
        return resolve_kept_set_size(self, KEPT_SET_SERVER_LOGPROBS)

    def __post_init__(self):
        super().__post_init__()
        if self.use_liger_kernel:
            # TRL's AsyncGRPOTrainer raises NotImplementedError for it only after loading the model.
            raise ValueError(
                "use_liger_kernel=True: TRL's AsyncGRPOTrainer, which AsyncDPPOTrainer extends, does not support "
                "Liger kernels. Set use_liger_kernel=False (DPPOTrainer takes it on CUDA)."
            )
        self._resolve_trust_region()
        check_kept_set(self, self.kept_set_size, colocate=False)
        if self.tree_attention not in TREE_ATTENTION_CHOICES:
            raise ValueError(
                f"tree_attention must be one of {list(TREE_ATTENTION_CHOICES)}, got {self.tree_attention!r}."
            )
        if self.anchor != "behavior":
            raise ValueError(
                f"anchor={self.anchor!r} is not available asynchronously: a sample can be up to `max_staleness` "
                "policy versions old and the weights that generated it are gone, so there is no π_old to recompute. "
                "Use anchor='behavior' (μ = the server's log-probs)."
            )
        if TRUST_REGIONS[self.trust_region].needs_old_logps:
            raise ValueError(
                f"trust_region={self.trust_region!r} needs π_old (a recompute with the generating weights), which "
                "the asynchronous trainer does not have. Use a baseline that needs no π_old: "
                f"{[name for name, entry in TRUST_REGIONS.items() if not entry.needs_old_logps]}."
            )


class AsyncDPPOTrainer(DPPOLoss, HookedAsyncGRPOTrainer):
    """TRL's `AsyncGRPOTrainer` with DPPO's trust region (eqs. 11-16) anchored on the vLLM server's μ.

    Takes `AsyncGRPOTrainer`'s arguments; `args` is an [`AsyncDPPOConfig`]. Without CUDA, `weight_transfer` defaults
    to `dppo_trl.backends.cpu.async_cpu.FileWeightTransfer` (the server must be
    `python -m dppo_trl.backends.cpu.vllm_server`). Logs the `dppo/*` metrics of `DPPOTrainer` plus
    `dppo/staleness_{s}/mask_ratio` and `dppo/staleness_{s}/mismatch_abs_mean` for s = 0 … `max_staleness`. See the
    module docstring for how the batch reaches `dppo_trl.core.loss.policy_loss`.
    """

    _tag_names = ["trl", "dppo", "async-grpo"]
    _name = "AsyncDPPO"
    _paper = DPPO_PAPER

    def __init__(self, model: str, reward_funcs=None, args: AsyncDPPOConfig | None = None, *pargs, **kwargs):
        if args is None:
            args = AsyncDPPOConfig(f"{str(model).split('/')[-1]}-AsyncDPPO")
        if not isinstance(args, AsyncDPPOConfig):
            raise TypeError(
                f"AsyncDPPOTrainer needs an AsyncDPPOConfig (got {type(args).__name__}); its trust-region fields "
                "define the loss."
            )
        self.trust_region_spec = args.trust_region_spec()
        # Resolved before TRL builds the model, so an explicit "fa3" that cannot run fails before any loading.
        self.tree_attention_choice = self._resolve_tree_attention(args, runs_on_cpu(args))
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        # The check of every weight sync (`dppo_trl/trainers/sync_check.py`), and the policy version (TRL's
        # `model_version`, bumped by each sync once the weights are published) and optimizer step it last armed.
        self._sync_check = SyncCheck(args)
        self._sync_check_version: int | None = None
        self._sync_check_step: int | None = None

    @staticmethod
    def _resolve_tree_attention(args: AsyncDPPOConfig, on_cpu: bool) -> TreeAttentionChoice:
        """`args.tree_attention` on this process's device, logged once (a warning when "auto" had to leave FA3 on a
        GPU: the user most likely expected it)."""
        device = torch.device("cpu") if on_cpu else args.device
        choice = resolve_tree_attention(args.tree_attention, device)
        fell_back = args.tree_attention == "auto" and device.type == "cuda" and choice.name != "fa3"
        (logger.warning if fell_back else logger.info)(
            f"Tree attention: {choice.name} (tree_attention={args.tree_attention!r}: {choice.reason})."
        )
        return choice

    def _model_card_arguments(self) -> dict[str, Any]:
        args = self.args
        return {
            "vllm_mode": "server",
            "sampling": sampling_truncation(args),
            "settings": [
                ("learning_rate", args.learning_rate),
                ("num_generations", args.num_generations),
                ("temperature", args.temperature),
                ("max_staleness", args.max_staleness),
                ("generation", "vLLM (server, asynchronous)"),
            ],
        }

    # ------------------------------------------------------------------------------------------------------------
    # The loss (`DPPOLoss`): where this trainer's batch keeps μ's lists, and what it logs
    # ------------------------------------------------------------------------------------------------------------
    def _wants_hidden_states(self, inputs: dict[str, Any]) -> bool:
        """The final hidden states, for π at the engine's listed ids; a batch without the lists it needs is refused."""
        kept = self.args.kept_set_size is not None
        if not (kept or self.trust_region_spec.uses_top_k):
            return False
        if BEHAVIOR_TOPK_IDS not in inputs:
            needs = (
                "μ's kept set (truncated sampling)" if kept else f"divergence={self.args.divergence!r} needs μ's top-K"
            )
            raise RuntimeError(
                f"{needs}, but the batch's samples carry no engine lists: the rollout worker must push "
                "`dppo_trl.trainers.trl116.async_topk.TopKRolloutSample`s (AsyncDPPOTrainer's own worker does; a "
                "`rollout_worker` passed in must too)."
            )
        return True

    def _behavior_lists(self, inputs: dict[str, Any], forward: PolicyForward) -> BehaviorLists:
        """μ's lists of each loss term (`BEHAVIOR_TOPK_*`): its top-K or, under truncated sampling, the kept set's
        N + 1 slots and its overflow."""
        n = self.args.kept_set_size
        ids = forward.at_tokens(inputs[BEHAVIOR_TOPK_IDS])
        mu_lists = forward.at_tokens(inputs[BEHAVIOR_TOPK_LOGPS]).float()
        if n is None:
            return BehaviorLists(ids, mu_lists)
        mu_lists = engine_lists(mu_lists)
        if mu_lists.shape[-1] != n + 1:
            raise RuntimeError(f"The batch's engine lists have {mu_lists.shape[-1]} slots, not N + 1 = {n + 1}.")
        overflow = kept_set_overflow(mu_lists, n, sampling_truncation(self.args)[0])
        return BehaviorLists(ids, mu_lists, kept_set=True, overflow=overflow)

    def _log_loss_call(self, inputs: dict[str, Any], loss_inputs: LossInputs, outputs: LossOutputs) -> None:
        """The `dppo/*` metrics (by staleness too) and the weight-sync check (`SyncCheck`) of one loss call. The fresh
        rollout of the sync that published policy version v: the tokens sampled by v (staleness 0) trained at the first
        optimizer step after that sync, the only step whose weights are still v's. A later step has moved π, and an
        older sample is another version's."""
        log_trust_region_metrics(self, outputs.stats, "train")
        if not self._sync_check.enabled:
            return
        version, step = self._policy_version(), self.state.global_step
        if version != self._sync_check_version:  # TRL bumps the version only between optimizer steps (pinned)
            self._sync_check_version, self._sync_check_step = version, step
        staleness = loss_inputs.staleness
        self._sync_check.loss_call(
            self,
            None if staleness is None else fresh_rollout_sums(loss_inputs, staleness == 0),
            fresh=self._sync_check_step == step,
            fresh_tokens=f"the server sampled with policy version {version}, published by the weight sync before "
            "this step, trained before any further update (staleness 0)",
        )
