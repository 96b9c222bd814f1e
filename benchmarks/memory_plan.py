"""
The per-GPU memory budget of a GPU recipe, phase by phase, from the model's config on the meta device.

    .venv/bin/python benchmarks/memory_plan.py --recipe examples/recipes/qwen3_30b_a3b_base_lora_dapo_math.yaml
    .venv/bin/python benchmarks/memory_plan.py --recipe <yaml> --gpus 8 --gpu-memory-gib 79.6

The recipe is parsed as `examples/train_dapo_math.py` parses it (TRL's parser into `DPPOConfig` and TRL's
`ModelConfig`; the script's own data and evaluation keys are listed, not used). Its launch is read from the
accelerate config its header names (`--config_file ...`): DeepSpeed ZeRO-3 or FSDP shard weights, gradients and
optimizer states over the GPUs, DDP replicates them. The model is built on the meta device from the config shipped in
`benchmarks/model_configs/<name>/config.json` (or the recipe's local model folder): no weights, no Hub. The recipe's
real PEFT config (TRL's `get_peft_config`) wraps it, so the adapter is PEFT's own (expert LoRA on fused 3-D experts is
`r × num_experts` wide).

Phases, per GPU (vLLM colocated on the training GPUs; in server mode the engine is elsewhere):

- `train_step`: what the trainer keeps (its weight shard, adapter, optimizer states, gradients) plus the ZeRO-3
  working set, the activations at the recipe's lengths, TRL's fused LM head, the generation batch buffer (and top-K
  lists), and the engine: its whole share (`vllm_gpu_memory_utilization × card`) unless sleep mode frees it;
- `sync_trl`: TRL 1.16's weight sync. With PEFT under ZeRO-3 it gathers every parameter at once before merging
  (`VLLMGeneration._iter_named_params`); the engine's weights are awake (sleep mode: weights only, no KV cache);
- `sync_per_layer`: the sync of issue 37, which gathers one unit at a time — a decoder layer with its adapters, or
  one parameter outside the layers (within the issue's bound of a layer plus the embeddings) — and merges out of
  place; a model without adapters keeps TRL's per-parameter sync;
- `generation`: what the trainer keeps plus the engine's whole share.

Every term says whether it is `counted` (bytes read off the meta model and the recipe: parameter bytes, adapter sizes,
the engine's tensor-parallel weight shard, KV bytes per token) or `estimated`, with its formula. Prints one JSON
object; exits 1 when the recipe cannot be planned (unknown model, launch or option).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = ROOT / "benchmarks" / "model_configs"
GIB = 1024**3
# An "80 GB" H100 as torch reports it (81,559 MiB, docs/recipes.md): the default card.
H100_80GB_GIB = 81559 / 1024

# Estimated constants, each printed with the term that uses it.
RUNTIME_GIB = 1.5  # per process: CUDA context, cuBLAS workspace, NCCL buffers, allocator slack
ENGINE_GRAPHS_GIB = 1.0  # vLLM's CUDA graphs; they stay when sleep mode discards weights and KV cache
DS_REDUCE_BUCKET = 500_000_000  # DeepSpeed's default `reduce_bucket_size` (elements); accelerate's zero3 sets none
DS_PREFETCH_BUCKET = 50_000_000  # DeepSpeed's default `stage3_prefetch_bucket_size` (elements)
DS_SUB_GROUP = 1_000_000_000  # DeepSpeed's default `sub_group_size` (elements): fp32 gradients of one step group
LOGPROB_TOKEN_TILE = 4096  # TRL's fused LM head: tokens per projection tile (trl/kernels/chunked_logprob.py)
LOGPROB_VOCAB_TILE = 32768  # TRL's fused LM head: vocabulary per tile (trl/trainer/utils.py)
VLLM_BATCHED_TOKENS = 4096  # TRL's colocated engine: `max_num_batched_tokens`
DAPO_PROMPT_LENGTH = 2048  # the authors' prompt bound, when the recipe sets no vllm_max_model_length
MERGE_CHUNK_ELEMENTS = 1 << 26  # the out-of-place merge computes expert stacks in float32 chunks of this size


# --------------------------------------------------------------------------------------------------------------------
# Terms
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Term:
    """One line of a phase's budget: bytes per GPU, whether counted or estimated, and how."""

    nbytes: float
    kind: str  # "counted" | "estimated"
    formula: str

    def to_json(self) -> dict:
        return {"gib": round(self.nbytes / GIB, 3), "kind": self.kind, "formula": self.formula}


