"""`AsyncDPPOTrainer`: DPPO's trust region on TRL's experimental asynchronous trainer (`AsyncGRPOTrainer`).

In TRL's asynchronous trainer a rollout worker samples from a vLLM server while the trainer trains; a sample may be
up to `max_staleness` policy versions old when it is trained on, and μ — the server's log-probs of the sampled tokens
(`--logprobs-mode processed_logprobs`) — is the only record of the policy that sampled it. That is exactly DPPO's
anchor: the trust region is taken against μ, however stale.

The data path, in calls (see docs/theory.md "Asynchronous DPPO"):

    AsyncDPPOTrainer.get_train_dataloader()                  TRL's method restated, two arguments changed:
      RolloutQueueDataset(rollout_queue=SampleVersionQueue(self.rollout_queue), ...)
          each sample's `metrics` becomes `SampleMetrics(metrics, model_version)`
      → TRL's planner (TokenBudgetBatcher / FixedCountBatcher)
      → SampleVersionCollator (TRL's collator + batch[SAMPLE_VERSION], one version per packed sample)
    AsyncDPPOTrainer.compute_loss(model, inputs)
      ├ AsyncGRPOTrainer.compute_loss(forward, inputs with advantages = 0)   forward = KeepForwardOutputs(model)
      │     its forward, MoE aux loss, ratio/kl/entropy metrics and step accounting stay TRL's; A = 0 makes its
      │     PPO surrogate contribute value 0 and gradient 0
      ├ self._loss_inputs(inputs, forward.outputs, self._policy_version())  → LossInputs(π, μ, A, ..., staleness)
      └ self._trust_region_loss(loss_inputs, inputs)
            policy_loss(spec, loss_inputs) → per-token eq. 11 (+ μ-KL), scaled as TRL scales its own term

What TRL 1.16 offers no seam for, and how this adapter bridges it (each pinned in tests/trl_contract.py, the TRL
change that removes it in docs/upstream.md "AsyncGRPOTrainer"):

1. **The sampling version is dropped before the batch.** `RolloutQueueDataset.__iter__` reads `model_version`, uses
   it for its staleness filter and yields a dict without it; the only field that travels from the queue to the
   collator untouched is the sample's `metrics` dict. `SampleVersionQueue` (the rollout queue, passed to TRL's dataset
   as its `rollout_queue` argument) hands out each sample with its metrics as a `SampleMetrics`: a `dict` with the
   same items plus a `model_version` attribute. It is an attribute, not a key, because TRL's collator averages every
   key of `metrics` into its logged metrics and its trace logger copies them.
2. **The collator is built inline.** `get_train_dataloader` constructs `DataCollatorForRollout(...)` in its body
   (no attribute or method to override), so this trainer restates that method with TRL's own classes and
   `SampleVersionCollator`; `tests/meta/test_trl_contract.py` fails when TRL's method changes.
3. **`compute_loss` is one method** (forward, PPO clip, normalisation, aux loss, metrics) with no hook between the
   forward and the clip, and its inputs are read before the forward, so nothing can be substituted once π is known.
   It runs on the batch with zeroed advantages and `KeepForwardOutputs` in place of the model (a callable that
   keeps the outputs of TRL's one `model(...)` call); DPPO's term is added on those log-probs with TRL's
   normalisation (tokens per rank, then gradient accumulation), which `tests/integration/test_async_dppo.py` pins against TRL's
   real loss. TRL's PPO-clip rates, always 0 with zero advantages, are dropped from the logs.
4. **The policy version lives on the main process.** Weight syncs bump `model_version` on rank 0 only, between
   optimizer steps; `_policy_version()` reads it once per optimizer step (a broadcast on several processes).
5. **The worker asks for the sampled token's log-prob only.** For top-K divergences and truncated sampling the
   worker TRL built is replaced (before it starts) by `TopKRolloutWorker`, TRL's worker class running a subclass of
   its loop; see `dppo_trl.trainers.async_topk`.

On CPU (no CUDA, or `use_cpu=True`) the trainer applies `dppo_trl.backends.cpu.async_cpu`'s paths: pure-PyTorch tree
attention registered only while its forward runs, no peak-FLOPs lookup, and the file-based weight transfer to
`python -m dppo_trl.backends.cpu.vllm_server`.

Top-K divergences (`topk_tv`, `topk_kl`): the trainer replaces TRL's worker, before it starts, by
`dppo_trl.trainers.async_topk.TopKRolloutWorker` built with the same arguments, which asks the server for μ's top-K
and hands the lists on with each sample; `SampleVersionQueue` carries them on the sample's `SampleMetrics` and
`SampleVersionCollator` lays them out in the packed loss-term order (see that module). π at those ids comes from the
final hidden states of TRL's one forward (`KeepForwardOutputs` hooks the backbone) through the chunked gather of
`dppo_trl.kernels.topk_logps` (no `[N, V]` logits).

Truncated sampling (`top_k`, `top_p`, `min_p`): the same worker asks for N = `kept_set_size` processed log-probs per
token instead of K; the lists ride the same way (`BEHAVIOR_TOPK_*`, N + 1 slots), their finite entries are the
sampler's kept set, and `_with_kept_set` hands the core log π(kept) — with its gradient, from the forward's hidden
states kept with their graph (`logps_at_ids_with_grad`) — and the overflow positions (`kept_set.kept_set_overflow`).
The core's per-token term then has eq. 11's gradient with π_kept as it stands; it is scaled like the rest of DPPO's
term.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from torch.utils.data import DataLoader
from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
from trl.experimental.async_grpo.async_grpo_trainer import (
    AsyncGRPOTrainer,
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
    _EmptyIterableDataset,
)
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker
from trl.experimental.async_grpo.vllm_client import VLLMClient

from dppo_trl.backends.cpu.async_cpu import FileWeightTransfer, cpu_peak_flops, cpu_tree_attention
from dppo_trl.core.functional import kept_log_mass, sanitize_behavior_logps
from dppo_trl.core.loss import LossInputs, policy_loss
from dppo_trl.core.registry import TRUST_REGIONS
from dppo_trl.kernels.topk_logps import LogitTransform, logps_at_ids_from_sampled, logps_at_ids_with_grad
from dppo_trl.trainers.async_context import ContextFitRolloutWorker
from dppo_trl.trainers.async_topk import BEHAVIOR_TOPK_IDS, BEHAVIOR_TOPK_LOGPS, TopKRolloutWorker, behavior_topk
from dppo_trl.trainers.config import (
    KEPT_SET_SERVER_LOGPROBS,
    TrustRegionFields,
    check_kept_set,
    resolve_kept_set_size,
    sampling_truncation,
)
from dppo_trl.trainers.kept_set import engine_lists, kept_set_overflow
from dppo_trl.trainers.metric_logging import log_trust_region_metrics

__all__ = [
    "SAMPLE_VERSION",
    "AsyncDPPOConfig",
    "AsyncDPPOTrainer",
    "KeepForwardOutputs",
    "SampleMetrics",
    "SampleVersionCollator",
    "SampleVersionQueue",
]

# Batch key: the policy version that sampled each packed sample of a row, `(rows, max samples per row)` in the order
# `segment_id` numbers a row's samples, −1 padded.
SAMPLE_VERSION = "dppo_sample_version"

logger = logging.getLogger(__name__)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


@dataclass
class AsyncDPPOConfig(TrustRegionFields, AsyncGRPOConfig):
    r"""
    Configuration for [`AsyncDPPOTrainer`]: every `trl.experimental.async_grpo.AsyncGRPOConfig` field, plus DPPO's
    trust-region fields with the same meaning, defaults and validation as in [`DPPOConfig`]: `divergence`,
    `delta_low`, `delta_high`, `divergence_top_k`, `ratio_cap`, `mu_kl_coef`, `anchor`, `trust_region`, `relax_alpha`
    (see its docstring and docs/api.md).

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

    @property
    def kept_set_size(self) -> int | None:
        """N, the log-probs per token the worker asks the server for so the loss can read the kept set; `None` when
        the server samples untruncated (as `DPPOConfig.kept_set_size` in server mode)."""
        return resolve_kept_set_size(self, KEPT_SET_SERVER_LOGPROBS)

    def __post_init__(self):
        super().__post_init__()
        self._resolve_trust_region()
        check_kept_set(self, self.kept_set_size, colocate=False)
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


