"""Which proposed TRL change (docs/upstream.md) would remove each pin of `tests/trl_contract.py`.

`REMOVED_BY` names, for every constant of the contract, the upstream hook that makes it unnecessary, or `KEPT` for a
dependency no proposed hook removes (an ordinary override of a public method, a batch key, TRL's checkpoint and
model-card plumbing the hardening builds on, a vLLM route). A constant whose entries part ways maps each entry (the
dict key, or the tuple element) separately. `tests/meta/test_contract_hooks.py` keeps this map complete and its hook
names equal to the headings of docs/upstream.md; `benchmarks/contract_size.py` counts the pins with it.
"""

from __future__ import annotations

KEPT = "kept"

# Hook id -> the heading of its section in docs/upstream.md (under "## GRPOTrainer", "## CPU runtime" or
# "## AsyncGRPOTrainer").
HOOKS = {
    "grpo-1": "1. A predicate for the π_old pass",
    "grpo-2": "2. A per-token policy-loss hook that receives the batch and the forward",
    "grpo-3": "3. The β-KL's importance weight against the sampling policy",
    "grpo-4": "4. An aggregation helper for extra per-token terms",
    "grpo-5": "5. Per-turn engine extras in the tool loop",
    "grpo-6": "6. Context length in the tool loop",
    "grpo-7": "7. LoRA weights merged out of place, one layer at a time",
    "grpo-8": "8. The step of the weights that sampled a generation batch",
    "cpu-1": "1. The colocated engine's arguments (`trl.generation.vllm_generation.LLM`)",
    "cpu-2": "2. The server client class (`trl.generation.vllm_generation.VLLMClient`)",
    "async-1": "1. Keep `model_version` in the sample dict and the batch",
    "async-2": "2. Split `compute_loss` into the forward and a per-token policy loss",
    "async-3": "3. Keep `model_version` on every rank",
    "async-4": "4. The peak-FLOPs lookup on a machine without CUDA",
    "async-5": "5. A `logprobs` option in the rollout worker, carried to the batch",
    "async-6": "6. A tree-attention choice, checked before the model is built",
    "async-7": "7. Context length in the rollout worker",
    "async-8": "8. The same out-of-place merge in `_sync_weight_merged`",
}

