"""Every TRL internal dppo-trl relies on, in one place.

`tests/meta/test_trl_contract.py` checks each entry against the installed TRL, so an upgrade that renames, re-signs or
re-shapes one of them fails loudly instead of silently turning DPPO into something else. Behavioral parts of the
contract (the gradient DPPOTrainer obtains through GRPOTrainer's loss, the keys of the generation batch, batch-major
keys surviving TRL's shuffle/split) are covered by `tests/integration/test_loss_gradient.py` and `tests/test_trainer_*.py`.
"""

from __future__ import annotations

TESTED_TRL_RANGE = (">=1.16.0", "<1.17")

# GRPOTrainer methods the sync room (`dppo_trl/trainers/trl116/grpo.py`) overrides (wrappers calling super()), with
# the leading parameters it names (the rest pass through `*args`, `**kwargs`). Removed by: the hooks in docs/upstream.md
# for the loss seams; the others are ordinary overrides.
OVERRIDDEN_METHODS: dict[str, tuple[str, ...]] = {
    "_generate_and_score_completions": ("self", "inputs"),
    "_get_per_token_logps_and_entropies": ("self", "model", "input_ids", "attention_mask", "logits_to_keep"),
    "_compute_loss": ("self", "model", "inputs"),
    # Marks the span in which a turn with no room left in the engine's context ends its rollout instead of raising
    # (`dppo_trl/trainers/trl116/context_fit.py`). Removed by: a per-turn context check in TRL's tool loop that asks the
    # backend for its context length (docs/upstream.md, "Context length in the tool loop").
    "_tool_call_loop": ("self",),
}

# The methods both rooms override for the hardening (dppo_trl/hardening/: staged checkpoints, preemption and
# server-failure exits, model-card provenance), once, in their common base `dppo_trl.trainers.trl116.common.CommonRoom`,
# with the same parameters on GRPOTrainer and AsyncGRPOTrainer (`train` and `create_model_card` are
# transformers'/TRL's base methods on both). Ordinary overrides calling `super()`.
HARDENING_OVERRIDDEN_METHODS: dict[str, tuple[str, ...]] = {
    "create_model_card": ("self", "model_name", "dataset_name", "tags"),
    "_save_checkpoint": ("self", "model", "trial"),
    "train": ("self",),
}

# Trainer attributes the sync room reads after `GRPOTrainer.__init__` (everything else it reads from the public config,
# `self.args`): the two masks it restates on the subclass's policy term, TRL's metric sink, and transformers'
# accumulation counter the aggregation scales by.
TRAINER_ATTRIBUTES = (
    "off_policy_mask_threshold",
    "_metrics",
    "current_gradient_accumulation_steps",
    "top_entropy_quantile",
)
VLLM_TRAINER_ATTRIBUTES = ("vllm_generation",)

# Source fragments of GRPOTrainer._compute_loss the sync room's loss composition depends on
# (`HookedGRPOTrainer._compute_loss`, dppo_trl/trainers/trl116/grpo.py): TRL's loss runs with zeroed advantages and the
# subclass's per-token policy loss is added after it, under TRL's masks and aggregation.
COMPUTE_LOSS_FRAGMENTS = (
    # One policy pass per call (the test counts it), whose π, entropies and hidden states the room keeps.
    "per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(",
    # The supported loss types' surrogate is linear in A: zeroed advantages give value 0 and gradient 0.
    "per_token_loss1 = coef_1 * advantages",
    "per_token_loss2 = coef_2 * advantages",
    # μ is read from here for the bias-corrected β-KL (`per_token_kl * coef_1`).
    'inputs.get("old_per_token_logps")',
    # The loss tokens and the masks the room restates on the subclass's term, with TRL's arguments.
    'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]',
    "if advantages.dim() == 1:",
    "per_token_logps.detach() if old_per_token_logps is None",
    'sampling_per_token_logps = inputs.get("sampling_per_token_logps", old_per_token_logps)',
    "if self.off_policy_mask_threshold is not None:",
    "self.get_off_policy_mask(",
    "per_token_loss = per_token_loss * off_policy_mask",
    "entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)",
    "per_token_loss = per_token_loss * entropy_mask",
    'if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":',
    'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]',
    # What TRL logs about its policy term, dropped with it: the clip rates and, with the entropy bonus, this.
    'self._metrics[mode]["policy_loss"]',
)
# GRPOTrainer's aggregation of the policy term, which `dppo_trl.trainers.trl116.grpo.aggregate_per_token_loss` reproduces for
# the subclass's terms (behaviourally pinned by tests/integration/test_mu_kl.py with one process; these pin the
# multi-process scaling too).
LOSS_AGGREGATION_FRAGMENTS = (
    "loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()",
    "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)",
    "loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)",
    'normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes',
    "normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation",
    # `loss_type="luspo"`: whatever per-token term it gets, summed over each completion, averaged over completions
    # (`dppo_trl/trainers/config.py`, SUPPORTED_LOSS_TYPES).
    "loss = (per_token_loss * mask).sum(-1).mean()",
    'normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0',
)
# `_get_per_token_logps_and_entropies` returns `(logps, entropies, aux_loss)`.
PER_TOKEN_LOGPS_ARITY = 3
# It calls the model with the fused LM head, whose backbone output the sync room hooks for the final hidden states. The
# head computes an MoE model's router aux loss from the router logits the backbone records, not in a model forward
# that Liger could replace: why `use_liger_kernel` keeps the aux loss (docs/api.md).
PER_TOKEN_LOGPS_FRAGMENTS = ("fused_lm_head=True", "outputs.log_probs[:, -logits_to_keep:]")
FUSED_HEAD_FRAGMENTS = (
    'backbone_attr = "base_model"',
    "backbone_outputs.last_hidden_state[:, :-1]",
    "lm_head = self.get_output_embeddings()",
    "backbone_outputs.router_logits, num_experts, num_experts_per_tok",
)

