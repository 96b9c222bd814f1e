"""Contract tests of the asynchronous trainer: the TRL internals listed in `tests/trl_contract.py` that
`AsyncDPPOTrainer`, its room and its CPU paths rely on still look the way they expect (the synchronous trainer's, the
fault handling's and the CLI's are in test_trl_contract.py)."""

import ast
import dataclasses
import inspect
import re
import textwrap

import pytest
import torch
import trl_contract
from test_trl_contract import _async_module
from trl.generation import vllm_generation

# ---------------------------------------------------------------------------------------------------------------------
# Asynchronous trainer (dppo_trl/trainers/async_dppo_trainer.py, dppo_trl/backends/cpu/async_cpu.py)
# ---------------------------------------------------------------------------------------------------------------------


def test_async_overridden_methods_keep_their_signatures():
    from dppo_trl.trainers.async_dppo_trainer import AsyncDPPOTrainer

    parent = _async_module().AsyncGRPOTrainer
    # AsyncDPPOTrainer, its shared loss and its TRL 1.16 room (`HookedAsyncGRPOTrainer` and its common base), then TRL's.
    own = AsyncDPPOTrainer.__mro__[: AsyncDPPOTrainer.__mro__.index(parent)]
    for name, params in trl_contract.ASYNC_OVERRIDDEN_METHODS.items():
        assert tuple(inspect.signature(getattr(parent, name)).parameters) == params, name
        assert any(name in cls.__dict__ for cls in own), (
            f"AsyncDPPOTrainer no longer overrides {name}: update trl_contract.py"
        )
    for name in trl_contract.ASYNC_TRAINER_ATTRIBUTES:
        assert f"self.{name} =" in inspect.getsource(parent.__init__), name


def _code_tokens(function) -> list[str]:
    """The tokens of a function's source without comments, line breaks, indentation or its docstring."""
    import ast
    import io
    import textwrap
    import tokenize

    source = textwrap.dedent(inspect.getsource(function))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    definition = ast.parse(source).body[0]
    first = definition.body[0]
    docstring_lines = range(first.lineno, first.end_lineno + 1) if ast.get_docstring(definition) else ()
    return [
        token.string
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type not in skip and token.start[0] not in docstring_lines
    ]


def test_async_dataloader_is_trls_with_two_replacements():
    """`AsyncDPPOTrainer.get_train_dataloader` restates TRL's: identical code but for the listed replacements."""
    from dppo_trl.trainers.async_dppo_trainer import AsyncDPPOTrainer

    def tokens(snippet: str) -> str:  # the snippets are names and punctuation only
        return " ".join(re.findall(r"\w+|[^\w\s]", snippet))

    ours = " ".join(_code_tokens(AsyncDPPOTrainer.get_train_dataloader))
    for replacement, original in trl_contract.ASYNC_DATALOADER_REPLACEMENTS:
        assert ours.count(tokens(replacement)) == 1, replacement
        ours = ours.replace(tokens(replacement), tokens(original))
    trls = " ".join(_code_tokens(_async_module().AsyncGRPOTrainer.get_train_dataloader))
    assert ours == trls, (
        "AsyncGRPOTrainer.get_train_dataloader changed: restate it in AsyncDPPOTrainer (TRL's code with the "
        "replacements in trl_contract.ASYNC_DATALOADER_REPLACEMENTS)"
    )


def test_async_merged_sync_is_trls_without_the_in_place_merge():
    """`_sync_weight_merged_out_of_place` restates TRL's `_sync_weight_merged`: identical code but for the edits."""
    from dppo_trl.trainers.trl116.async_grpo import HookedAsyncGRPOTrainer

    def tokens(snippet: str) -> str:
        return " ".join(re.findall(r"\w+|[^\w\s]", snippet))

    trls = " ".join(_code_tokens(_async_module().AsyncGRPOTrainer._sync_weight_merged))
    for ours, original in trl_contract.ASYNC_SYNC_MERGED_EDITS:
        assert tokens(original) in trls, f"AsyncGRPOTrainer._sync_weight_merged no longer contains {original!r}"
        trls = trls.replace(tokens(original), tokens(ours))
    ours = " ".join(_code_tokens(HookedAsyncGRPOTrainer._sync_weight_merged_out_of_place))
    ours = ours.replace("_sync_weight_merged_out_of_place", "_sync_weight_merged", 1)
    assert " ".join(ours.split()) == " ".join(trls.split()), (
        "AsyncGRPOTrainer._sync_weight_merged changed: restate it in HookedAsyncGRPOTrainer (TRL's code with the "
        "edits in trl_contract.ASYNC_SYNC_MERGED_EDITS)"
    )