class SampleMetrics(dict):
    """A rollout sample's `metrics` (same items) that also carries what TRL's queue dataset drops: the policy version
    which sampled the sample and, for the top-K divergences, μ's top-K of its trained tokens (`(ids, logps)`, each
    `(n, K + 1)`, or `None`).

    Both are attributes, not items: TRL's collator averages every item of `metrics` into the logged metrics and its
    trace logger copies them, so an item would leak into both.
    """

    def __init__(
        self,
        metrics: dict[str, float],
        model_version: int,
        behavior_topk: tuple[Any, Any] | None = None,
    ):
        super().__init__(metrics)
        self.model_version = int(model_version)
        self.behavior_topk = behavior_topk


class SampleVersionQueue:
    """The rollout queue as TRL's `RolloutQueueDataset` reads it (`get(timeout=...)`, `qsize()`), handing out each
    sample with its `metrics` as `SampleMetrics` (a copy of the sample: the worker's object is not touched). A
    `TopKRolloutSample`'s lists go along."""

    def __init__(self, queue: Any):
        self.queue = queue

    def get(self, timeout: float | None = None) -> Any:
        sample = self.queue.get(timeout=timeout)
        topk_ids = getattr(sample, "topk_ids", None)
        topk = None if topk_ids is None else (topk_ids, sample.topk_logps)
        return dataclasses.replace(sample, metrics=SampleMetrics(sample.metrics, sample.model_version, topk))

    def qsize(self) -> int:
        return self.queue.qsize()


