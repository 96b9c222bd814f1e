"""Checks on DPPOTrainer's inputs that must fail before GRPOTrainer loads the model or starts the vLLM engine.

`GRPOTrainer.__init__` loads the model, then the tokenizer, then (with `use_vllm`) starts the engine, all in one call.
Everything here therefore runs before `super().__init__`: the config and the datasets are plain arguments. Whether a
chat template exists is a property of the model's tokenizer files, so when the prompts are conversational and no
`processing_class` was given, the model's processing class is loaded here only to look at its template; GRPOTrainer
then loads its own as usual (the load arguments it uses do not change the template, so nothing here depends on them).
"""

from __future__ import annotations

import warnings

from dppo_trl.hardening.checkpoints import save_steps_hint


def check_trainer_inputs(config, params: dict) -> None:
    """Fail fast on bad trainer inputs (see the module docstring); `params` is read, never changed."""
    check_generation_config(config)
    check_liger_expert_adapters(config, params.get("peft_config"), params.get("model"))
    check_processing_class(params.get("processing_class"))
    train_dataset = params.get("train_dataset")
    # With an `environment_factory` the `prompt` column is optional in TRL: each rollout's `reset()` supplies it.
    prompt_required = params.get("environment_factory") is None
    if prompt_required:
        check_prompt_column(train_dataset, "train_dataset")
    check_dataset_size(train_dataset, config)
    eval_dataset = params.get("eval_dataset")
    for name, dataset in eval_dataset.items() if isinstance(eval_dataset, dict) else [("", eval_dataset)]:
        if prompt_required:
            check_prompt_column(dataset, f"eval_dataset[{name!r}]" if name else "eval_dataset")
    if _first_prompt_is_conversational(train_dataset):
        processing_class = params.get("processing_class")
        if processing_class is None:
            processing_class = _model_processing_class(params["model"], config)
        check_chat_template(processing_class, params["model"])
    hint = save_steps_hint(config)
    if hint is not None:
        warnings.warn(hint, UserWarning, stacklevel=4)  # the DPPOTrainer(...) call


def check_generation_config(config) -> None:
    """Options that make generation impossible, before anything is built."""
    length = config.max_completion_length
    if length is not None and length < 1:
        raise ValueError(
            f"max_completion_length={length}: completions need at least one token. Set max_completion_length to a "
            "positive number of tokens (e.g. 256, or 8192 for DAPO-Math)."
        )


# The fused-expert parameters Liger's `LigerExperts.forward` reads directly (`self.gate_up_proj`, `self.down_proj`).
LIGER_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def check_liger_expert_adapters(config, peft_config, model) -> None:
    """`use_liger_kernel` with LoRA on fused MoE experts (PEFT `target_parameters`) would train adapters the forward
    never uses.

    Liger's SwiGLU kernel (Liger-Kernel 0.8.5, applied by transformers when training starts) replaces the forward of
    each layer's experts module on the instance with `LigerExperts.forward`, which reads the expert weights directly.
    With `target_parameters` on those weights that module is PEFT's `ParamWrapper`, whose forward is what adds the
    adapters: it is replaced, and 0.8.5 then fails at the first training forward ("'ParamWrapper' object has no
    attribute 'hidden_dim'"). `liger_kernel_config={"swiglu": False}` leaves the experts to PEFT and keeps Liger's
    other kernels. The router's load-balancing loss is not at stake: Liger leaves the router alone, and TRL's fused
    LM head computes the loss from the router's logits (docs/api.md)."""
    if not config.use_liger_kernel or (config.liger_kernel_config or {}).get("swiglu", True) is False:
        return
    configs = [peft_config] if peft_config is not None else []
    model_configs = getattr(model, "peft_config", None)  # a PeftModel passed in: its adapters' configs
    if isinstance(model_configs, dict):
        configs += list(model_configs.values())
    targets = sorted({t for c in configs for t in (getattr(c, "target_parameters", None) or [])})
    experts = [t for t in targets if t.rsplit(".", 1)[-1] in LIGER_EXPERT_PARAMETERS]
    if experts:
        raise ValueError(
            f"use_liger_kernel=True with LoRA on the MoE experts (target_parameters={experts}): Liger's SwiGLU kernel "
            "replaces the experts' forward, which is PEFT's adapter wrapper here, so the expert adapters would never "
            'be used. Set liger_kernel_config={"swiglu": False} to keep Liger\'s other kernels, or '
            "use_liger_kernel=False. (The router's load-balancing loss is kept either way.)"
        )