def _trl_sync_walk(model) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """What TRL 1.16's `VLLMGeneration._iter_named_params` yields for `model` on one process (called on a bare
    instance: the walk reads only `model` and the distributed backend)."""
    from types import SimpleNamespace

    from trl.distributed import DistributedBackend

    generation = object.__new__(vllm_generation.VLLMGeneration)
    generation.model = model
    generation._dist = DistributedBackend(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None)))
    return [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in generation._iter_named_params()]


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_tied"])
def test_merged_stream_sends_what_trls_syncs_send(kind):
    """The out-of-place walk both rooms install yields TRL's names, dtypes and shapes, in TRL's order: those of the
    synchronous trainer's walk (its server manifest is built from it) and of the asynchronous trainer's manifest. The
    model has every piece TRL's name cleanup handles: LoRA layers (`.base_layer`), `target_parameters` experts
    (nested wrappers), a `modules_to_save` copy (`original_module`) and, tied, a LoRA embedding the head shares."""
    from peft import LoraConfig, get_peft_model

    from dppo_dev.tiny_models import build_tiny_model
    from dppo_trl.weights.stream import merged_named_weights

    moe = kind == "qwen3_moe"
    model, _ = build_tiny_model(kind.removesuffix("_tied"), dtype=torch.bfloat16, tie_word_embeddings=not moe)
    config = LoraConfig(
        r=4,
        target_modules=["q_proj", "v_proj"] + ([] if moe else ["embed_tokens"]),
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if moe else None,
        modules_to_save=["model.norm"],
    )
    model = get_peft_model(model, config)
    ours = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in merged_named_weights(model)]
    assert ours == _trl_sync_walk(model)
    manifest = getattr(_async_module(), trl_contract.ASYNC_WEIGHT_MANIFEST)
    assert ours == [(name, param.dtype, tuple(param.shape)) for name, param in manifest(model)]


def test_a_model_the_walk_cannot_merge_keeps_trls_sync_with_a_warning(caplog):
    """DoRA (a LoRA variant) or FSDP1: the sync trainer's room leaves TRL's walk in place and says why."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    from dppo_dev.tiny_models import build_tiny_model
    from dppo_trl.trainers.trl116.grpo import merge_lora_out_of_place

    dora = get_peft_model(build_tiny_model("qwen3")[0], LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    plain = get_peft_model(build_tiny_model("qwen3")[0], LoraConfig(r=4, target_modules=["q_proj"]))
    for model, fsdp_version, reason in ((dora, None, "DoraLinearVariant"), (plain, 1, "FSDP1")):
        generation = SimpleNamespace()
        trainer = SimpleNamespace(
            model=model,
            args=SimpleNamespace(use_vllm=True),
            accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version))),
            vllm_generation=generation,
        )
        with caplog.at_level("WARNING"):
            assert not merge_lora_out_of_place(trainer)
        assert vars(generation) == {} and reason in caplog.text and "in-place merge" in caplog.text
        caplog.clear()
    trainer.model = plain
    trainer.accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=None), device=torch.device("cpu"))
    assert merge_lora_out_of_place(trainer) and callable(generation._iter_named_params)


def test_every_vllm_sync_reads_the_walk_the_room_replaces():
    sync_source = inspect.getsource(vllm_generation.VLLMGeneration.sync_weights)
    assert trl_contract.VLLM_COLOCATE_SYNC_FRAGMENT in sync_source, "VLLMGeneration.sync_weights changed"
    assert list(inspect.signature(vllm_generation.VLLMGeneration._iter_named_params).parameters) == ["self"]


def test_async_compute_loss_fragments():
    source = inspect.getsource(_async_module().AsyncGRPOTrainer.compute_loss)
    for fragment in trl_contract.ASYNC_COMPUTE_LOSS_FRAGMENTS:
        assert fragment in source, f"AsyncGRPOTrainer.compute_loss no longer contains {fragment!r}"
    assert source.count("model(") == 1, "AsyncGRPOTrainer.compute_loss calls the model more than once"


def test_async_clip_metrics_dropped_are_the_ones_trl_logs():
    """With zeroed advantages TRL's clip rates are always 0; the metric logger drops exactly the ones TRL logs."""
    from dppo_trl.trainers.trl116 import PARENT_CLIP_METRICS

    source = inspect.getsource(_async_module().AsyncGRPOTrainer.compute_loss)
    assert set(re.findall(r'\["(clip_ratio/[a-z_]+)"\]', source)) == set(PARENT_CLIP_METRICS)


