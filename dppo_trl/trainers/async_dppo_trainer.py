"""`AsyncDPPOTrainer`: DPPO's trust region on TRL's experimental asynchronous trainer (`AsyncGRPOTrainer`).

In TRL's asynchronous trainer a rollout worker samples from a vLLM server while the trainer trains; a sample may be
up to `max_staleness` policy versions old when it is trained on, and μ — the server's log-probs of the sampled tokens
(`--logprobs-mode processed_logprobs`) — is the only record of the policy that sampled it. That is exactly DPPO's
anchor: the trust region is taken against μ, however stale.

The glue (no copy of the parent's `compute_loss`, see docs/theory.md "Asynchronous DPPO"):

1. **μ and π.** `compute_loss` hands the parent a thin callable around the model that keeps the forward's per-position
   `log_probs`/`entropy` (TRL's fused LM head), and the batch with its advantages zeroed, so the parent's own PPO-clip
   surrogate contributes no gradient (its `ratio`/`kl`/`entropy` metrics stay true π/μ statistics; its clip metrics,
   always 0 then, are dropped). The DPPO term `−A · sg(w) · π/sg(π)` (value `−A·w`, gradient `−A·w·∇log π`) with
   `w` from `dppo_trl.core.loss.policy_loss`, plus the optional μ-KL term, is added with the
   parent's normalisation (tokens per rank × gradient accumulation).
2. **Staleness.** TRL computes each sample's staleness in its queue dataset but drops it before packing. The trainer
   wraps the rollout queue so each sample it hands out carries its `model_version` in its `metrics` dict, and a
   collator subclass moves it into the batch (`dppo_sample_version`, one entry per packed sample; `segment_id` maps
   tokens to samples). The loss computes staleness = current policy version − sample version.
3. **CPU.** Without CUDA the trainer applies `dppo_trl.backends.cpu.async_cpu`'s paths: pure-PyTorch tree attention registered
   only while its forward runs, no peak-FLOPs lookup, and the file-based weight transfer to
   `python -m dppo_trl.backends.cpu.vllm_server`.

Top-K divergences are refused: the worker requests only the sampled token's log-prob (`"logprobs": 0`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from trl.experimental.async_grpo import async_grpo_trainer as _parent_module
from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
from trl.experimental.async_grpo.async_grpo_trainer import (
    AsyncGRPOTrainer,
    DataCollatorForRollout,
    RolloutQueueDataset,
)
from trl.experimental.async_grpo.vllm_client import VLLMClient

from dppo_trl.backends.cpu.async_cpu import FileWeightTransfer, cpu_peak_flops, cpu_tree_attention
from dppo_trl.core.functional import sanitize_behavior_logps
from dppo_trl.core.loss import LossInputs, policy_loss
from dppo_trl.core.registry import TRUST_REGIONS
from dppo_trl.trainers.config import TrustRegionFields
from dppo_trl.trainers.metric_logging import log_trust_region_metrics

__all__ = ["SAMPLE_VERSION", "AsyncDPPOConfig", "AsyncDPPOTrainer"]

# Batch key: the policy version that sampled each packed sample of a row (−1 pads rows to the same length).
SAMPLE_VERSION = "dppo_sample_version"
# Where the version rides from the queue to the collator: the sample's per-sample `metrics` dict, which TRL passes
# through its queue dataset and batcher untouched. The collator removes it before TRL aggregates those metrics.
_VERSION_KEY = "dppo/_model_version"


def _cuda_available() -> bool:
    return torch.cuda.is_available()


@dataclass
class AsyncDPPOConfig(TrustRegionFields, AsyncGRPOConfig):
    r"""
    Configuration for [`AsyncDPPOTrainer`]: every `trl.experimental.async_grpo.AsyncGRPOConfig` field, plus DPPO's
    trust-region fields with the same meaning, defaults and validation as in [`DPPOConfig`]: `divergence`,
    `delta_low`, `delta_high`, `divergence_top_k`, `ratio_cap`, `mu_kl_coef`, `anchor`, `trust_region`, `relax_alpha`
    (see its docstring and docs/api.md).

    Asynchronous limits, refused at construction with the fix:

    - `divergence` must be `binary_tv` or `binary_kl`: TRL's rollout worker asks the server for the sampled token's
      log-prob only, so μ's top-K never reaches the trainer.
    - `anchor` must be `behavior`: the policy that sampled a stale sample is gone, so there is no π_old to recompute.
    - `trust_region` must not need π_old (`minirl`, `dppo_decoupled`), for the same reason.

    The parent's `epsilon`/`epsilon_high` clip is not DPPO's trust region; only the `grpo_clip`-family ablations read
    `epsilon`.
    """

    def __post_init__(self):
        super().__post_init__()
        self._resolve_trust_region()
        if self.divergence.startswith("topk_"):
            raise ValueError(
                f"divergence={self.divergence!r} needs μ's top-K log-probs, which TRL's asynchronous rollout worker "
                "does not request (it asks the server for the sampled token's log-prob only). Use "
                "divergence='binary_tv' or divergence='binary_kl' with AsyncDPPOTrainer, or DPPOTrainer for top-K."
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


class _VersionTaggingQueue:
    """The rollout queue, handing out each sample with its `model_version` copied into its `metrics` dict (a copy of
    the sample: the worker's object and anything else holding it are not touched)."""

    def __init__(self, queue: Any):
        self._queue = queue

    def get(self, *args, **kwargs):
        sample = self._queue.get(*args, **kwargs)
        return dataclasses.replace(sample, metrics={**sample.metrics, _VERSION_KEY: int(sample.model_version)})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


class _VersionedRolloutQueueDataset(RolloutQueueDataset):
    def __init__(self, rollout_queue, *args, **kwargs):
        super().__init__(_VersionTaggingQueue(rollout_queue), *args, **kwargs)


@dataclass
class _VersionedCollator(DataCollatorForRollout):
    """TRL's rollout collator, plus `SAMPLE_VERSION`: `(num_processes, max samples per row)` sampling versions in each
    row's sample order (the order of `segment_id`), −1 padded."""

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        (rows,) = examples
        versions = [[example["metrics"].pop(_VERSION_KEY, -1) for example in row.samples] for row in rows]
        batch = super().torch_call(examples)
        width = max(1, max(len(row) for row in versions))
        batch[SAMPLE_VERSION] = torch.tensor([row + [-1] * (width - len(row)) for row in versions], dtype=torch.long)
        return batch


class _ForwardCapture:
    """Calls the model as the parent's `compute_loss` does and keeps the per-position `log_probs` and `entropy` of
    TRL's fused LM head (with their graph) for the DPPO term."""

    def __init__(self, model: Any):
        self.model = model
        self.log_probs: torch.Tensor | None = None
        self.entropy: torch.Tensor | None = None

    def __call__(self, *args, **kwargs):
        outputs = self.model(*args, **kwargs)
        self.log_probs = outputs.log_probs
        self.entropy = getattr(outputs, "entropy", None)
        return outputs


class AsyncDPPOTrainer(AsyncGRPOTrainer):
    """TRL's `AsyncGRPOTrainer` with DPPO's trust region (eqs. 11-16) anchored on the vLLM server's μ.

    Takes `AsyncGRPOTrainer`'s arguments; `args` is an [`AsyncDPPOConfig`]. Without CUDA, `weight_transfer` defaults
    to `dppo_trl.backends.cpu.async_cpu.FileWeightTransfer` (the server must be `python -m dppo_trl.backends.cpu.vllm_server`). Logs the
    `dppo/*` metrics of `DPPOTrainer` plus `dppo/staleness_{s}/mask_ratio` and `dppo/staleness_{s}/mismatch_abs_mean`
    for s = 0 … `max_staleness`.
    """

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
        self.trust_region_spec = self.args.trust_region_spec()

    def get_train_dataloader(self):
        # The only change: each sample's sampling version travels with it into the batch (`SAMPLE_VERSION`).
        with (
            mock.patch.object(_parent_module, "RolloutQueueDataset", _VersionedRolloutQueueDataset),
            mock.patch.object(_parent_module, "DataCollatorForRollout", _VersionedCollator),
        ):
            return super().get_train_dataloader()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The parent's loss with zeroed advantages (its forward, aux loss and metrics), plus the DPPO term."""
        versions = inputs.pop(SAMPLE_VERSION, None)
        capture = _ForwardCapture(model)
        parent_inputs = {**inputs, "advantages": torch.zeros_like(inputs["advantages"])}
        attention = cpu_tree_attention() if self.accelerator.device.type == "cpu" else contextlib.nullcontext()
        with attention:
            loss = super().compute_loss(capture, parent_inputs, return_outputs, num_items_in_batch)
        return loss + self._dppo_loss(inputs, capture, versions)

    def _dppo_loss(self, inputs: dict, capture: _ForwardCapture, versions: torch.Tensor | None) -> torch.Tensor:
        selected = inputs["token_index"] >= 0
        token_index = inputs["token_index"][selected]
        pi_logps = capture.log_probs.flatten()[token_index].float()
        entropies = capture.entropy.flatten()[token_index] if capture.entropy is not None else None
        advantages = inputs["advantages"][selected].float()
        mu_logps, valid = sanitize_behavior_logps(inputs["old_log_probs"][selected])
        staleness = None
        if versions is not None:
            sample_versions = versions.reshape(-1, versions.shape[-1])[0]
            staleness = (self._policy_version() - sample_versions[inputs["segment_id"][selected]]).clamp(min=0)
        outputs = policy_loss(
            self.trust_region_spec,
            LossInputs(
                pi_logps=pi_logps,
                mu_logps=mu_logps,
                advantages=advantages,
                tokens=torch.ones_like(valid),
                valid=valid,
                entropies=entropies.detach() if entropies is not None else None,
                staleness=staleness,
            ),
        )
        per_token = outputs.policy_loss if outputs.mu_kl is None else outputs.policy_loss + outputs.mu_kl
        # The parent's normalisation: tokens per rank, then gradient accumulation (pinned by tests/test_async_dppo.py).
        tokens_per_rank = (inputs["global_n_tokens"][0] / self.accelerator.num_processes).clamp(min=1.0)
        loss = per_token.sum() / tokens_per_rank.float() / self.current_gradient_accumulation_steps
        log_trust_region_metrics(self, outputs.stats, "train")
        return loss

    def _policy_version(self) -> int:
        # Only the main process bumps `model_version` (it drives the server); every rank needs the same value.
        if self.accelerator.num_processes == 1:
            return int(self.model_version)
        from accelerate.utils import broadcast_object_list

        return int(broadcast_object_list([self.model_version], from_process=0)[0])