def check_processing_class(processing_class) -> None:
    """GRPOTrainer takes a loaded tokenizer or processor; a path would fail only after the model is loaded."""
    if isinstance(processing_class, str | bytes) or hasattr(processing_class, "__fspath__"):
        raise TypeError(
            f"processing_class={processing_class!r} is a path, but DPPOTrainer (like GRPOTrainer) takes a loaded "
            'tokenizer or processor. Load it first: `AutoTokenizer.from_pretrained(path, padding_side="left")`, '
            "or leave processing_class unset to load the model's own."
        )


def check_prompt_column(dataset, name: str) -> None:
    columns = getattr(dataset, "column_names", None)
    if dataset is None or columns is None:
        return  # no dataset, or an IterableDataset of unknown schema: TRL reports it at the first batch
    if "prompt" not in columns:
        raise ValueError(
            f"{name} has no `prompt` column (columns found: {sorted(columns)}). GRPOTrainer reads the prompts from "
            "`prompt`: rename your prompt column to `prompt` (`dataset.rename_column(old, 'prompt')`); it may hold "
            "strings or conversations ([{'role': 'user', 'content': ...}])."
        )


def prompts_per_generation_batch(config) -> int:
    """Distinct prompts TRL's sampler draws per generation batch (it drops a last, incomplete batch)."""
    return config.generation_batch_size // config.num_generations


def check_dataset_size(dataset, config) -> None:
    if dataset is None or not hasattr(dataset, "__len__"):
        return
    size, needed = len(dataset), prompts_per_generation_batch(config)
    if size >= needed:
        return
    what = "is empty" if size == 0 else f"has {size} prompts"
    raise ValueError(
        f"train_dataset {what}, fewer than one generation batch: each generation draws {needed} distinct prompts "
        f"(generation_batch_size={config.generation_batch_size} / num_generations={config.num_generations}) and "
        f"TRL's sampler drops an incomplete batch, so training would run 0 steps. Provide at least {needed} prompts, "
        "or lower per_device_train_batch_size (or steps_per_generation / generation_batch_size)."
    )


def check_chat_template(processing_class, model) -> None:
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if getattr(processing_class, "chat_template", None) or getattr(tokenizer, "chat_template", None):
        return
    model_name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
    raise ValueError(
        f"The training prompts are conversations (lists of messages), but the tokenizer of {model_name!r} has no "
        "chat template to turn them into text. Pass a `processing_class` whose tokenizer has a `chat_template` (e.g. "
        "the instruct model's tokenizer, or set `tokenizer.chat_template`), or use plain-string prompts."
    )


def _first_prompt_is_conversational(dataset) -> bool:
    if dataset is None or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return False
    if "prompt" not in (getattr(dataset, "column_names", None) or ()):
        return False
    from trl.data_utils import is_conversational

    return is_conversational({"prompt": dataset[0]["prompt"]})


def _model_processing_class(model, config):
    """The processing class saved with the model, as GRPOTrainer would find it (same source and revision)."""
    from transformers import AutoProcessor

    if isinstance(model, str):
        model_id, revision = model, (config.model_init_kwargs or {}).get("revision")
    else:
        model_id, revision = getattr(model.config, "_name_or_path", ""), None
    return AutoProcessor.from_pretrained(model_id, revision=revision, trust_remote_code=config.trust_remote_code)