# Keys of the generation batch the sync room and DPPOTrainer read.
GENERATION_OUTPUT_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
GENERATION_OPTIONAL_KEYS = ("sampling_per_token_logps", "old_per_token_logps", "tool_mask", "num_items_in_batch")

# vLLM backend: `VLLMGeneration.generate` returns a 4-tuple and reads `self.logprobs` at call time; the parent keeps
# entry 0 of each token's list as the sampled-token log-prob (the "lp[0] trap" the top-K capture works around).
VLLM_GENERATE_PARAMS = ("self", "prompts", "images", "num_generations", "profiler")
VLLM_GENERATE_FRAGMENTS = (
    '"logprobs": self.logprobs',
    "return prompt_ids, completion_ids, logprobs, logprob_token_ids",
    # Truncated sampling: `generation_kwargs` override the config's top_k/top_p/min_p, which
    # `dppo_trl.trainers.config.sampling_truncation` reads in the same order.
    "generation_kwargs.update(self.generation_kwargs)",
)
# The colocate engine's log-probs are vLLM's processed ones: computed after top-k/top-p/min-p, so a dropped token is
# `-inf` in the lists and the finite entries are the sampler's kept set (dppo_trl/trainers/kept_set.py). Removed by:
# nothing in TRL; vLLM's `return_sampling_mask` (GPU, Model Runner V2) would make the lists unnecessary.
VLLM_COLOCATE_LOGPROBS_MODE = 'logprobs_mode="processed_logprobs"'
GENERATE_SINGLE_TURN_FRAGMENTS = (
    "_, completion_ids, logprobs, _ = self.vllm_generation.generate(",
    "logprobs = [[lp[0] for lp in seq] for seq in logprobs]",
)
# The weight-sync check (dppo_trl/trainers/sync_check.py): GRPOTrainer loads the trainer's weights into the engine
# before a generation whenever the optimizer step changed, and records that step in `_last_loaded_step` (set in its
# `__init__`), on every process; the sync room puts it on each generation batch (`WEIGHTS_STEP`), so that DPPOTrainer
# counts as fresh only the loss calls of the optimizer step whose weights sampled it. Checked in `_generate_single_turn`
# and in `_generate` (the `rollout_func` path). Removed by: the generation batch carrying the step of the weights
# that sampled it (docs/upstream.md, "The step of the weights that sampled a generation batch").
WEIGHT_SYNC_ATTRIBUTE = "_last_loaded_step"
WEIGHT_SYNC_FRAGMENTS = (
    "self.state.global_step != self._last_loaded_step:",
    "self.vllm_generation.sync_weights()",
    "self._last_loaded_step = self.state.global_step",
)
# Engine lists with tools (`dppo_trl/trainers/trl116/vllm_topk.py`, `place_turns`): every generate call returns one prompt per
# completion, as the engine saw it (colocate: `n=1` per request; server: unique prompts expanded back), and the tool
# loop builds a later turn's prompt by concatenation, regenerates the rows that called a tool in increasing row order,
# cuts the last turn by prefix slicing, and splices the tool-result tokens with `tool_mask` 0. Together these let the
# capture find where each call's sampled tokens sit in the final completion. Removed by: a per-call engine-extras hook
# in the tool loop (docs/upstream.md, "Per-turn engine extras in the tool loop").
VLLM_GENERATE_PROMPT_FRAGMENTS = (
    "all_prompt_ids = [output.prompt_token_ids for output in all_outputs]",
    "all_prompt_ids = [ids for ids in all_prompt_ids for _ in range(num_generations)]",
)
TOOL_LOOP_FRAGMENTS = (
    "prompt_ids[idx_with_tool] + completion_ids[idx_with_tool] + suffix_ids",
    "post_tool_ids, post_tool_logprobs = self._generate_single_turn(",
    "post_tool_ids[idx] = post_tool_ids[idx][:new_len]",
    "tool_mask[idx_with_tool] += [0] * tool_length + [1] * post_tool_length",
    "completion_ids[idx_with_tool] = pct[prompt_length:] + post_tool_ids[idx]",
    "idxs_with_tool = [idx for idx, tool_call in zip(idxs_with_tool, tool_calls, strict=True) if tool_call]",
)
# Context fit (`dppo_trl/trainers/trl116/context_fit.py`). TRL asks every turn for `max_completion_length` tokens through
# one request (server: `VLLMClient.generate(prompts=..., max_tokens=..., generation_kwargs=...)` by keyword, on the
# main process; colocate: one `SamplingParams` for token-id prompts), which the fit replaces per prompt. Its tool loop
# drops a tool result when `len(pct) >= max_model_len`, reading the colocated engine's context but, in server mode,
# the model config's `max_position_embeddings` (not the server's `--max-model-len`), so only in server mode can a
# turn with no room reach the fit; an empty post-tool turn is handled as a turn cut to nothing (`{}`, no tool call).
# Removed by: the tool loop fitting `max_tokens` to the backend's context itself (docs/upstream.md, "Context length in
# the tool loop").
VLLM_GENERATE_CONTEXT_FRAGMENTS = (
    '"max_tokens": max_completion_length,',
    "prompts=ordered_set_of_prompt_ids, features=features, **sampling_params",
    '"generation_kwargs": self.generation_kwargs,',
    'vllm_prompts = [{"prompt_token_ids": ids} for ids in all_prompts]',
    "self.llm.generate(vllm_prompts, sampling_params=sampling_params, use_tqdm=False)",
)
TOOL_LOOP_CONTEXT_FRAGMENTS = (
    "max_model_len = self.vllm_generation.llm.llm_engine.model_config.max_model_len",
    "max_model_len = config.max_position_embeddings",
    "or len(pct) >= max_model_len",
    "if post_tool_completions[idx]:",
    "else {}",
)