REMOVED_BY: dict[str, str | dict[str, str]] = {
    "OVERRIDDEN_METHODS": {
        "_generate_and_score_completions": KEPT,  # attaches μ's lists and the kept set to the batch
        "_get_per_token_logps_and_entropies": KEPT,  # the final hidden states for top-K, besides the declined pass
        "_compute_loss": "grpo-2",  # TRL's loss with zeroed advantages, plus the hook's term
        "_tool_call_loop": "grpo-6",
    },
    "HARDENING_OVERRIDDEN_METHODS": KEPT,
    "TRAINER_ATTRIBUTES": {
        "off_policy_mask_threshold": "grpo-2",
        "_metrics": KEPT,
        "current_gradient_accumulation_steps": "grpo-4",
        "top_entropy_quantile": "grpo-2",
    },
    "VLLM_TRAINER_ATTRIBUTES": KEPT,
    # The subclass's term runs outside TRL's policy chain: with the grpo-2 hook TRL would apply its own masks to it.
    "COMPUTE_LOSS_FRAGMENTS": {
        "per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(": "grpo-2",
        "per_token_loss1 = coef_1 * advantages": "grpo-2",
        "per_token_loss2 = coef_2 * advantages": "grpo-2",
        'inputs.get("old_per_token_logps")': "grpo-3",
        'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]': "grpo-2",
        "if advantages.dim() == 1:": "grpo-2",
        "per_token_logps.detach() if old_per_token_logps is None": "grpo-2",
        'sampling_per_token_logps = inputs.get("sampling_per_token_logps", old_per_token_logps)': "grpo-2",
        "if self.off_policy_mask_threshold is not None:": "grpo-2",
        "self.get_off_policy_mask(": "grpo-2",
        "per_token_loss = per_token_loss * off_policy_mask": "grpo-2",
        "entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)": "grpo-2",
        "per_token_loss = per_token_loss * entropy_mask": "grpo-2",
        'if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":': "grpo-2",
        'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]': "grpo-2",
        'self._metrics[mode]["policy_loss"]': "grpo-2",
    },
    "LOSS_AGGREGATION_FRAGMENTS": "grpo-4",
    "PER_TOKEN_LOGPS_ARITY": KEPT,
    "PER_TOKEN_LOGPS_FRAGMENTS": KEPT,
    "FUSED_HEAD_FRAGMENTS": KEPT,
    "GENERATION_OUTPUT_KEYS": KEPT,
    "GENERATION_OPTIONAL_KEYS": KEPT,
    "VLLM_GENERATE_PARAMS": KEPT,
    "VLLM_GENERATE_FRAGMENTS": KEPT,
    "VLLM_COLOCATE_LOGPROBS_MODE": KEPT,
    "GENERATE_SINGLE_TURN_FRAGMENTS": KEPT,
    "WEIGHT_SYNC_ATTRIBUTE": "grpo-8",
    "WEIGHT_SYNC_FRAGMENTS": "grpo-8",
    "VLLM_GENERATE_PROMPT_FRAGMENTS": "grpo-5",
    "TOOL_LOOP_FRAGMENTS": "grpo-5",
    "VLLM_GENERATE_CONTEXT_FRAGMENTS": "grpo-6",
    "TOOL_LOOP_CONTEXT_FRAGMENTS": "grpo-6",
    "UTILS": KEPT,
    "TRAINER_SAVE_CHECKPOINT_FRAGMENTS": KEPT,
    "GRPO_SAVE_CHECKPOINT_FRAGMENTS": KEPT,
    "PREPARE_INPUTS_FRAGMENTS": KEPT,
    "MODEL_CARD_TEMPLATE_FRAGMENTS": KEPT,
    "VLLM_GENERATION_CLIENT_SYMBOL": "cpu-2",
    "VLLM_INIT_SERVER_FRAGMENTS": {
        "self.vllm_client = VLLMClient(": "cpu-2",
        "self.vllm_client.init_communicator(device=accelerator.device)": KEPT,  # the subclass still overrides it
    },
    "VLLM_SERVER_SYNC_FRAGMENTS": KEPT,
    "VLLM_COLOCATE_SYNC_FRAGMENT": "grpo-7",  # the subclass still receives TRL's parameter stream
    "VLLM_CLIENT_METHODS": KEPT,  # a `client_cls` argument keeps the subclass and its overrides
    "VLLM_CLIENT_INIT_FRAGMENTS": KEPT,
    "VLLM_SERVER_MODULE": KEPT,
    "VLLM_RPC_ROUTE_MODULE": KEPT,
    "VLLM_RELOAD_PARAMS": KEPT,
    "VLLM_API_KEY_GUARDED_PREFIXES": KEPT,
    "OLD_LOGPS_RECOMPUTE_FRAGMENTS": "grpo-1",
    "OLD_LOGPS_PASS": "grpo-1",
    "LIGER_GRPO_INIT_FRAGMENTS": KEPT,
    "LIGER_APPLY_FRAGMENT": KEPT,
    "LIGER_APPLY_FUNCTION": KEPT,
    "ASYNC_MODULE": KEPT,
    "ASYNC_OVERRIDDEN_METHODS": {
        "__init__": KEPT,
        "get_train_dataloader": "async-1",
        "compute_loss": "async-2",
        "training_step": "async-6",
        "_sync_weight_merged": "async-8",
    },
    "ASYNC_SYNC_MERGED_EDITS": "async-8",
    "ASYNC_WEIGHT_MANIFEST": "async-8",
    "ASYNC_DATALOADER_REPLACEMENTS": "async-1",
    "ASYNC_COMPUTE_LOSS_FRAGMENTS": "async-2",
    "ROLLOUT_SAMPLE_FIELDS": "async-1",
    "ASYNC_TRAINER_ATTRIBUTES": {"model_version": "async-1", "_metrics": KEPT},
    "ASYNC_MODEL_VERSION_WRITERS": "async-3",
    "ASYNC_PEAK_FLOPS_SYMBOL": "async-4",
    "TREE_ATTENTION_NAME": KEPT,
    "TREE_ATTENTION_PARAMS": KEPT,
    "TREE_ATTENTION_LOADER": "async-6",
    "TREE_ATTENTION_LOADER_FRAGMENTS": "async-6",
    "WEIGHT_TRANSFER_METHODS": KEPT,
    "ASYNC_VLLM_CLIENT_METHODS": KEPT,
    "ASYNC_WORKER_MODULE": "async-5",
    "ASYNC_LOOP_OVERRIDDEN_METHODS": "async-5",
    "ASYNC_WORKER_FRAGMENTS": "async-5",
    "TURN_RECORD_FIELDS": "async-5",
    "TRAINING_SEQUENCE_FIELDS": "async-5",
    "ASYNC_WORKER_SAMPLING_FRAGMENTS": "async-5",
    "ASYNC_TRAINER_SAMPLING_FRAGMENTS": "async-5",
    "ASYNC_WORKER_FRAGMENTS_CONTROLLER": "async-5",
    "ASYNC_CONTEXT_LOOP_OVERRIDDEN_METHODS": "async-7",
    "ASYNC_CONTEXT_WORKER_FRAGMENTS": "async-7",
    "ASYNC_GENERATE_ONE_EDITS": "async-7",
    "ASYNC_LOOP_ATTRIBUTES": "async-7",
    "ASYNC_COUNTER_METRIC_FRAGMENT": KEPT,  # how TRL logs any worker counter, hook or not
    "ASYNC_TRAINER_WORKER_FRAGMENTS": "async-5",
    "JIT_CHECKPOINT_FRAGMENTS": KEPT,
    "VLLM_CLIENT_RETRY_FRAGMENTS": KEPT,
    "VLLM_SYNC_CALL_FRAGMENT": KEPT,
    "VLLM_INIT_COLOCATE_FRAGMENTS": "cpu-1",
    "CPU_ENGINE_ARGUMENTS_TRL_DOES_NOT_PASS": "cpu-1",
    # The `dppo-trl` command: public parts of TRL's CLI, used as `trl grpo` uses them.
    "CLI_PARSER_PARAMETERS": KEPT,
    "CLI_ACCELERATE_PRESETS": KEPT,
    "CLI_BUNDLED_REWARDS": KEPT,
    "CLI_VLLM_SERVE_FIELDS": KEPT,
    "CLI_VLLM_SERVE_FUNCTIONS": KEPT,
}