def counted(nbytes: float, formula: str) -> Term:
    return Term(float(nbytes), "counted", formula)


def estimated(nbytes: float, formula: str) -> Term:
    return Term(float(nbytes), "estimated", formula)


def phase(terms: dict[str, Term], gpu_bytes: float) -> dict:
    total = sum(t.nbytes for t in terms.values())
    return {
        "terms": {name: t.to_json() for name, t in terms.items()},
        "total_gib": round(total / GIB, 2),
        "estimated_gib": round(sum(t.nbytes for t in terms.values() if t.kind == "estimated") / GIB, 2),
        "headroom_gib": round((gpu_bytes - total) / GIB, 2),
        "fits": total <= gpu_bytes,
    }


# --------------------------------------------------------------------------------------------------------------------
# The recipe and its launch
# --------------------------------------------------------------------------------------------------------------------
def parse_recipe(recipe: Path):
    """`(DPPOConfig, ModelConfig, script_only_keys)` as `examples/train_dapo_math.py` parses the recipe (TRL's
    parser); its data and evaluation keys belong to the script and are returned by name."""
    import torch
    from trl import ModelConfig, TrlParser

    from dppo_trl import DPPOConfig

    parser = TrlParser((DPPOConfig, ModelConfig))
    if not torch.cuda.is_available():
        # As the script does on a machine without a GPU: TrainingArguments refuses bf16 on CPU unless use_cpu is set.
        # Nothing here depends on the device.
        parser.set_defaults_with_config(use_cpu=True)
    args, model_args, remaining = parser.parse_args_and_config(
        ["--config", str(recipe)], return_remaining_strings=True
    )
    script_only = sorted(s.removeprefix("--") for s in remaining if s.startswith("--"))
    return args, model_args, script_only


def launch_config_path(recipe: Path) -> Path | None:
    """The accelerate config the recipe's header launches with (`accelerate launch --config_file <path>`); None for a
    recipe run as a plain script (one process)."""
    match = re.search(r"--config_file (\S+\.yaml)", recipe.read_text(encoding="utf-8"))
    return ROOT / match.group(1) if match else None


def read_launch(path: Path | None) -> dict:
    """How the trainer is distributed: `zero3`, `fsdp` (sharded) or `ddp` (replicated), and the process count."""
    import yaml

    if path is None:
        return {"accelerate_config": None, "distribution": "ddp", "mixed_precision": "no", "num_processes": 1}
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    kind = config.get("distributed_type", "NO")
    if kind == "DEEPSPEED":
        stage = int(config.get("deepspeed_config", {}).get("zero_stage", 0))
        offload = config.get("deepspeed_config", {})
        if stage != 3:
            raise ValueError(f"{path}: DeepSpeed ZeRO stage {stage} is not planned (ZeRO-3 or DDP).")
        if offload.get("offload_optimizer_device", "none") != "none" or offload.get("offload_param_device") not in (
            None,
            "none",
        ):
            raise ValueError(f"{path}: ZeRO-3 offload is not planned.")
        distribution = "zero3"
    elif kind == "FSDP":
        distribution = "fsdp"
    elif kind in ("MULTI_GPU", "NO"):
        distribution = "ddp"
    else:
        raise ValueError(f"{path}: distributed_type {kind!r} is not planned (DEEPSPEED stage 3, FSDP, MULTI_GPU).")
    return {
        "accelerate_config": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
        "distribution": distribution,
        "mixed_precision": config.get("mixed_precision", "no"),
        "num_processes": int(config.get("num_processes", 1)),
    }