# Helpers imported from `trl.trainer.utils`.
UTILS = ("maybe_gather_lm_head_ctx", "add_fused_lm_head", "shuffle_sequence_dict", "split_tensor_dict")

# Checkpoints (dppo_trl/hardening/checkpoints.py): transformers' `_save_checkpoint` writes every file under
# `self._get_output_dir(trial=trial)` (which `staged_checkpoint` points at a staging folder) and rotates there;
# GRPOTrainer's and AsyncGRPOTrainer's overrides write their extra state (AsyncGRPOTrainer: `rollout_state.json`)
# through the same call, then call the parent's.
TRAINER_SAVE_CHECKPOINT_FRAGMENTS = (
    "run_dir = self._get_output_dir(trial=trial)",
    "output_dir = os.path.join(run_dir, checkpoint_folder)",
    "rotate_checkpoints(",
)
GRPO_SAVE_CHECKPOINT_FRAGMENTS = ("super()._save_checkpoint(model, trial)", "self._get_output_dir(trial=trial)")
# Generation cycles: `_prepare_inputs` regenerates every `steps_per_generation * num_iterations` `training_step`
# calls, counted by `self._step`, which a resume restarts at 0 with an empty buffer.
PREPARE_INPUTS_FRAGMENTS = (
    "generate_every = self.args.steps_per_generation * self.num_iterations",
    "if self._step % generate_every == 0 or self._buffered_inputs is None:",
)
# Model card (dppo_trl/hardening/model_card.py rewrites these parts of TRL's template).
MODEL_CARD_TEMPLATE_FRAGMENTS = (
    "This model is a fine-tuned version of",
    "## Quick start",
    "## Training procedure",
    "### Framework versions\n\n- TRL:",
)
# vLLM server mode on a CPU trainer (`dppo_trl/backends/cpu/server_client.py`, `dppo_trl/backends/cpu/vllm_server.py`). `_init_vllm` builds its
# client through the module-level name `VLLMClient` (which DPPO swaps for a subclass), then calls `init_communicator`
# with the trainer's device; `sync_weights` streams TRL's own parameter iterator into `update_named_params` on rank 0
# (every rank iterates) and resets the prefix cache afterwards.
VLLM_GENERATION_CLIENT_SYMBOL = "VLLMClient"
VLLM_INIT_SERVER_FRAGMENTS = (
    "self.vllm_client = VLLMClient(",
    "self.vllm_client.init_communicator(device=accelerator.device)",
)
VLLM_SERVER_SYNC_FRAGMENTS = (
    "self.vllm_client.update_named_params(self._weight_metadata, self._iter_named_params())",
    "for _ in self._iter_named_params():",
    "self.vllm_client.reset_prefix_cache()",
)
# LoRA weights merged out of place (`dppo_trl/trainers/trl116/grpo.py`, `merge_lora_out_of_place`): every sync reads
# `VLLMGeneration._iter_named_params()` (colocate here; server and its manifest in VLLM_SERVER_SYNC_FRAGMENTS; the CPU
# syncs call it themselves), which the room replaces on the trainer's instance with `dppo_trl.weights.stream`'s walk.
# Its names, dtypes and shapes are compared with TRL's own walk by tests/meta/test_trl_contract.py. → an out-of-place,
# layer-by-layer merge in TRL's walk (docs/upstream.md, "GRPOTrainer" item 7).
VLLM_COLOCATE_SYNC_FRAGMENT = "for name, param in self._iter_named_params():"
# `VLLMClient` methods the subclass overrides or calls, with their leading parameters. `check_server` is the first call
# `__init__` makes after creating `self.session`, which every later request goes through (the API key is set there).
VLLM_CLIENT_METHODS: dict[str, tuple[str, ...]] = {
    "check_server": ("self", "total_timeout", "retry_interval"),
    "init_communicator": ("self", "device"),
    "update_named_params": ("self", "metadata", "named_params"),
    "get_server_info": ("self",),
    "_post": ("self", "url"),
}
VLLM_CLIENT_INIT_FRAGMENTS = ("self.session = requests.Session()", "self.check_server(connection_timeout)")
# vLLM: the server module the launcher runs, the development endpoint and the worker method the sync calls (its
# `weights_path` argument travels as a JSON string), and the routes `--api-key` guards (not the dev endpoints).
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_RPC_ROUTE_MODULE = "vllm.entrypoints.serve.dev.rpc.api_router"
VLLM_RELOAD_PARAMS = ("self", "weights_iterator", "weights_path", "is_checkpoint_format")
VLLM_API_KEY_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
# No π_old pass when μ comes from the engine (`DPPOTrainer._decline_old_pass`). `_parent_recomputes_old_logps`
# restates TRL's recompute condition; when it holds, the π_old pass is the first `_get_per_token_logps_and_entropies`
# call of `_generate_and_score_completions` and its result is unpacked into `old_per_token_logps` (None = no π_old, as
# in TRL's own else-branch). The other clause (vLLM IS correction) is off under `anchor="behavior"`.
# Removed by: `GRPOTrainer._needs_old_per_token_logps()` (docs/upstream.md).
OLD_LOGPS_RECOMPUTE_FRAGMENTS = (
    "generate_every = self.args.steps_per_generation * self.num_iterations",
    "if self.args.gradient_accumulation_steps % generate_every != 0 or (",
    "self.use_vllm and self.vllm_importance_sampling_correction",
    "old_per_token_logps = None",
)
OLD_LOGPS_PASS = "old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies("
# `use_liger_kernel`: GRPOTrainer.__init__ raises its own errors (an adapter on lm_head, Liger's fused cross-entropy)
# and transformers applies the kernels in `Trainer.train`, not in `__init__`; DPPOTrainer refuses a non-CUDA device in
# between (`DPPOTrainer._check_liger_device`). It forces Liger's fused cross-entropy off, so Liger never replaces the
# model's forward, where an MoE model's router aux loss would otherwise be computed (or dropped): with the router's
# logits kept, the aux loss survives Liger (docs/api.md; the fused head's side is in FUSED_HEAD_FRAGMENTS).
LIGER_GRPO_INIT_FRAGMENTS = (
    "Applying a PEFT adapter to `lm_head` is not supported",
    '`liger_kernel_config={"fused_linear_cross_entropy": True}` is not supported',
    'args.liger_kernel_config = {**liger_kernel_config, "fused_linear_cross_entropy": False}',
)
LIGER_APPLY_FRAGMENT = "apply_liger_kernel(self.model, self.args.liger_kernel_config)"
# The function that call reaches (transformers' trainer module imports it from here): the CUDA test of
# tests/integration/test_liger.py applies Liger through it with the trainer's config, as `train()` does.
LIGER_APPLY_FUNCTION = "transformers.integrations.liger.apply_liger_kernel"