def test_async_model_version_changes_only_between_optimizer_steps():
    parent = _async_module().AsyncGRPOTrainer
    writers = {
        name
        for name, member in inspect.getmembers(parent, inspect.isfunction)
        if re.search(r"self\.model_version (\+)?= ", inspect.getsource(member))
    }
    assert writers == set(trl_contract.ASYNC_MODEL_VERSION_WRITERS)
    # The syncs run from callbacks: at train begin, and at the end of an optimizer step.
    module = _async_module()
    assert "self._trainer._sync_weight()" in inspect.getsource(module._TrainBeginCallback.on_train_begin)
    assert "StepIntervalCallback(self._sync_weight, self.args.weight_sync_steps)" in inspect.getsource(module)
    assert "def on_step_end(" in inspect.getsource(module.StepIntervalCallback)


def test_async_packing_sample_worker_and_cpu_contract():
    from trl.experimental.async_grpo import packing
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    assert dataclasses.is_dataclass(RolloutSample)
    assert set(trl_contract.ROLLOUT_SAMPLE_FIELDS) <= {f.name for f in dataclasses.fields(RolloutSample)}
    module = _async_module()
    assert callable(getattr(module, trl_contract.ASYNC_PEAK_FLOPS_SYMBOL))
    assert trl_contract.ASYNC_PEAK_FLOPS_SYMBOL + "(" in inspect.getsource(module.AsyncGRPOTrainer.__init__)
    assert packing.TREE_ATTENTION == trl_contract.TREE_ATTENTION_NAME
    params = inspect.signature(packing.tree_attention).parameters
    assert set(trl_contract.TREE_ATTENTION_PARAMS) <= set(params)
    loader = getattr(packing, trl_contract.TREE_ATTENTION_LOADER)
    assert callable(loader) and hasattr(loader, "cache_clear"), "TRL's kernel loader is no longer a cached function"
    assert not inspect.signature(loader).parameters
    for fragment in trl_contract.TREE_ATTENTION_LOADER_FRAGMENTS:
        assert fragment in inspect.getsource(packing.tree_attention), f"TRL's tree_attention changed: {fragment!r}"
    protocol = module.WeightTransferProtocol
    assert all(callable(getattr(protocol, name)) for name in trl_contract.WEIGHT_TRANSFER_METHODS)
    assert all(callable(getattr(VLLMClient, name)) for name in trl_contract.ASYNC_VLLM_CLIENT_METHODS)