def model_config_dir(model_name_or_path: str) -> Path:
    """The shipped config of a Hub model (`benchmarks/model_configs/<name>`), or the recipe's local model folder."""
    local = ROOT / model_name_or_path
    if (local / "config.json").is_file():
        return local
    shipped = MODEL_CONFIGS / model_name_or_path.split("/")[-1]
    if (shipped / "config.json").is_file():
        return shipped
    raise ValueError(
        f"No config for {model_name_or_path!r}: add its config.json under {MODEL_CONFIGS.relative_to(ROOT)}/"
        f"{model_name_or_path.split('/')[-1]}/ (no weights are needed)."
    )


# --------------------------------------------------------------------------------------------------------------------
# The model on the meta device
# --------------------------------------------------------------------------------------------------------------------
def build_meta_model(config_dir: Path, dtype_name: str | None, peft_config=None):
    """The model (and, with `peft_config`, PEFT's wrapper around it) on the meta device, in the recipe's dtype."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    dtype = getattr(config, "torch_dtype", None) or torch.float32
    if dtype_name not in (None, "auto"):
        dtype = getattr(torch, dtype_name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
    return model


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def model_summary(model) -> dict:
    """Parameter counts and bytes read off the meta model: whole model, embeddings, per decoder layer, adapters."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    text_config = base.config.get_text_config()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    adapter_names = {n for n, _ in model.named_parameters() if "lora_" in n}
    layers = base.model.layers
    layer_bytes = [_bytes(p for n, p in layer.named_parameters() if "lora_" not in n) for layer in layers]
    layer_adapters = [sum(p.numel() for n, p in layer.named_parameters() if "lora_" in n) for layer in layers]
    parts: dict[
        str, int
    ] = {}  # the largest layer's base bytes by part: self_attn, mlp (or mlp.experts, mlp.gate), norms
    largest_layer = layers[layer_bytes.index(max(layer_bytes))]
    for name, p in largest_layer.named_parameters():
        if "lora_" not in name:
            path = [c for c in name.split(".")[:-1] if c != "base_layer"]
            key = ".".join(path[:2]) if path and path[0] == "mlp" and len(path) > 1 else (path[0] if path else name)
            parts[key] = parts.get(key, 0) + p.numel() * p.element_size()
    embed = base.get_input_embeddings().weight
    head = base.get_output_embeddings().weight
    tied = head is embed
    embeddings = [embed] if tied else [embed, head]
    not_in_layers = [p for n, p in base.named_parameters() if ".layers." not in n]
    largest_name, largest = max(
        ((n, p) for n, p in model.named_parameters() if n not in adapter_names), key=lambda item: item[1].numel()
    )
    base_params = sum(p.numel() for n, p in model.named_parameters() if n not in adapter_names)
    num_experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
    summary = {
        "model_type": text_config.model_type,
        "params": base_params,
        "params_non_embedding": base_params - sum(p.numel() for p in embeddings),
        "bytes": _bytes(p for n, p in model.named_parameters() if n not in adapter_names),
        "frozen_bytes": _bytes(frozen),
        "trainable_params": sum(p.numel() for p in trainable),
        "trainable_bytes": _bytes(trainable),
        "num_layers": len(layers),
        "layer_bytes_max": max(layer_bytes),
        "layer_adapter_params_max": max(layer_adapters),
        "layer_bytes_by_part": dict(sorted(parts.items())),
        "embeddings_bytes": _bytes(embeddings),
        "outside_layers_largest_bytes": max(_bytes([p]) for p in not_in_layers),
        "tied_embeddings": tied,
        "largest_tensor": {"name": largest_name, "params": largest.numel(), "bytes": _bytes([largest])},
        "lm_head_params": head.numel(),
        "dtype": str(embed.dtype).removeprefix("torch."),
    }
    if num_experts:
        top_k = text_config.num_experts_per_tok
        expert_params = sum(p.numel() for n, p in base.named_parameters() if ".experts." in n and "lora_" not in n)
        summary["num_experts"] = num_experts
        summary["active_params"] = base_params - expert_params + expert_params * top_k // num_experts
    return summary