# ---------------------------------------------------------------------------------------------------------------------
# TRL's experimental asynchronous trainer (`trl.experimental.async_grpo`), relied on by dppo_trl/trainers/async_dppo_trainer.py and
# dppo_trl/backends/cpu/async_cpu.py.
# ---------------------------------------------------------------------------------------------------------------------
ASYNC_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"
# Each entry: what AsyncDPPOTrainer relies on, why, and (→) the TRL change that removes it (docs/upstream.md).
# Behaviour, not source, pins the rest: tests/integration/test_async_dppo.py checks the gradient against TRL's real loss (the
# selection of loss terms, A = 0 silencing the surrogate, the normalisation) and runs TRL's real queue dataset, planner
# and collator (`metrics` passed through untouched, a row's samples in `segment_id` order).
#
# Overridden with `super()` (compute_loss, __init__) or restated (get_train_dataloader), with their parameters.
# → `get_train_dataloader` goes with a `_build_collator()` hook; `compute_loss` with `_per_token_policy_loss(...)`.
ASYNC_OVERRIDDEN_METHODS: dict[str, tuple[str, ...]] = {
    "__init__": (
        "self",
        "model",
        "reward_funcs",
        "args",
        "train_dataset",
        "processing_class",
        "callbacks",
        "optimizers",
        "peft_config",
        "tools",
        "environment_factory",
        "rollout_worker",
        "weight_transfer",
    ),
    "get_train_dataloader": ("self",),
    "compute_loss": ("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
    # The chosen tree attention stays registered through the backward, which reruns the forward under gradient
    # checkpointing (dppo_trl/backends/tree_attention.py). → a tree-attention choice in TRL's config.
    "training_step": ("self", "model", "inputs", "num_items_in_batch"),
    # A LoRA model's merged-weight sync, restated without its in-place merge (`ASYNC_SYNC_MERGED_EDITS`). → the
    # out-of-place walk in TRL's `_sync_weight_merged` (docs/upstream.md, "AsyncGRPOTrainer" item 8).
    "_sync_weight_merged": ("self", "t0"),
}
# `HookedAsyncGRPOTrainer._sync_weight_merged_out_of_place` is TRL's `_sync_weight_merged` (same tokens, comments aside)
# with exactly these edits (ours, TRL's): the in-place `merge_adapter()` before the stream and `unmerge_adapter()` in
# its `finally` are gone, and the stream is `dppo_trl.weights.stream`'s walk (twice: rank 0 sends, the others iterate).
ASYNC_SYNC_MERGED_EDITS = (
    ("", "if is_peft_model(model): model.merge_adapter() try:"),
    ("", "finally: if is_peft_model(model): model.unmerge_adapter()"),
    ("self._merged_weights(model)", "self._streaming_iter()"),
)
# The walk behind the manifest TRL's NCCL client sizes the server's buffers from (names, dtypes, shapes, in order),
# which the out-of-place stream must match element for element (compared in tests/meta/test_trl_contract.py).
ASYNC_WEIGHT_MANIFEST = "_iter_vllm_named_params"
# `AsyncDPPOTrainer.get_train_dataloader` is TRL's method (same tokens, comments aside) with exactly these
# replacements (ours, TRL's): the collator is built inline, so restating the method is the narrowest seam; a TRL change
# to the method fails the test until it is restated. → keep `model_version` in the batch, or a `_build_collator()`.
ASYNC_DATALOADER_REPLACEMENTS = (
    ("rollout_queue=SampleVersionQueue(self.rollout_queue),", "rollout_queue=self.rollout_queue,"),
    ("collate_fn=SampleVersionCollator(", "collate_fn=DataCollatorForRollout("),
)
# `compute_loss` calls the model once (`KeepForwardOutputs` keeps that call's outputs), reads π at the same
# positions as DPPO's term, is linear in the advantages (A = 0 silences its surrogate) and scales its policy term by
# tokens per process, then gradient accumulation (DPPO's term is scaled the same; the single-process test cannot see
# `world_size`). → `_per_token_policy_loss(log_probs, old_log_probs, advantages, inputs)`.
ASYNC_COMPUTE_LOSS_FRAGMENTS = (
    "outputs = model(",
    "log_probs = outputs.log_probs.flatten()[token_index]",
    "per_token_loss1 = coef_1 * advantages",
    "per_token_loss2 = coef_2 * advantages",
    "tokens_per_rank = (global_n_tokens / world_size).clamp(min=1.0)",
    "loss = loss / self.current_gradient_accumulation_steps",
)
# `RolloutSample` is a dataclass (`SampleVersionQueue` copies it with `dataclasses.replace`) with these fields.
# → keep `model_version` in the yielded sample dict.
ROLLOUT_SAMPLE_FIELDS = ("model_version", "metrics")
# Trainer attributes read in the loss: the policy version and the metric sink. → `model_version` in the batch would
# leave `_metrics` only (TRL's logging; DPPO's metrics would come back from `_per_token_policy_loss`).
ASYNC_TRAINER_ATTRIBUTES = ("model_version", "_metrics")
# The only AsyncGRPOTrainer methods that write `self.model_version`: none runs inside an optimizer step (the syncs run
# from callbacks at train begin and step end, the resume before training), so `_policy_version()` reads it once per
# step. The weight-sync check reads a changed version as "a sync published it since the last step", so the step it
# sees it at is the first after that sync. → a version in the batch (the trainer would not read it at all).
ASYNC_MODEL_VERSION_WRITERS = ("__init__", "_sync_weight_merged", "_sync_weight_lora", "_inner_training_loop")
# CPU paths: the peak-FLOPs helper the constructor calls through the module-level name; the tree-attention name and
# kwargs (dppo_trl.kernels.tree_attention.tree_attention_cpu implements the same contract); the weight-transfer protocol.
ASYNC_PEAK_FLOPS_SYMBOL = "get_peak_flops_per_device"
TREE_ATTENTION_NAME = "tree_fa3"
TREE_ATTENTION_PARAMS = (
    "tree_kv_index",
    "tree_cu_seqlens_q",
    "tree_cu_seqlens_k",
    "tree_max_seqlen_q",
    "tree_max_seqlen_k",
    "scaling",
    "sliding_window",
    "softcap",
)
# The tree-attention choice ("auto"/"fa3", dppo_trl/backends/tree_attention.py) loads TRL's kernel through TRL's own
# cached loader and runs TRL's `tree_attention` once before the model is built; `tree_attention` calls that loader, so
# the kernel that loaded is the one training uses. → a tree-attention choice in TRL's config, checked before the model
# is built.
TREE_ATTENTION_LOADER = "_flash_attn"
TREE_ATTENTION_LOADER_FRAGMENTS = ("_flash_attn().flash_attn_varlen_func(",)
WEIGHT_TRANSFER_METHODS = ("init_weight_transfer", "pause", "send_weights", "resume", "destroy")
# `VLLMClient` (async) methods `FileWeightTransfer` calls.
ASYNC_VLLM_CLIENT_METHODS = ("wait_for_server_ready", "get_server_info", "pause", "resume")

# Top-K in async (dppo_trl/trainers/trl116/async_grpo.py, dppo_trl/trainers/trl116/async_topk.py). TRL's worker asks for `"logprobs": 0`; `TopKRolloutLoop`
# subclasses the worker's loop and `TopKRolloutWorker` runs it through the worker's `_loop_cls`, built from the
# `_loop_kwargs` TRL built its worker with (TRL's own resume reads them too), swapped in before `train` starts it.
# → one `logprobs` option of the worker returning the entries in `TurnRecord` and `RolloutSample` (docs/upstream.md,
# "AsyncGRPOTrainer" item 5) removes every entry of this block.
ASYNC_WORKER_MODULE = "trl.experimental.async_grpo.async_rollout_worker"
# Overridden `_AsyncRolloutLoop` methods (all call `super()`), with their parameters.
ASYNC_LOOP_OVERRIDDEN_METHODS: dict[str, tuple[str, ...]] = {
    "_post": ("self", "path", "payload", "timeout", "max_retries"),  # adds `logprobs: K`, records the turn
    "_generate_one": ("self", "prompt", "tool_dict", "tools", "group_id"),  # places the lists in TRL's rows
    "_score_group": ("self", "group"),  # turns each sample into a `TopKRolloutSample`
}
# `_generate_one_turn` sends each turn's request through `self._post` inside the conversation's task, reading these;
# `_generate_one` is one asyncio task per conversation (the loop's is the context fit's restatement, checked token for
# token against TRL's: it reconciles the turns with `_chain_to_sequences` and returns the rows third); `_score_group`
# makes one sample per row, in `completions_sequences` order.
ASYNC_WORKER_FRAGMENTS = (
    'lambda: self._post("/v1/completions", payload, self.request_timeout)',
    '"prompt": prompt_ids,',
    'return choice["token_ids"], choice["logprobs"]["token_logprobs"]',
    "task = asyncio.create_task(",
    "self._generate_one(prompt, tool_dict=tool_dict, tools=tools, group_id=group_id)",
    "for seq in sequences:",
)
TURN_RECORD_FIELDS = ("prompt_ids", "output_ids", "output_log_probs", "output_mask")
TRAINING_SEQUENCE_FIELDS = ("input_ids", "completion_mask", "old_log_probs", "rollout_id")
# Truncated sampling in async: `AsyncDPPOConfig.kept_set_size` reads the config's top_k/top_p/min_p as what the server
# samples with, so the trainer must hand them to the worker and the worker put them in every completions request
# (its processed log-probs are then renormalised over the kept set the N-entry lists show).
# → the same `logprobs` option of the worker (docs/upstream.md, "AsyncGRPOTrainer" item 5) removes this pin too.
ASYNC_WORKER_SAMPLING_FRAGMENTS = ('"top_p": self.top_p,', '"top_k": self.top_k,', 'payload["min_p"] = self.min_p')
ASYNC_TRAINER_SAMPLING_FRAGMENTS = ("top_p=self.args.top_p,", "top_k=self.args.top_k,", "min_p=self.args.min_p,")
# Context fit in async (dppo_trl/trainers/trl116/async_context.py): `ContextFitRolloutLoop` (the base of `TopKRolloutLoop`)
# caps each completions request's `max_tokens` at the room left in the server's context (`_post`) and restates
# `_generate_one` with one edit: before each turn `_fits_context` counts it (clamped or ended) and, when it has no room,
# `break`s out of the turn loop as a finished conversation does. The worker sends `self.max_tokens` every turn, and
# retries an HTTP 400 as a transport error (`aiohttp.ClientError`), so a turn over the context stalls and then kills
# the worker. The loop's counters (`_counters`, summed when their name holds `total`) and its served model's name
# (`_request_model`, for `/v1/models`) are read. → the worker fitting `max_tokens` to the server's context and ending
# the conversation itself (docs/upstream.md, "AsyncGRPOTrainer" item 7) removes this block.
ASYNC_CONTEXT_LOOP_OVERRIDDEN_METHODS: dict[str, tuple[str, ...]] = {
    "_post": ("self", "path", "payload", "timeout", "max_retries"),
    "_generate_one": ("self", "prompt", "tool_dict", "tools", "group_id"),
}
ASYNC_CONTEXT_WORKER_FRAGMENTS = (
    '"max_tokens": self.max_tokens,',
    "_RETRYABLE_HTTP_ERRORS = (aiohttp.ClientError,",
)
# `ContextFitRolloutLoop._generate_one` is TRL's `_AsyncRolloutLoop._generate_one` (same tokens, comments aside) with
# exactly these edits (ours, TRL's).
ASYNC_GENERATE_ONE_EDITS = (
    (
        "if not await self._fits_context(prompt_ids, turns): break "
        "turn_ids, turn_logprobs = await self._generate_one_turn(prompt_ids)",
        "turn_ids, turn_logprobs = await self._generate_one_turn(prompt_ids)",
    ),
)
ASYNC_LOOP_ATTRIBUTES = ("_counters", "_request_model")
ASYNC_COUNTER_METRIC_FRAGMENT = 'if "total" in words:'
# The worker's class attribute naming its loop, and its stored constructor arguments.
ASYNC_WORKER_FRAGMENTS_CONTROLLER = ("_loop_cls:", "self._loop_kwargs = loop_kwargs", "self._loop_cls,")
# `AsyncGRPOTrainer.__init__` builds the worker and the queue it reads; the worker starts on train begin.
ASYNC_TRAINER_WORKER_FRAGMENTS = (
    "self.rollout_worker = AsyncRolloutWorker(",
    "self.rollout_queue = self.rollout_worker.rollout_buffer",
    "self._trainer.rollout_worker.start()",
)

# Faults (`dppo_trl/hardening/preemption.py`, `bound_server_requests`, `trainer_construction_patches`). transformers' SIGTERM
# support: `JITCheckpointCallback.jit_manager` (a `CheckpointManager`) writes a checkpoint through
# `execute_jit_checkpoint`, which calls the Trainer's `_save_checkpoint`. TRL's client mounts one retrying
# `HTTPAdapter` on its session and sends without a timeout. TRL's module symbols `LLM` and `VLLMClient` are read
# while `VLLMGeneration` is built; the colocate sync is reached as `self.vllm_generation.sync_weights()`.
JIT_CHECKPOINT_FRAGMENTS = (
    "self.jit_manager = CheckpointManager(trainer=trainer)",
    "self.jit_manager.execute_jit_checkpoint()",
    "self.trainer._save_checkpoint(self.trainer.model, trial=None)",
)
VLLM_CLIENT_RETRY_FRAGMENTS = ("HTTPAdapter(max_retries=retry_strategy", 'self.session.mount("http://", adapter)')
VLLM_SYNC_CALL_FRAGMENT = "self.vllm_generation.sync_weights()"

# ---------------------------------------------------------------------------------------------------------------------
# CPU runtime: the colocated engine's settings (`dppo_trl/backends/cpu/construction.py`, `engine.py`). Kept because
# TRL offers no argument for them (docs/upstream.md, "CPU runtime"): `_init_vllm` builds the engine through the
# module-level name `LLM` (swapped, while the trainer is built, for a factory adding `EngineOptions`), and its call
# passes none of the arguments the CPU engine needs, so the factory's defaults apply (if TRL ever passes one, the
# CPU default silently stops applying). `VLLMGeneration.__init__` takes no engine-kwargs parameter: when it gains
# one, the swap can go.
# ---------------------------------------------------------------------------------------------------------------------
VLLM_INIT_COLOCATE_FRAGMENTS = ("self.llm = LLM(",)
CPU_ENGINE_ARGUMENTS_TRL_DOES_NOT_PASS = ("dtype=", "kv_cache_memory_bytes=", "enforce_eager=")

# ---------------------------------------------------------------------------------------------------------------------
# The `dppo-trl` command (`dppo_trl/cli/`), driven like `trl grpo`: TRL's parser with its split of the options no
# dataclass knows (config file vs command line, as `trl/cli/commands/training.py` splits them before `accelerate
# launch`), the accelerate presets TRL ships as package data, `trl grpo`'s reward names (`trl.rewards`), and `trl
# vllm-serve`'s parser, fields and launcher (called as they are on a GPU, the fields mapped to the CPU server on
# CPU). Public parts of TRL's CLI, kept: a plug-in point in TRL's CLI would let `trl dppo` replace the command
# (docs/upstream.md, "A command-line plug-in point") but would still use them.
# ---------------------------------------------------------------------------------------------------------------------
CLI_PARSER_PARAMETERS = ("args", "return_remaining_strings", "fail_with_unknown_args", "separate_remaining_strings")
CLI_ACCELERATE_PRESETS = ("single_gpu", "multi_gpu", "zero1", "zero2", "zero3", "fsdp1", "fsdp2")
CLI_BUNDLED_REWARDS = (
    "accuracy_reward",
    "reasoning_accuracy_reward",
    "think_format_reward",
    "get_soft_overlong_punishment",
)
CLI_VLLM_SERVE_FIELDS = (
    "model",
    "revision",
    "tensor_parallel_size",
    "data_parallel_size",
    "host",
    "port",
    "gpu_memory_utilization",
    "dtype",
    "max_model_len",
    "enable_prefix_caching",
    "kv_cache_dtype",
    "trust_remote_code",
    "log_level",
    "vllm_model_impl",
    "distributed_executor_backend",
    "speculative_config",
)
CLI_VLLM_SERVE_FUNCTIONS = ("make_parser", "main")