def sample_versions(rows: list[Any]) -> torch.Tensor:
    """`(len(rows), max samples per row)` sampling versions of packed `TreeRow`s, in each row's sample order (the
    order `TreeRow.pack` numbers in `segment_id`), −1 padded."""
    versions = []
    for row in rows:
        for sample in row.samples:
            if not isinstance(sample["metrics"], SampleMetrics):
                raise TypeError(
                    "A rollout sample reached the collator without its sampling version (its `metrics` is not a "
                    "SampleMetrics): it was not read through SampleVersionQueue. TRL's queue dataset may have "
                    "changed how it passes `metrics` on; see tests/meta/test_trl_contract.py."
                )
        versions.append([sample["metrics"].model_version for sample in row.samples])
    width = max(1, max(len(row) for row in versions))
    return torch.tensor([row + [-1] * (width - len(row)) for row in versions], dtype=torch.long)


@dataclass
class SampleVersionCollator(DataCollatorForRollout):
    """TRL's rollout collator, plus `batch[SAMPLE_VERSION]` (`sample_versions` of the micro-batch's rows) and, when
    the samples carry μ's top-K, `batch[BEHAVIOR_TOPK_IDS]` / `batch[BEHAVIOR_TOPK_LOGPS]` (`async_topk.behavior_topk`:
    `(rows, loss terms, K + 1)` in `token_index` order)."""

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        batch = super().torch_call(examples)
        (rows,) = examples  # one planner item per batch: the micro-batch's rows, one per process
        batch[SAMPLE_VERSION] = sample_versions(rows)
        topk = behavior_topk([row.samples for row in rows], batch)
        if topk is not None:
            batch[BEHAVIOR_TOPK_IDS], batch[BEHAVIOR_TOPK_LOGPS] = topk
        return batch