def test_async_topk_worker_internals():
    """The rollout-worker internals `dppo_trl.trainers.trl116.async_topk` subclasses and reads (top-K in async)."""
    import importlib

    from dppo_trl.trainers.trl116.async_grpo import TopKRolloutLoop, TopKRolloutWorker
    from dppo_trl.trainers.trl116.async_topk import TopKRolloutSample

    worker = importlib.import_module(trl_contract.ASYNC_WORKER_MODULE)
    loop = worker._AsyncRolloutLoop
    for name, params in trl_contract.ASYNC_LOOP_OVERRIDDEN_METHODS.items():
        assert tuple(inspect.signature(getattr(loop, name)).parameters) == params, name
        assert name in TopKRolloutLoop.__dict__, f"TopKRolloutLoop no longer overrides {name}: update trl_contract.py"
    source = inspect.getsource(worker)
    for fragment in trl_contract.ASYNC_WORKER_FRAGMENTS:
        assert fragment in source, f"the rollout worker changed: missing {fragment!r}"
    controller = inspect.getsource(worker.AsyncRolloutWorker)
    for fragment in trl_contract.ASYNC_WORKER_FRAGMENTS_CONTROLLER:
        assert fragment in controller, fragment
    assert TopKRolloutWorker._loop_cls is TopKRolloutLoop
    assert tuple(f.name for f in dataclasses.fields(worker.TurnRecord)) == trl_contract.TURN_RECORD_FIELDS
    assert tuple(f.name for f in dataclasses.fields(worker.TrainingSequence)) == trl_contract.TRAINING_SEQUENCE_FIELDS
    assert {f.name for f in dataclasses.fields(worker.RolloutSample)} < {
        f.name for f in dataclasses.fields(TopKRolloutSample)
    }
    trainer_init = inspect.getsource(_async_module())
    for fragment in trl_contract.ASYNC_TRAINER_WORKER_FRAGMENTS:
        assert fragment in trainer_init, fragment
    # Truncated sampling: the config's top_k/top_p/min_p reach every request the worker sends.
    for fragment in trl_contract.ASYNC_WORKER_SAMPLING_FRAGMENTS:
        assert fragment in source, f"the rollout worker changed: missing {fragment!r}"
    for fragment in trl_contract.ASYNC_TRAINER_SAMPLING_FRAGMENTS:
        assert fragment in trainer_init, fragment


def test_async_context_fit_internals():
    """The rollout-worker internals `dppo_trl.trainers.trl116.async_context` overrides and reads (context fit in async)."""
    import importlib

    from dppo_trl.trainers.trl116.async_context import ContextFitRolloutLoop

    worker = importlib.import_module(trl_contract.ASYNC_WORKER_MODULE)
    loop = worker._AsyncRolloutLoop
    for name, params in trl_contract.ASYNC_CONTEXT_LOOP_OVERRIDDEN_METHODS.items():
        assert tuple(inspect.signature(getattr(loop, name)).parameters) == params, name
        assert name in ContextFitRolloutLoop.__dict__, f"ContextFitRolloutLoop no longer overrides {name}"
    source = inspect.getsource(worker)
    for fragment in trl_contract.ASYNC_CONTEXT_WORKER_FRAGMENTS:
        assert fragment in source, f"the rollout worker changed: missing {fragment!r}"
    for name in trl_contract.ASYNC_LOOP_ATTRIBUTES:
        assert f"self.{name}" in inspect.getsource(loop.__init__) or isinstance(
            inspect.getattr_static(loop, name), property
        ), name
    assert trl_contract.ASYNC_COUNTER_METRIC_FRAGMENT in inspect.getsource(_async_module())

    # `_generate_one` restates TRL's: identical code but for the listed edits (the docstrings and signatures aside).
    def tokens(snippet: str) -> str:
        return " ".join(re.findall(r"\w+|[^\w\s]", snippet))

    def body(function) -> str:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
        code = tree.body[1:] if ast.get_docstring(tree) else tree.body
        return tokens(" ".join(ast.unparse(statement) for statement in code))

    ours = body(ContextFitRolloutLoop._generate_one)
    for edit, original in trl_contract.ASYNC_GENERATE_ONE_EDITS:
        assert ours.count(tokens(edit)) == 1, edit
        ours = ours.replace(tokens(edit), tokens(original))
    assert ours == body(loop._generate_one), (
        "_AsyncRolloutLoop._generate_one changed: restate it in ContextFitRolloutLoop (TRL's code with the edits in "
        "trl_contract.ASYNC_GENERATE_ONE_EDITS)"
    )