def adapter_summary(model) -> dict | None:
    """Trainable adapter parameters (ours and PEFT's own count), and the largest per-layer and per-target share."""
    if not hasattr(model, "get_nb_trainable_parameters"):
        return None
    trainable, _ = model.get_nb_trainable_parameters()
    by_target: dict[str, int] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            key = re.sub(r"^.*\.layers\.\d+\.", "", name)
            key = re.sub(r"\.lora_[AB]\..*$", "", key).replace(".base_layer", "")
            by_target[key] = by_target.get(key, 0) + p.numel()
    return {
        "peft_trainable_params": trainable,
        "by_target": dict(sorted(by_target.items())),
        "dtype": str(next(p.dtype for p in model.parameters() if p.requires_grad)).removeprefix("torch."),
    }


def engine_shard_bytes(model, tp: int, dtype_bytes: int = 2) -> int:
    """Weight bytes per GPU of a vLLM engine with tensor parallelism `tp`, in the engine's dtype (bf16).

    vLLM's layout (by reading its Qwen3 / Qwen3-MoE models): norms and the MoE router are replicated; the K/V
    projections are split over min(tp, num_kv_heads) and replicated beyond; every other weight (embeddings and LM
    head vocab-parallel, attention and MLP column/row-parallel, fused experts split on the intermediate size) is split
    `tp` ways."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    text_config = base.config.get_text_config()
    kv_heads = text_config.num_key_value_heads
    total = 0.0
    for name, p in base.named_parameters():
        if "lora_" in name:
            continue
        n = p.numel()
        if p.dim() == 1 or name.endswith("mlp.gate.weight"):
            total += n
        elif re.search(r"\.(k_proj|v_proj)\.", name):
            total += n / min(tp, kv_heads)
        else:
            total += n / tp
    return int(total * dtype_bytes)


# --------------------------------------------------------------------------------------------------------------------
# Estimated terms (formulas printed with each)
# --------------------------------------------------------------------------------------------------------------------
def layer_activation_elements(text_config) -> tuple[int, str]:
    """Elements kept for backward per token by one decoder layer (bf16, SDPA/flash attention: no S² scores)."""
    h = text_config.hidden_size
    head_dim = getattr(text_config, "head_dim", None) or h // text_config.num_attention_heads
    dq = text_config.num_attention_heads * head_dim
    dkv = text_config.num_key_value_heads * head_dim
    attention = 2 * h + 4 * dq + 4 * dkv
    experts = getattr(text_config, "num_experts", None)
    if experts:
        k, i = text_config.num_experts_per_tok, text_config.moe_intermediate_size
        mlp = 2 * h + 2 * experts + k * (2 * h + 4 * i)
        formula = (
            f"attention 2H+4Dq+4Dkv = {attention} + MoE 2H+2E+k(2H+4I_moe) = {mlp} (H={h}, Dq={dq}, Dkv={dkv}, "
            f"E={experts}, k={k}, I_moe={i})"
        )
    else:
        i = text_config.intermediate_size
        mlp = 2 * h + 4 * i
        formula = f"attention 2H+4Dq+4Dkv = {attention} + MLP 2H+4I = {mlp} (H={h}, Dq={dq}, Dkv={dkv}, I={i})"
    return attention + mlp, formula


def activation_terms(text_config, tokens: int, num_layers: int, checkpointing: bool) -> dict[str, Term]:
    """Activations of one micro-batch of `tokens` tokens (per_device_train_batch_size × sequence length)."""
    per_layer, formula = layer_activation_elements(text_config)
    h = text_config.hidden_size
    layer_bytes = tokens * per_layer * 2
    if checkpointing:
        saved = tokens * h * 2 * num_layers
        return {
            "activations_checkpoints": estimated(
                saved,
                f"layer inputs kept by gradient checkpointing: tokens × H × 2 B × L = {tokens} × {h} × 2 × {num_layers}",
            ),
            "activations_recompute": estimated(
                2 * layer_bytes,
                f"one layer recomputed in backward, its activations and their gradients: 2 × tokens × a × 2 B, "
                f"a = {per_layer} elements per token ({formula})",
            ),
        }
    return {
        "activations": estimated(
            layer_bytes * num_layers + layer_bytes,
            f"every layer's activations kept (no checkpointing) plus one layer's gradients: (L + 1) × tokens × a × "
            f"2 B, L = {num_layers}, a = {per_layer} ({formula})",
        )
    }


def lm_head_term(text_config, tokens: int, fp32_head: bool, gathered_head_bytes: int, head_trainable: bool) -> Term:
    """TRL's fused LM head: projection tiles, the fp32 hidden-state gradient, the gathered head (ZeRO-3)."""
    tile_dtype = 4 if fp32_head else 2
    tile = min(tokens, LOGPROB_TOKEN_TILE) * LOGPROB_VOCAB_TILE * tile_dtype
    hidden = tokens * text_config.hidden_size * (4 + (4 if fp32_head else 0))
    head_grad = text_config.vocab_size * text_config.hidden_size * 4 if head_trainable else 0
    return estimated(
        tile + hidden + head_grad + gathered_head_bytes,
        f"tile min(tokens, {LOGPROB_TOKEN_TILE}) × {LOGPROB_VOCAB_TILE} × {tile_dtype} B + fp32 grad of the hidden "
        f"states tokens × H × 4 B{' + their fp32 copy' if fp32_head else ''}"
        f"{' + fp32 grad of the head V × H × 4 B' if head_trainable else ''}"
        f"{' + the head gathered from its ZeRO-3 shards' if gathered_head_bytes else ''}",
    )


