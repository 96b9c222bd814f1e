"""The room for TRL 1.16's `AsyncGRPOTrainer`: `HookedAsyncGRPOTrainer` provides the hooks docs/upstream.md proposes.

`AsyncDPPOTrainer` subclasses `HookedAsyncGRPOTrainer` and implements its hooks; this module is where they are
bridged onto TRL 1.16's experimental asynchronous trainer. Each row below is one of docs/upstream.md's, with the pins
of tests/trl_contract.py it needs (`tests/meta/test_rooms.py` keeps the two tables equal); when TRL ships a hook, its
part is deleted and the hook becomes TRL's:

| hook the room provides | bridged on TRL 1.16 by | upstream.md |
|---|---|---|
| `PolicyForward.model_version`: each loss term's sampling version, in the batch | `SampleVersionQueue` hands TRL's queue dataset each sample with its metrics as a `SampleMetrics` (the version an attribute: TRL averages every item of `metrics` into its logs); `SampleVersionCollator` packs it as `batch[SAMPLE_VERSION]`; `get_train_dataloader` restates TRL's method with those two arguments (TRL builds its collator inline) | async-1 |
| `_per_token_policy_loss(inputs, forward)`: the policy term per token, on the parent's forward (`PolicyForward`) | TRL's `compute_loss` runs on the batch with zeroed advantages (value 0, gradient 0 for its PPO term) through `KeepForwardOutputs`, which keeps its one forward's outputs; the hook's terms are scaled as TRL scales its own (tokens per process, then gradient accumulation: restated); TRL's clip rates, always 0 then, are dropped (`PARENT_CLIP_METRICS`) | async-2 |
| `_policy_version()`: the version of the weights being trained, on every rank | broadcast from the main process once per optimizer step (TRL bumps `model_version` on the main process only, between steps) | async-3 |
| no peak-FLOPs lookup and a file-based weight transfer on a machine without CUDA | `cpu_peak_flops()` swaps TRL's lookup while the parent is built; `FileWeightTransfer` as the default `weight_transfer` (`dppo_trl.backends.cpu.async_cpu`) | async-4 |
| `_rollout_logprobs()`: log-probs per token the rollout worker asks the server for | TRL's own worker is replaced before it starts by `TopKRolloutWorker`, TRL's worker running `TopKRolloutLoop`, a subclass of its private loop that asks for the lists and hands them on with each sample (the data side, `rows_topk` and `behavior_topk`, is in `async_topk.py`) | async-5 |
| the tree attention a subclass chose (`tree_attention_choice`), in every forward and backward | registered under TRL's `tree_fa3` name while `training_step` (whose backward reruns the forward under gradient checkpointing) and `compute_loss` run, then TRL's registration put back (`dppo_trl.backends.tree_attention.registered_tree_attention`) | async-6 |
| each turn fitted to the server's context (a turn with no room ends its conversation) | `ContextFitRolloutLoop` (`async_context.py`), a subclass of TRL's private rollout loop restating its `_generate_one` with the check, and the base of `TopKRolloutLoop`, run by the same worker swap | async-7 |
| LoRA weights merged out of place, gathered one decoder layer at a time, in every merged-weight sync | `_sync_weight_merged` restated without its in-place `merge_adapter()` / `unmerge_adapter()`, streaming `dppo_trl.weights.stream.merged_named_weights` (the names, dtypes and shapes of TRL's manifest) | async-8 |
| `forward.hidden`: the final hidden states the fused head projects | a forward hook on the backbone inside `KeepForwardOutputs` (`common.final_hidden_states`) | kept |
| the hardening in `train`, `_save_checkpoint`, `create_model_card` | `common.CommonRoom` (ordinary overrides) | kept |

A subclass implements `_per_token_policy_loss` and may override the other hooks. `tests/integration/test_async_dppo.py`
pins the normalisation against TRL's real loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from accelerate.utils import broadcast_object_list, is_peft_model
from torch import Tensor
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
from trl.experimental.async_grpo.async_rollout_worker import (
    AsyncRolloutWorker,
    RolloutSample,
    TurnRecord,
)
from trl.experimental.async_grpo.vllm_client import VLLMClient

from dppo_trl.backends.cpu.async_cpu import FileWeightTransfer, cpu_peak_flops
from dppo_trl.backends.tree_attention import TreeAttentionChoice, registered_tree_attention
from dppo_trl.trainers.trl116 import PARENT_CLIP_METRICS
from dppo_trl.trainers.trl116.async_context import ContextFitRolloutLoop, ContextFitRolloutWorker, _current_task
from dppo_trl.trainers.trl116.async_topk import (
    BEHAVIOR_TOPK_IDS,
    BEHAVIOR_TOPK_LOGPS,
    TopKRolloutSample,
    TopKTrainingSequence,
    behavior_topk,
    completion_topk,
    rows_topk,
)
from dppo_trl.trainers.trl116.common import CommonRoom, PolicyForward, PolicyTerms, final_hidden_states
from dppo_trl.weights.stream import in_place_fallback_message, merged_named_weights, out_of_place_problems

# Batch key: the policy version that sampled each packed sample of a row, `(rows, max samples per row)` in the order
# `segment_id` numbers a row's samples, −1 padded.
SAMPLE_VERSION = "dppo_sample_version"

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# async-1: the sampling version, from the queue to the batch
# ----------------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------------
# async-2: the one forward of TRL's loss, kept
# ----------------------------------------------------------------------------------------------------------------
class KeepForwardOutputs:
    """The model as `AsyncGRPOTrainer.compute_loss` calls it, keeping the outputs of that one call (TRL's fused LM head:
    per-position `log_probs` and `entropy`, with their graph). TRL 1.16's `compute_loss` returns only the loss.

    With `hidden_of` (the unwrapped model), also keeps the final hidden states of its backbone (`hidden`, `(1, N, H)`),
    with their graph.
    """

    def __init__(self, model: Any, hidden_of: Any | None = None):
        self.model = model
        self.hidden_of = hidden_of
        self.outputs: Any = None
        self.hidden: torch.Tensor | None = None

    def __call__(self, *args, **kwargs):
        if self.outputs is not None:
            raise RuntimeError(
                "AsyncGRPOTrainer.compute_loss called the model twice; AsyncDPPOTrainer expects one forward per loss "
                "call (see tests/trl_contract.py)."
            )
        capture: contextlib.AbstractContextManager[list[Tensor]] = (
            final_hidden_states(self.hidden_of) if self.hidden_of is not None else contextlib.nullcontext([])
        )
        with capture as hiddens:
            self.outputs = self.model(*args, **kwargs)
        if hiddens:
            self.hidden = hiddens[-1]
        return self.outputs


# ----------------------------------------------------------------------------------------------------------------
# async-5: the rollout loop that asks the server for μ's lists (a subclass of TRL's private loop)
# ----------------------------------------------------------------------------------------------------------------
class TopKRolloutLoop(ContextFitRolloutLoop):
    """TRL's rollout loop (runs in the worker's child process) that also asks the server for μ's top-K and hands it
    on with each sample (`TopKRolloutSample`). Turns are fitted to the server's context as in
    `ContextFitRolloutLoop`; everything else — tools, environments, re-rendering, rewards, advantages — is TRL's."""

    def __init__(self, *, logprobs_top_k: int, **kwargs: Any):
        super().__init__(**kwargs)
        if logprobs_top_k < 1:
            raise ValueError(f"logprobs_top_k must be >= 1, got {logprobs_top_k}.")
        self.logprobs_top_k = logprobs_top_k
        # The turns (TurnRecord, top-K) of each conversation being rolled out, by the asyncio task that runs it:
        # TRL runs one `_generate_one` per task, and its completions requests are awaited inside that task.
        self._turns_by_task: dict[asyncio.Task, list[tuple[TurnRecord, tuple[np.ndarray, np.ndarray]]]] = {}

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        if path != "/v1/completions":
            return await super()._post(path, payload, timeout, max_retries)
        turns = self._turns_by_task.get(_current_task())
        if turns is None:
            raise RuntimeError("TopKRolloutLoop samples only inside `_generate_one` (one conversation per task).")
        payload = {**payload, "logprobs": self.logprobs_top_k, "return_tokens_as_token_ids": True}
        content = await super()._post(path, payload, timeout, max_retries)
        choice = content["choices"][0]
        topk = completion_topk(choice, self.logprobs_top_k)
        turns.append((TurnRecord(list(payload["prompt"]), list(choice["token_ids"])), topk))
        return content

    async def _generate_one(self, prompt, tool_dict, tools, group_id=0):
        task = _current_task()
        turns = self._turns_by_task[task] = []
        try:
            completion, completion_ids, rows, *rest = await super()._generate_one(prompt, tool_dict, tools, group_id)
        finally:
            del self._turns_by_task[task]
        return (completion, completion_ids, rows_topk(turns, rows, self._fork_threshold_tokens), *rest)

    async def _score_group(self, group) -> list[RolloutSample]:
        samples = await super()._score_group(group)
        rows = [row for conversation in group.completions_sequences for row in conversation]
        if len(rows) != len(samples) or any(
            not isinstance(row, TopKTrainingSequence) or not np.array_equal(row.input_ids, s.input_ids)
            for row, s in zip(rows, samples)
        ):
            raise RuntimeError("TRL's scored samples no longer follow its training rows one to one.")
        return [
            TopKRolloutSample(
                **{f.name: getattr(s, f.name) for f in dataclasses.fields(RolloutSample)},
                topk_ids=row.topk_ids,
                topk_logps=row.topk_logps,
            )
            for s, row in zip(samples, rows)
        ]