class KeepForwardOutputs:
    """The model as `AsyncGRPOTrainer.compute_loss` calls it, keeping the outputs of that one call (TRL's fused LM head:
    per-position `log_probs` and `entropy`, with their graph). TRL 1.16's `compute_loss` returns only the loss.

    With `backbone` (the decoder the fused head projects), also keeps its final hidden states (`hidden`, `(1, N, H)`),
    detached for π at μ's top-K ids, with their graph (`hidden_with_graph`) for π's kept-set mass.
    """

    def __init__(self, model: Any, backbone: torch.nn.Module | None = None, hidden_with_graph: bool = False):
        self.model = model
        self.backbone = backbone
        self.hidden_with_graph = hidden_with_graph
        self.outputs: Any = None
        self.hidden: torch.Tensor | None = None

    def _keep_hidden(self, _module, _inputs, output) -> None:
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        self.hidden = hidden if self.hidden_with_graph else hidden.detach()

    def __call__(self, *args, **kwargs):
        if self.outputs is not None:
            raise RuntimeError(
                "AsyncGRPOTrainer.compute_loss called the model twice; AsyncDPPOTrainer expects one forward per loss "
                "call (see tests/trl_contract.py)."
            )
        handle = self.backbone.register_forward_hook(self._keep_hidden) if self.backbone is not None else None
        try:
            self.outputs = self.model(*args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        return self.outputs


class AsyncDPPOTrainer(AsyncGRPOTrainer):
    """TRL's `AsyncGRPOTrainer` with DPPO's trust region (eqs. 11-16) anchored on the vLLM server's μ.

    Takes `AsyncGRPOTrainer`'s arguments; `args` is an [`AsyncDPPOConfig`]. Without CUDA, `weight_transfer` defaults
    to `dppo_trl.backends.cpu.async_cpu.FileWeightTransfer` (the server must be
    `python -m dppo_trl.backends.cpu.vllm_server`). Logs the `dppo/*` metrics of `DPPOTrainer` plus
    `dppo/staleness_{s}/mask_ratio` and `dppo/staleness_{s}/mismatch_abs_mean` for s = 0 … `max_staleness`. See the
    module docstring for how the batch reaches `dppo_trl.core.loss.policy_loss`.
    """

    # Set by `AsyncGRPOTrainer.__init__`: on the main process the rollout worker (built or passed in) and its queue.
    rollout_worker: Any
    rollout_queue: Any

    def __init__(self, model: str, reward_funcs=None, args: AsyncDPPOConfig | None = None, *pargs, **kwargs):
        if args is None:
            args = AsyncDPPOConfig(f"{str(model).split('/')[-1]}-AsyncDPPO")
        if not isinstance(args, AsyncDPPOConfig):
            raise TypeError(
                f"AsyncDPPOTrainer needs an AsyncDPPOConfig (got {type(args).__name__}); its trust-region fields "
                "define the loss."
            )
        on_cpu = args.use_cpu or not _cuda_available()
        if on_cpu and kwargs.get("weight_transfer") is None:
            kwargs["weight_transfer"] = FileWeightTransfer(
                VLLMClient(args.vllm_server_base_url, args.vllm_server_timeout), args.weight_sync_timeout
            )
        with cpu_peak_flops() if on_cpu else contextlib.nullcontext():
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        # Entries per token the worker asks the server for: N (truncated sampling, whose first K + 1 slots are also
        # the top-K lists), else K (top-K divergences), else none.
        self._engine_list_size = args.kept_set_size or (args.divergence_top_k if args.uses_top_k else None)
        if type(self.rollout_worker) is AsyncRolloutWorker:
            # TRL built its own worker (none was passed) and starts it on train begin: run the same worker with the
            # loop that fits each turn to the server's context (`async_context`) and, for top-K or truncated
            # sampling, also asks for μ's lists. A worker passed in must do both itself.
            if self._engine_list_size is not None:
                self.rollout_worker = TopKRolloutWorker.like(self.rollout_worker, self._engine_list_size)
            else:
                self.rollout_worker = ContextFitRolloutWorker.like(self.rollout_worker)
            self.rollout_queue = self.rollout_worker.rollout_buffer
        self.trust_region_spec = args.trust_region_spec()  # `args` is `self.args`, typed as AsyncDPPOConfig
        # (trainer state, optimizer step, version) of the last `_policy_version()` read on several processes.
        self._policy_version_read: tuple[Any, int, int] | None = None

    def get_train_dataloader(self) -> DataLoader:
        """`AsyncGRPOTrainer.get_train_dataloader` of TRL 1.16 with two arguments changed: the queue dataset reads the
        rollout queue through `SampleVersionQueue`, and the collator is `SampleVersionCollator`. TRL builds its
        collator inline, so there is no narrower seam; the contract test fails when TRL's method changes."""
        num_processes = self.accelerator.num_processes
        if self.accelerator.is_main_process:
            dataset = RolloutQueueDataset(
                rollout_queue=SampleVersionQueue(self.rollout_queue),
                model_version_fn=lambda: self.model_version,
                check_health_fn=self.rollout_worker.check_health,
                stale_after_s=self.args.heartbeat_stale_after_s,
                metrics=self._metrics["train"],
                max_staleness=self.args.max_staleness,
                report_to=self.args.report_to,
            )
            self._rollout_dataset = dataset  # TRL's `_log_step_metrics` flushes its queue wait
            if self.args.token_budget is None:
                self.vllm_client.wait_for_server_ready()
                self.args.token_budget = self.vllm_client.get_max_model_len()
                logger.info(f"token_budget unset; defaulting to vLLM max_model_len={self.args.token_budget}")
            if self.args.token_budget > 0:
                dataset = TokenBudgetBatcher(dataset, num_processes, self.args.token_budget, self._metrics["train"])
            else:
                dataset = FixedCountBatcher(
                    dataset, num_processes, self.args.per_device_train_batch_size * num_processes
                )
        else:
            dataset = _EmptyIterableDataset()
        return self.accelerator.prepare(
            DataLoader(
                dataset,
                batch_size=1,
                collate_fn=SampleVersionCollator(
                    self.processing_class.pad_token_id,
                    num_processes,
                    groups_trained=self._trained_groups,
                    metrics=self._metrics["train"],
                    token_budget=max(self.args.token_budget or 0, 0),
                ),
                num_workers=0,
            )
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss on the batch with zeroed advantages (its forward, aux loss, metrics, accounting), plus DPPO's
        term on that forward's log-probs."""
        wants_topk, kept = self.args.uses_top_k, self.args.kept_set_size is not None
        if (wants_topk or kept) and BEHAVIOR_TOPK_IDS not in inputs:
            needs = (
                "μ's kept set (truncated sampling)" if kept else f"divergence={self.args.divergence!r} needs μ's top-K"
            )
            raise RuntimeError(
                f"{needs}, but the batch's samples carry no engine lists: the rollout worker must push "
                "`dppo_trl.trainers.async_topk.TopKRolloutSample`s (AsyncDPPOTrainer's own worker does; a "
                "`rollout_worker` passed in must too)."
            )
        forward = KeepForwardOutputs(
            model, self._backbone(model) if wants_topk or kept else None, hidden_with_graph=kept
        )
        trl_inputs = {**inputs, "advantages": torch.zeros_like(inputs["advantages"])}
        attention = cpu_tree_attention() if self.accelerator.device.type == "cpu" else contextlib.nullcontext()
        with attention:
            trl_loss = super().compute_loss(forward, trl_inputs, return_outputs, num_items_in_batch)
        loss_inputs = self._loss_inputs(inputs, forward.outputs, self._policy_version())
        if kept:
            loss_inputs = self._with_kept_set(loss_inputs, inputs, forward.hidden, model)
        elif wants_topk:
            loss_inputs = self._with_topk(loss_inputs, inputs, forward.hidden, model)
        return trl_loss + self._trust_region_loss(loss_inputs, inputs)

    def _loss_inputs(self, inputs: dict[str, Any], outputs: Any, policy_version: int) -> LossInputs:
        """The core's per-token inputs of one packed row: the loss terms (`token_index >= 0`), as TRL selects them."""
        selected = inputs["token_index"] >= 0
        token_index = inputs["token_index"][selected]
        valid_mu, valid = sanitize_behavior_logps(inputs["old_log_probs"][selected])
        entropy = getattr(outputs, "entropy", None)
        staleness = None
        if SAMPLE_VERSION in inputs:
            versions = inputs[SAMPLE_VERSION].reshape(-1, inputs[SAMPLE_VERSION].shape[-1])[0]  # this rank's row
            staleness = (policy_version - versions[inputs["segment_id"][selected]]).clamp(min=0)
        return LossInputs(
            pi_logps=outputs.log_probs.flatten()[token_index].float(),
            mu_logps=valid_mu,
            advantages=inputs["advantages"][selected].float(),
            tokens=torch.ones_like(valid),
            valid=valid,
            entropies=entropy.flatten()[token_index].detach() if entropy is not None else None,
            staleness=staleness,
        )

    def _with_topk(self, loss_inputs: LossInputs, inputs: dict[str, Any], hidden: torch.Tensor | None, model):
        """`loss_inputs` with π and μ over TopK(μ) ∪ {y} of each loss term: μ's lists from the batch, π's at the same ids
        from the forward's final hidden states through `logps_at_ids_from_sampled` (no `[N, V]` logits)."""
        if hidden is None:
            raise RuntimeError("DPPO top-K needs the policy's final hidden states, but none were captured.")
        selected = inputs["token_index"] >= 0
        ids = inputs[BEHAVIOR_TOPK_IDS][selected]
        mu_topk = inputs[BEHAVIOR_TOPK_LOGPS][selected].float()
        valid = loss_inputs.valid
        lm = _causal_lm(self.accelerator.unwrap_model(model))
        head = lm.get_output_embeddings()
        # FSDP2 shards the head as DTensors; the gather needs the full rows (as TRL's fused head does).
        weight, bias = (_full(p) for p in (head.weight, getattr(head, "bias", None)))
        pi_topk = torch.full_like(mu_topk, -math.inf)
        rows = hidden.reshape(-1, hidden.shape[-1])[inputs["token_index"][selected]][valid]
        pi_topk[valid] = logps_at_ids_from_sampled(
            rows,
            weight,
            ids[valid],
            ids[valid][:, 0],
            loss_inputs.pi_logps.detach()[valid],
            bias=bias,
            transform=LogitTransform.from_model_config(lm.config, temperature=self.temperature),
        )
        # Terms whose μ is invalid must not leak into the divergence: both sides get identical padding.
        mu_topk = torch.where(valid.unsqueeze(-1), mu_topk, torch.full_like(mu_topk, -math.inf))
        return dataclasses.replace(loss_inputs, pi_topk_logps=pi_topk, mu_topk_logps=mu_topk)

    def _with_kept_set(self, loss_inputs: LossInputs, inputs: dict[str, Any], hidden: torch.Tensor | None, model):
        """Truncated sampling: `loss_inputs` with log π(kept) and the overflow positions (and, under a top-K divergence,
        the first K + 1 slots as the top-K lists), as `DPPOTrainer._pi_kept` builds them.

        The batch's engine lists (N + 1 slots, `BEHAVIOR_TOPK_*`) hold the kept set as their finite entries; π at
        those ids comes from the forward's final hidden states with their graph (`logps_at_ids_with_grad`, no
        `[N, V]` logits), so log π_kept = log π − log π(kept) carries the gradient of every kept id through the core's
        `policy_loss` term itself (no separate correction term: this trainer adds that term as written).
        """
        if hidden is None:
            raise RuntimeError("DPPO's kept set needs the policy's final hidden states, but none were captured.")
        n = self.args.kept_set_size
        assert n is not None
        selected = inputs["token_index"] >= 0
        ids = inputs[BEHAVIOR_TOPK_IDS][selected]
        mu_lists = engine_lists(inputs[BEHAVIOR_TOPK_LOGPS][selected].float())
        if mu_lists.shape[-1] != n + 1:
            raise RuntimeError(f"The batch's engine lists have {mu_lists.shape[-1]} slots, not N + 1 = {n + 1}.")
        valid = loss_inputs.valid
        lm = _causal_lm(self.accelerator.unwrap_model(model))
        head = lm.get_output_embeddings()
        weight, bias = (_full(p) for p in (head.weight, getattr(head, "bias", None)))
        rows = hidden.reshape(-1, hidden.shape[-1])[inputs["token_index"][selected]][valid]
        pi_lists = torch.full(mu_lists.shape, -math.inf, dtype=torch.float32, device=mu_lists.device)
        pi_lists[valid] = logps_at_ids_with_grad(
            rows,
            weight,
            ids[valid],
            ids[valid][:, 0],
            loss_inputs.pi_logps[valid].float(),
            bias=bias,
            transform=LogitTransform.from_model_config(lm.config, temperature=self.temperature),
        )
        kept = torch.isfinite(mu_lists) & (ids >= 0) & valid.unsqueeze(-1)
        overflow = kept_set_overflow(mu_lists, n, sampling_truncation(self.args)[0])
        topk: dict[str, torch.Tensor] = {}
        if self.args.uses_top_k:
            width = self.args.divergence_top_k + 1
            mu_topk = torch.where(
                valid.unsqueeze(-1), mu_lists[..., :width], torch.full_like(mu_lists[..., :width], -math.inf)
            )
            topk = {"pi_topk_logps": pi_lists[..., :width].detach(), "mu_topk_logps": mu_topk}
        return dataclasses.replace(
            loss_inputs, kept_log_mass=kept_log_mass(pi_lists, kept), kept_overflow=overflow, **topk
        )

    def _backbone(self, model) -> torch.nn.Module:
        """The decoder whose output TRL's fused head projects (`PreTrainedModel.base_model`, under PEFT too)."""
        return _causal_lm(self.accelerator.unwrap_model(model)).base_model

    def _trust_region_loss(self, loss_inputs: LossInputs, inputs: dict[str, Any]) -> torch.Tensor:
        """DPPO's per-token terms summed and scaled as `AsyncGRPOTrainer.compute_loss` scales its policy term: by the
        tokens per process (`global_n_tokens / num_processes`), then by gradient accumulation. Logs `dppo/*`."""
        outputs = policy_loss(self.trust_region_spec, loss_inputs)
        per_token = outputs.policy_loss if outputs.mu_kl is None else outputs.policy_loss + outputs.mu_kl
        tokens_per_rank = (inputs["global_n_tokens"][0] / self.accelerator.num_processes).clamp(min=1.0)
        log_trust_region_metrics(self, outputs.stats, "train")
        return per_token.sum() / tokens_per_rank.float() / self.current_gradient_accumulation_steps

    def _policy_version(self) -> int:
        """The version of the weights being trained: TRL's `model_version`, which only the main process bumps (after
        each weight sync, between optimizer steps). On several processes it is broadcast from the main process once
        per optimizer step, at the step's first loss call, which every process reaches together."""
        if self.accelerator.num_processes == 1:
            return int(self.model_version)
        read = self._policy_version_read
        if read is None or read[0] is not self.state or read[1] != self.state.global_step:
            version = int(broadcast_object_list([self.model_version], from_process=0)[0])
            read = self._policy_version_read = (self.state, self.state.global_step, version)
        return read[2]


def _causal_lm(model):
    """The `PreTrainedModel` carrying the LM head (under PEFT, the wrapped base model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _full(param):
    return param.full_tensor() if param is not None and hasattr(param, "full_tensor") else param