# --------------------------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------------------------
def plan(recipe: Path, gpus: int | None, gpu_memory_gib: float, accelerate_config: Path | None = None) -> dict:
    from trl import get_peft_config

    args, model_args, script_only = parse_recipe(recipe)
    launch = read_launch(accelerate_config or launch_config_path(recipe))
    gpus = gpus or launch["num_processes"]
    gpu_bytes = gpu_memory_gib * GIB
    config_dir = model_config_dir(model_args.model_name_or_path)
    peft_config = get_peft_config(model_args)
    model = build_meta_model(config_dir, model_args.dtype, peft_config)
    base = model.get_base_model() if peft_config is not None else model
    text_config = base.config.get_text_config()
    summary = model_summary(model)
    adapter = adapter_summary(model)

    sharded = launch["distribution"] in ("zero3", "fsdp")
    shards = gpus if sharded else 1
    split = f"/ N (N = {gpus}, {launch['distribution']})" if sharded else f"(replicated: {launch['distribution']})"
    uses_peft = peft_config is not None
    trainable = summary["trainable_params"]
    # Under DeepSpeed with bf16 mixed precision the module's trainable parameters and their gradients are bf16
    # (DeepSpeed casts the module, PEFT's fp32 adapters included) and the optimizer keeps fp32 master copies and fp32
    # m, v. Otherwise (DDP, FSDP, DeepSpeed without bf16) they stay in the dtype they were built in (PEFT's adapters:
    # fp32; a bf16 model trained fully: bf16), and AdamW's m, v take that dtype.
    deepspeed_bf16 = launch["distribution"] == "zero3" and launch["mixed_precision"] == "bf16"
    loaded_bytes = summary["trainable_bytes"] / max(trainable, 1)
    trained_bytes = 2 if deepspeed_bf16 else loaded_bytes
    fp32_head = bool(getattr(args, "cast_lm_head_to_fp32", False))
    head_extra = summary["lm_head_params"] * 2 if fp32_head else 0  # bf16 -> fp32: 2 more bytes per element

    # --- what the trainer keeps, from the first optimizer step on -------------------------------------------------
    resident: dict[str, Term] = {}
    weight_bytes = summary["frozen_bytes"] if uses_peft else summary["bytes"]
    resident["weights"] = counted(
        (weight_bytes + head_extra) / shards,
        f"{'frozen base' if uses_peft else 'all'} parameter bytes of the meta model ({summary['dtype']}"
        f"{', LM head fp32: cast_lm_head_to_fp32' if fp32_head else ''}) {split}",
    )
    if uses_peft:
        resident["adapter"] = counted(
            trainable * trained_bytes / shards,
            f"trainable adapter params {trainable:,} × {trained_bytes:g} B "
            f"({'bf16 under DeepSpeed bf16' if deepspeed_bf16 else adapter['dtype'] + ', as PEFT builds them'}) {split}",
        )
    master = 4 if deepspeed_bf16 else 0
    state_dtype = 4 if deepspeed_bf16 else loaded_bytes
    resident["optimizer_states"] = counted(
        trainable * (2 * state_dtype + master) / shards,
        f"AdamW m, v ({state_dtype:g} B each){' + fp32 master weights (4 B)' if master else ''} per trainable param "
        f"({trainable:,}) {split}",
    )
    resident["gradients"] = counted(
        trainable * trained_bytes / shards, f"trainable params × {trained_bytes:g} B (accumulated gradient) {split}"
    )
    resident["runtime"] = estimated(
        RUNTIME_GIB * GIB, f"{RUNTIME_GIB} GiB: CUDA context, cuBLAS workspace, NCCL buffers, allocator slack"
    )
    if args.beta != 0.0 and not uses_peft:
        resident["reference_model"] = counted(
            summary["bytes"] / shards, f"a frozen reference copy (beta = {args.beta}) {split}"
        )

    # --- the train step ------------------------------------------------------------------------------------------
    if args.vllm_max_model_length:
        prompt_len = args.vllm_max_model_length - args.max_completion_length
        prompt_source = "vllm_max_model_length - max_completion_length"
    else:
        context = text_config.max_position_embeddings
        prompt_len = min(DAPO_PROMPT_LENGTH, context - args.max_completion_length)
        prompt_source = (
            f"min({DAPO_PROMPT_LENGTH} (DAPO's prompt bound), max_position_embeddings - max_completion_length)"
        )
    seq_len = prompt_len + args.max_completion_length
    tokens = args.per_device_train_batch_size * seq_len
    step: dict[str, Term] = {}
    if sharded:
        working = 2 * summary["layer_bytes_max"] + min(DS_PREFETCH_BUCKET * 2, summary["layer_bytes_max"])
        step["zero3_gathered_layers"] = estimated(
            working,
            "the layer in compute and the one its backward recomputes gathered whole (2 × largest decoder layer, "
            f"{summary['layer_bytes_max'] / GIB:.2f} GiB) + the prefetch bucket (≤ {DS_PREFETCH_BUCKET:,} elements, bf16)",
        )
        bucket = min(DS_REDUCE_BUCKET, trainable) * 2
        fp32_group = min(DS_SUB_GROUP, trainable // shards) * 4 if deepspeed_bf16 else 0
        step["zero3_buckets"] = estimated(
            bucket + fp32_group,
            f"gradient reduce bucket min(reduce_bucket_size {DS_REDUCE_BUCKET:,}, trainable) × 2 B"
            + (
                f" + fp32 gradients of one optimizer sub-group min({DS_SUB_GROUP:,}, trainable / N) × 4 B"
                if fp32_group
                else ""
            ),
        )
    step.update(activation_terms(text_config, tokens, summary["num_layers"], args.gradient_checkpointing))
    head_bytes = (summary["lm_head_params"] * (4 if fp32_head else 2)) if sharded else 0
    step["lm_head"] = lm_head_term(text_config, tokens, fp32_head, head_bytes, head_trainable=not uses_peft)
    rows = args.per_device_train_batch_size * args.steps_per_generation
    buffer_bytes = rows * seq_len * 16 + rows * args.max_completion_length * 9
    buffer_formula = (
        f"rows × S × 16 B (ids, masks: int64) + rows × C × 9 B (μ, anchor fp32, validity), rows = "
        f"per_device_train_batch_size × steps_per_generation = {rows}, S = {seq_len}, C = {args.max_completion_length}"
    )
    spec = args.trust_region_spec()
    top_k = args.divergence_top_k if spec.uses_top_k and args.anchor == "behavior" else 0
    kept = args.kept_set_size or 0
    lists = max(top_k, kept)
    if lists:
        buffer_bytes += rows * args.max_completion_length * lists * 12
        buffer_formula += f" + μ's lists rows × C × K × 12 B (int64 ids, fp32 log-probs), K = {lists}"
    step["generation_buffer"] = estimated(buffer_bytes, buffer_formula)
    if lists:
        step["topk_gather"] = estimated(
            min(tokens, 4096) * (lists + 1) * text_config.hidden_size * 4,
            f"π at μ's lists: a chunk of min(tokens, 4096) × (K+1) LM-head rows × H × 4 B, K = {lists}",
        )

    # --- the engine ----------------------------------------------------------------------------------------------
    colocate = args.use_vllm and args.vllm_mode == "colocate"
    engine: dict = {"mode": args.vllm_mode if args.use_vllm else None}
    gen: dict[str, Term] = {}
    sync_engine: dict[str, Term] = {}
    if colocate:
        tp = args.vllm_tensor_parallel_size
        util = args.vllm_gpu_memory_utilization
        share = util * gpu_bytes
        shard = engine_shard_bytes(model, tp)
        kv_heads = max(1, text_config.num_key_value_heads // tp)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        kv_per_token = 2 * summary["num_layers"] * kv_heads * head_dim * 2
        per_layer, _ = layer_activation_elements(text_config)
        max_seqs = rows * tp  # TRL's max_num_seqs: per_device_train_batch_size × TP × steps_per_generation
        profile = VLLM_BATCHED_TOKENS * per_layer * 2 + max_seqs * text_config.vocab_size // tp * 4
        overhead = profile + ENGINE_GRAPHS_GIB * GIB
        kv_bytes = share - shard - overhead
        max_len = args.vllm_max_model_length or text_config.max_position_embeddings
        sleep = bool(args.vllm_enable_sleep_mode)
        engine.update(
            tensor_parallel_size=tp,
            gpu_memory_utilization=util,
            share_gib=round(share / GIB, 2),
            weights_shard_gib=round(shard / GIB, 2),
            overhead_gib=round(overhead / GIB, 2),
            overhead_formula=(
                f"estimated: profile activations {VLLM_BATCHED_TOKENS} batched tokens × a × 2 B + sampler logits "
                f"max_num_seqs × V / TP × 4 B + {ENGINE_GRAPHS_GIB} GiB CUDA graphs"
            ),
            kv_cache_gib=round(kv_bytes / GIB, 2),
            kv_bytes_per_token=kv_per_token,
            kv_tokens=max(0, int(kv_bytes // kv_per_token)),
            max_model_len=max_len,
            max_len_sequences=max(0, kv_bytes / kv_per_token / max_len),
            max_num_seqs=max_seqs,
            sleep_mode=sleep,
            starts=kv_bytes >= kv_per_token * max_len,
        )
        engine["max_len_sequences"] = round(engine["max_len_sequences"], 1)
        whole = counted(
            share,
            f"vllm_gpu_memory_utilization × card = {util} × {gpu_memory_gib} GiB (its weight shard "
            f"{shard / GIB:.2f} GiB at TP {tp}, KV cache, CUDA graphs)",
        )
        gen["engine"] = whole
        if sleep:
            step["engine_asleep"] = estimated(
                ENGINE_GRAPHS_GIB * GIB,
                f"sleep level 2 frees weights and KV cache; CUDA graphs stay (~{ENGINE_GRAPHS_GIB} GiB)",
            )
            sync_engine["engine_weights"] = counted(
                shard, f"the engine's weights woken for the sync (TP {tp} shard, vLLM's layout); KV cache still asleep"
            )
            sync_engine["engine_asleep"] = step["engine_asleep"]
        else:
            step["engine"] = whole
            sync_engine["engine"] = whole
    gen["generation_buffer"] = step["generation_buffer"]

    # --- the weight sync -----------------------------------------------------------------------------------------
    largest = summary["largest_tensor"]["bytes"]
    layer_with_adapters = summary["layer_bytes_max"] + summary["layer_adapter_params_max"] * trained_bytes
    sync_trl: dict[str, Term] = {}
    sync_layer: dict[str, Term] = {}
    if args.use_vllm:
        if uses_peft and launch["distribution"] == "zero3":
            whole_bytes = summary["bytes"] + trainable * trained_bytes
            sync_trl["gathered"] = counted(
                whole_bytes,
                "TRL gathers every parameter at once (PEFT under ZeRO-3): base + adapters, unsharded",
            )
        elif sharded:
            sync_trl["gathered"] = counted(
                largest, f"one parameter at a time: the largest ({summary['largest_tensor']['name']})"
            )
        if uses_peft:
            sync_trl["merge_delta"] = estimated(
                largest, "PEFT's merge_adapter: ΔW of the largest adapted tensor, in its dtype"
            )
        if uses_peft:
            if sharded:
                sync_layer["gathered"] = counted(
                    max(layer_with_adapters, summary["outside_layers_largest_bytes"]),
                    "the largest sync unit, unsharded: one decoder layer with its adapters, or one parameter outside "
                    "the layers (embeddings, LM head); within issue 37's bound of a layer plus the embeddings",
                )
            sync_layer["merge_out_of_place"] = estimated(
                largest + MERGE_CHUNK_ELEMENTS * 4 * 2,
                f"the merged copy of the largest adapted tensor (at most the largest tensor) in its dtype + float32 "
                f"chunks of {MERGE_CHUNK_ELEMENTS:,} elements (W chunk and ΔW chunk)",
            )
        else:
            sync_layer = dict(sync_trl)  # no adapters: TRL's own per-parameter sync
    if not colocate and args.use_vllm:
        sync_engine = {}  # server mode: the engine's memory is on the inference node

    phases = {
        "train_step": phase({**resident, **step}, gpu_bytes),
        "sync_trl": phase(
            {**resident, "generation_buffer": step["generation_buffer"], **sync_engine, **sync_trl}, gpu_bytes
        ),
        "sync_per_layer": phase(
            {**resident, "generation_buffer": step["generation_buffer"], **sync_engine, **sync_layer}, gpu_bytes
        ),
        "generation": phase({**resident, **gen}, gpu_bytes),
    }
    fits = {name: p["fits"] for name, p in phases.items()}
    if colocate:
        fits["engine_starts"] = engine["starts"]
    fits["with_trl_sync"] = all(v for k, v in fits.items() if k != "sync_per_layer")
    fits["with_per_layer_sync"] = all(v for k, v in fits.items() if k not in ("sync_trl", "with_trl_sync"))

    return {
        "recipe": str(recipe.relative_to(ROOT)) if recipe.is_relative_to(ROOT) else str(recipe),
        "model": model_args.model_name_or_path,
        "model_config": str(config_dir.relative_to(ROOT)),
        "launch": launch,
        "gpus": gpus,
        "gpu_memory_gib": round(gpu_memory_gib, 2),
        "settings": {
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "steps_per_generation": args.steps_per_generation,
            "prompt_length": prompt_len,
            "prompt_length_from": prompt_source,
            "max_completion_length": args.max_completion_length,
            "tokens_per_micro_batch": tokens,
            "gradient_checkpointing": args.gradient_checkpointing,
            "cast_lm_head_to_fp32": fp32_head,
            "divergence": args.divergence,
            "engine_lists_per_token": lists,
            "beta": args.beta,
            "use_peft": uses_peft,
            "lora_r": model_args.lora_r if uses_peft else None,
            "use_vllm": args.use_vllm,
            "vllm_mode": args.vllm_mode if args.use_vllm else None,
            "vllm_enable_sleep_mode": bool(args.vllm_enable_sleep_mode) if colocate else None,
        },
        "script_only_keys": script_only,
        "model_summary": summary,
        "adapter": adapter,
        "engine": engine,
        "phases": phases,
        "fits": fits,
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip())
    parser.add_argument("--recipe", required=True, help="a recipe YAML (examples/recipes/*.yaml)")
    parser.add_argument("--gpus", type=int, default=None, help="training GPUs (default: the accelerate config's)")
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=H100_80GB_GIB,
        help="memory per GPU, GiB (default: an 80 GB H100, 79.65)",
    )
    parser.add_argument("--accelerate-config", default=None, help="override the launch the recipe's header names")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    import yaml

    args = parse_args(argv)
    recipe = Path(args.recipe).resolve()
    accelerate_config = Path(args.accelerate_config).resolve() if args.accelerate_config else None
    try:
        # Library notices (TRL's deprecation warnings, PEFT's) go to stderr; stdout is the JSON object only.
        with contextlib.redirect_stdout(io.StringIO()) as noise:
            report = plan(recipe, args.gpus, args.gpu_memory_gib, accelerate_config)
        sys.stderr.write(noise.getvalue())
    except (ValueError, OSError, yaml.YAMLError) as error:
        print(json.dumps({"recipe": args.recipe, "error": str(error)}))
        return 1
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