class TopKRolloutWorker(AsyncRolloutWorker):
    """TRL's rollout worker running `TopKRolloutLoop` (pass `logprobs_top_k=K` with TRL's worker arguments)."""

    _loop_cls = TopKRolloutLoop

    @classmethod
    def like(cls, worker: AsyncRolloutWorker, logprobs_top_k: int) -> TopKRolloutWorker:
        """A not-yet-started worker with `worker`'s arguments (those `AsyncGRPOTrainer` built it with) plus K."""
        return cls(**worker._loop_kwargs, logprobs_top_k=logprobs_top_k)


def runs_on_cpu(args: AsyncGRPOConfig | None) -> bool:
    """Whether an asynchronous trainer with these `args` trains on the CPU (`use_cpu`, or no CUDA device)."""
    return bool(getattr(args, "use_cpu", False)) or not torch.cuda.is_available()


def async_grpo_arguments(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """`AsyncGRPOTrainer(*args, **kwargs)`'s constructor arguments by parameter name."""
    bound = inspect.signature(AsyncGRPOTrainer.__init__).bind(None, *args, **kwargs)
    return {name: value for name, value in bound.arguments.items() if name != "self"}


class HookedAsyncGRPOTrainer(CommonRoom, AsyncGRPOTrainer):
    """`AsyncGRPOTrainer` 1.16 with the hooks of docs/upstream.md ("AsyncGRPOTrainer"); see the module docstring.
    Takes `AsyncGRPOTrainer`'s arguments."""

    # Set by `AsyncGRPOTrainer.__init__`: on the main process the rollout worker (built or passed in) and its queue.
    rollout_worker: Any
    rollout_queue: Any

    # async-6: the tree attention registered under TRL's name; `None` keeps TRL's FA3 registration.
    tree_attention_choice: TreeAttentionChoice | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        arguments = async_grpo_arguments(*args, **kwargs)
        config = arguments.get("args")
        on_cpu = runs_on_cpu(config)
        if on_cpu and config is not None and arguments.get("weight_transfer") is None:
            # async-4: the weights reach `python -m dppo_trl.backends.cpu.vllm_server` through a file.
            arguments["weight_transfer"] = FileWeightTransfer(
                VLLMClient(config.vllm_server_base_url, config.vllm_server_timeout), config.weight_sync_timeout
            )
        with cpu_peak_flops() if on_cpu else contextlib.nullcontext():  # async-4: TRL's lookup needs CUDA
            super().__init__(**arguments)
        logprobs = self._rollout_logprobs()
        if type(self.rollout_worker) is AsyncRolloutWorker:
            # async-5 and async-7: TRL built its own worker (none was passed) and starts it on train begin: run the
            # same worker with the loop that fits each turn to the server's context (`async_context`) and, when the
            # loss reads μ's lists, also asks for them. A worker passed in must do both itself.
            if logprobs is not None:
                self.rollout_worker = TopKRolloutWorker.like(self.rollout_worker, logprobs)
            else:
                self.rollout_worker = ContextFitRolloutWorker.like(self.rollout_worker)
            self.rollout_queue = self.rollout_worker.rollout_buffer
        # async-3: (trainer state, optimizer step, version) of the last `_policy_version()` read on several processes.
        self._policy_version_read: tuple[Any, int, int] | None = None
        # async-8: a LoRA model's merged-weight syncs merge out of place.
        self._merges_lora_out_of_place = self._lora_merges_out_of_place()

    # ------------------------------------------------------------------------------------------------------------
    # The hooks a subclass implements or overrides
    # ------------------------------------------------------------------------------------------------------------
    def _per_token_policy_loss(self, inputs: dict[str, Any], forward: PolicyForward) -> PolicyTerms:
        """The per-token policy loss of the loss terms, normalised as TRL normalises its own (upstream async-2)."""
        raise NotImplementedError

    def _wants_hidden_states(self, inputs: dict[str, Any]) -> bool:
        """Whether this loss call's `PolicyForward` carries the final hidden states."""
        return False

    def _rollout_logprobs(self) -> int | None:
        """Log-probs per token the rollout worker asks the server for, carried to the batch (upstream async-5);
        `None`: the sampled token's only (TRL's worker)."""
        return None

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

    # ------------------------------------------------------------------------------------------------------------
    # The hardening's parent-specific parts (`CommonRoom`)
    # ------------------------------------------------------------------------------------------------------------
    def _watched_server(self) -> tuple[str | None, str]:
        bound = (
            "A dead server is noticed at the next weight sync, or once the rollout queue runs dry (TRL's worker gives "
            "up after its request retries); a silent one after the worker's request_timeout="
            f"{self.args.request_timeout} s or heartbeat_stale_after_s={self.args.heartbeat_stale_after_s} s."
        )
        return self.args.vllm_server_base_url, bound

    # ------------------------------------------------------------------------------------------------------------
    # async-1 and async-2: the restated dataloader and the loss around TRL's
    # ------------------------------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """`AsyncGRPOTrainer.get_train_dataloader` of TRL 1.16 with two arguments changed (restated TRL code): the queue dataset reads the
        rollout queue through `SampleVersionQueue`, and the collator is `SampleVersionCollator`. TRL builds its
        collator inline, so there is no narrower seam; the contract test fails when TRL's method changes."""
        # restates-trl: begin AsyncGRPOTrainer.get_train_dataloader
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
        # restates-trl: end

    # ------------------------------------------------------------------------------------------------------------
    # async-8: the merged-weight sync without TRL's in-place merge
    # ------------------------------------------------------------------------------------------------------------
    def _lora_merges_out_of_place(self) -> bool:
        """Whether `_sync_weight_merged` streams a LoRA model merged out of place (`dppo_trl.weights.stream`); a model
        the walk cannot merge keeps TRL's in-place merge, with a warning."""
        model = self.accelerator.unwrap_model(self.model)
        if not is_peft_model(model):
            return False
        fsdp_plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        problems = out_of_place_problems(model, getattr(fsdp_plugin, "fsdp_version", None))
        if problems:
            logger.warning(in_place_fallback_message(problems))
        return not problems

    def _merged_weights(self, model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
        """What `_streaming_iter` yields (the parameters of TRL's manifest, `_iter_vllm_named_params`, on the
        trainer's device), LoRA-adapted ones merged out of place."""
        return merged_named_weights(model, self.accelerator.device)

    def _sync_weight_merged(self, t0: float) -> tuple[float, float, float]:
        """TRL's merged-weight sync; for a LoRA model without its in-place `merge_adapter()` / `unmerge_adapter()`,
        which in bf16 does not give the frozen base back: the stream merges out of place instead, one decoder layer
        gathered at a time (`_sync_weight_merged_out_of_place`)."""
        if not self._merges_lora_out_of_place:
            return super()._sync_weight_merged(t0)
        return self._sync_weight_merged_out_of_place(t0)

    def _sync_weight_merged_out_of_place(self, t0: float) -> tuple[float, float, float]:
        """`AsyncGRPOTrainer._sync_weight_merged` of TRL 1.16 (restated TRL code) without the in-place merge and
        unmerge, streaming `_merged_weights(model)` instead of `_streaming_iter()`; a contract test checks that the
        rest is TRL's code token for token (tests/trl_contract.py, `ASYNC_SYNC_MERGED_EDITS`)."""
        # restates-trl: begin AsyncGRPOTrainer._sync_weight_merged
        model = self.accelerator.unwrap_model(self.model)

        logger.info("Weight sync: pausing vLLM...")
        if self.accelerator.is_main_process and self.weight_transfer:
            self.weight_transfer.pause()
        t_pause = time.time()
        logger.info(f"Weight sync: pause took {t_pause - t0:.1f}s, waiting for all ranks...")

        self.accelerator.wait_for_everyone()
        t_barrier = time.time()

        logger.info(f"Weight sync: transferring weights... (barrier took {t_barrier - t_pause:.1f}s)")
        if self.accelerator.is_main_process and self.weight_transfer:
            self.weight_transfer.send_weights(self._merged_weights(model))
        else:
            for _ in self._merged_weights(model):
                pass
        t_transfer = time.time()

        self.accelerator.wait_for_everyone()

        logger.info(f"Weight sync: resuming vLLM... (transfer took {t_transfer - t_barrier:.1f}s)")
        if self.accelerator.is_main_process:
            if self.weight_transfer:
                self.weight_transfer.resume()
            self.model_version += 1
            if self.rollout_worker:
                self.rollout_worker.update_model_version(self.model_version)
        return t_pause, t_barrier, t_transfer
        # restates-trl: end

    def _tree_attention_registered(self) -> contextlib.AbstractContextManager:
        """TRL's tree-attention name bound to the chosen function while a forward or backward runs (TRL's own FA3
        registration stays when FA3 was chosen, or nothing was)."""
        choice = self.tree_attention_choice
        function = choice.function if choice is not None else None
        return registered_tree_attention(function) if function is not None else contextlib.nullcontext()

    def training_step(self, model, inputs, num_items_in_batch):
        """TRL's step with the chosen tree attention registered through the backward too: under gradient
        checkpointing the backward reruns each layer's forward, which looks the attention function up again."""
        with self._tree_attention_registered():
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss on the batch with zeroed advantages (its forward, aux loss, metrics, accounting), plus the
        subclass's per-token policy loss on that forward's log-probs, scaled as TRL scales its own."""
        want_hidden = self._wants_hidden_states(inputs)
        forward = KeepForwardOutputs(model, self.accelerator.unwrap_model(model) if want_hidden else None)
        trl_inputs = {**inputs, "advantages": torch.zeros_like(inputs["advantages"])}
        with self._tree_attention_registered():
            trl_loss = super().compute_loss(forward, trl_inputs, return_outputs, num_items_in_batch)
        sink = self._metric_sink("train")
        for key in PARENT_CLIP_METRICS:
            sink.pop(key, None)
        terms = self._per_token_policy_loss(inputs, self._policy_forward(inputs, forward))
        per_token = terms.policy if terms.extra is None else terms.policy + terms.extra
        # restates-trl: begin AsyncGRPOTrainer.compute_loss (the normalisation of the policy term)
        tokens_per_rank = (inputs["global_n_tokens"][0] / self.accelerator.num_processes).clamp(min=1.0)
        return trl_loss + per_token.sum() / tokens_per_rank.float() / self.current_gradient_accumulation_steps
        # restates-trl: end

    def _policy_forward(self, inputs: dict[str, Any], forward: KeepForwardOutputs) -> PolicyForward:
        """The loss terms of one packed row as TRL selects them, with their sampling versions and staleness."""
        selected = inputs["token_index"] >= 0
        token_index = inputs["token_index"][selected]
        outputs = forward.outputs
        entropy = getattr(outputs, "entropy", None)
        model_version = staleness = None
        if SAMPLE_VERSION in inputs:
            versions = inputs[SAMPLE_VERSION].reshape(-1, inputs[SAMPLE_VERSION].shape[-1])[0]  # this rank's row
            model_version = versions[inputs["segment_id"][selected]]
            staleness = (self._policy_version() - model_version).clamp(min=0)
        hidden = forward.hidden
        old_log_probs = inputs["old_log_probs"][selected]
        return PolicyForward(
            log_probs=outputs.log_probs.flatten()[token_index],
            old_log_probs=old_log_probs,
            advantages=inputs["advantages"][selected],
            tokens=torch.ones_like(old_log_probs, dtype=torch.bool),
            entropy=entropy.flatten()[token_index] if entropy is not None else None,
            hidden=None if hidden is None else hidden.reshape(-1, hidden.shape[-1])[token_index],
            model_version=model_version,
            staleness=staleness,
            selected=selected,
        )
