"""Contract tests: the TRL internals listed in `tests/trl_contract.py` still look the way DPPOTrainer expects."""

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap

import pytest
import torch
import trl
import trl_contract
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from trl import GRPOConfig, GRPOTrainer
from trl.generation import vllm_generation
from trl.trainer import utils as trl_utils

from dppo_trl import DPPOConfig, DPPOTrainer


def test_installed_trl_is_in_the_tested_range():
    spec = SpecifierSet(",".join(trl_contract.TESTED_TRL_RANGE))
    assert Version(trl.__version__) in spec, f"dppo-trl is tested with trl{spec}, found {trl.__version__}"


@pytest.mark.parametrize("name", sorted(trl_contract.OVERRIDDEN_METHODS))
def test_overridden_methods_exist_with_expected_parameters(name):
    params = list(inspect.signature(getattr(GRPOTrainer, name)).parameters)
    expected = trl_contract.OVERRIDDEN_METHODS[name]
    assert params[: len(expected)] == list(expected), f"GRPOTrainer.{name} signature changed: {params}"
    assert name in _own_overrides(), f"DPPOTrainer no longer overrides {name}: update trl_contract.py"


def _own_overrides() -> set[str]:
    """The GRPOTrainer methods DPPOTrainer or its TRL 1.16 room (`HookedGRPOTrainer`) override."""
    own = set()
    for cls in DPPOTrainer.__mro__[: DPPOTrainer.__mro__.index(GRPOTrainer)]:
        own |= {
            name
            for name, value in cls.__dict__.items()
            if (callable(value) or isinstance(value, staticmethod))
            and hasattr(GRPOTrainer, name)
            and not name.startswith("__")
        }
    return own


def test_dppo_overrides_only_the_listed_seams():
    own = _own_overrides()
    listed = set(trl_contract.OVERRIDDEN_METHODS) | set(trl_contract.HARDENING_OVERRIDDEN_METHODS)
    assert own == listed, f"unlisted GRPOTrainer overrides: {own - listed}"


@pytest.mark.parametrize("name", sorted(trl_contract.HARDENING_OVERRIDDEN_METHODS))
def test_both_trainers_override_the_hardening_methods(name):
    """The hardening is one piece (dppo_trl/hardening/) wired into the same methods of both trainers, once (the
    rooms' common base)."""
    from dppo_trl.trainers.async_dppo_trainer import AsyncDPPOTrainer
    from dppo_trl.trainers.trl116.common import CommonRoom

    expected = list(trl_contract.HARDENING_OVERRIDDEN_METHODS[name])
    for parent, trainer in ((GRPOTrainer, DPPOTrainer), (_async_module().AsyncGRPOTrainer, AsyncDPPOTrainer)):
        params = list(inspect.signature(getattr(parent, name)).parameters)
        assert params[: len(expected)] == expected, f"{parent.__name__}.{name} signature changed: {params}"
        assert name in CommonRoom.__dict__ and CommonRoom in trainer.__mro__, (
            f"{trainer.__name__}: update trl_contract"
        )


def test_compute_loss_source_keeps_the_composition_points():
    source = inspect.getsource(GRPOTrainer._compute_loss)
    for fragment in trl_contract.COMPUTE_LOSS_FRAGMENTS:
        assert fragment in source, f"GRPOTrainer._compute_loss changed: missing {fragment!r}"
    assert source.count("self._get_per_token_logps_and_entropies(") == 1, "GRPOTrainer's loss makes one policy pass"


def test_compute_loss_source_keeps_the_aggregation_the_mu_kl_term_reproduces():
    source = inspect.getsource(GRPOTrainer._compute_loss)
    for fragment in trl_contract.LOSS_AGGREGATION_FRAGMENTS:
        assert fragment in source, f"GRPOTrainer._compute_loss aggregation changed: missing {fragment!r}"


def test_per_token_logps_pass_uses_fused_head_and_returns_three_values():
    source = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    for fragment in trl_contract.PER_TOKEN_LOGPS_FRAGMENTS:
        assert fragment in source, f"_get_per_token_logps_and_entropies changed: missing {fragment!r}"
    assert "return logps, entropies, aux_loss" in source
    assert trl_contract.PER_TOKEN_LOGPS_ARITY == 3
    head_source = inspect.getsource(trl_utils.add_fused_lm_head)
    for fragment in trl_contract.FUSED_HEAD_FRAGMENTS:
        assert fragment in head_source, f"add_fused_lm_head changed: missing {fragment!r}"


def test_fused_head_logit_transform_order_matches_ours():
    """Our top-K gather re-applies the head's transform; TRL must still read these config fields."""
    head_source = inspect.getsource(trl_utils.add_fused_lm_head)
    for field in (
        "final_logit_softcapping",
        "logit_scale",
        "output_multiplier",
        "lm_head_multiplier",
        "logits_scaling",
    ):
        assert field in head_source, f"add_fused_lm_head no longer reads {field!r}: update LogitTransform"


def test_vllm_generation_contract():
    params = list(inspect.signature(vllm_generation.VLLMGeneration.generate).parameters)
    assert params == list(trl_contract.VLLM_GENERATE_PARAMS)
    source = inspect.getsource(vllm_generation.VLLMGeneration.generate)
    for fragment in trl_contract.VLLM_GENERATE_FRAGMENTS:
        assert fragment in source, f"VLLMGeneration.generate changed: missing {fragment!r}"
    assert trl_contract.VLLM_COLOCATE_LOGPROBS_MODE in inspect.getsource(vllm_generation.VLLMGeneration), (
        "TRL's colocate engine no longer asks for processed log-probs: the kept set cannot be read from them"
    )
    single_turn = inspect.getsource(GRPOTrainer._generate_single_turn)
    for fragment in trl_contract.GENERATE_SINGLE_TURN_FRAGMENTS:
        assert fragment in single_turn, f"GRPOTrainer._generate_single_turn changed: missing {fragment!r}"


def test_engine_weights_are_synced_before_each_generation_of_a_new_step():
    """The weight-sync check's notion of a fresh batch: GRPOTrainer syncs the engine whenever the optimizer step
    changed and then records the step, on both generation paths; `__init__` starts the record at -1."""
    assert f"self.{trl_contract.WEIGHT_SYNC_ATTRIBUTE} = -1" in inspect.getsource(GRPOTrainer.__init__)
    condition, sync, record = trl_contract.WEIGHT_SYNC_FRAGMENTS
    for method in (GRPOTrainer._generate_single_turn, GRPOTrainer._generate):  # `_generate`: the rollout_func path
        source = inspect.getsource(method)
        for fragment in (condition, sync, record):
            assert fragment in source, f"GRPOTrainer.{method.__name__} changed: missing {fragment!r}"
        assert source.index(condition) < source.index(sync) < source.index(record)


def test_tool_loop_contract_for_topk_placement():
    source = inspect.getsource(vllm_generation.VLLMGeneration.generate)
    for fragment in trl_contract.VLLM_GENERATE_PROMPT_FRAGMENTS:
        assert fragment in source, f"VLLMGeneration.generate changed: missing {fragment!r}"
    loop = inspect.getsource(GRPOTrainer._tool_call_loop)
    for fragment in trl_contract.TOOL_LOOP_FRAGMENTS:
        assert fragment in loop, f"GRPOTrainer._tool_call_loop changed: missing {fragment!r}"


def test_context_fit_contract():
    source = inspect.getsource(vllm_generation.VLLMGeneration.generate)
    for fragment in trl_contract.VLLM_GENERATE_CONTEXT_FRAGMENTS:
        assert fragment in source, f"VLLMGeneration.generate changed: missing {fragment!r}"
    loop = inspect.getsource(GRPOTrainer._tool_call_loop)
    for fragment in trl_contract.TOOL_LOOP_CONTEXT_FRAGMENTS:
        assert fragment in loop, f"GRPOTrainer._tool_call_loop changed: missing {fragment!r}"


def test_generation_batch_keys_are_produced():
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for key in trl_contract.GENERATION_OUTPUT_KEYS + trl_contract.GENERATION_OPTIONAL_KEYS:
        assert f'"{key}"' in source, f"_generate_and_score_completions no longer produces {key!r}"


def test_dppo_fields_do_not_shadow_grpo_fields():
    """GRPOConfig's fields are public API (read by every config test); pinned here: the trust-region fields, declared
    once in `TrustRegionFields`, and DPPOConfig's own never shadow one of GRPOConfig's (e.g. GRPO's `delta`)."""
    from dppo_trl.trainers.config import TrustRegionFields

    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    shared = {f.name for f in dataclasses.fields(TrustRegionFields)}
    assert not shared & grpo
    assert {f.name for f in dataclasses.fields(DPPOConfig)} - grpo == shared | {
        "vllm_server_request_timeout",
        "vllm_cpu_dtype",
        "vllm_cpu_engine_kwargs",
        "kept_set_logprobs",
    }


def test_trainer_attributes_are_set_by_grpo_init():
    source = inspect.getsource(GRPOTrainer.__init__)
    for attr in trl_contract.TRAINER_ATTRIBUTES + trl_contract.VLLM_TRAINER_ATTRIBUTES:
        if attr in ("_metrics", "current_gradient_accumulation_steps"):
            continue  # set by transformers.Trainer / checked at run time by the trainer tests
        assert f"self.{attr} =" in source, f"GRPOTrainer.__init__ no longer sets self.{attr}"


def test_utils_exist():
    for name in trl_contract.UTILS:
        assert callable(getattr(trl_utils, name, None)), f"trl.trainer.utils.{name} is gone"


def test_batch_major_keys_survive_shuffle_and_split():
    batch, length, slots = 6, 5, 4
    data = {
        "prompt_ids": torch.arange(batch).unsqueeze(1).repeat(1, 3),
        "completion_ids": torch.arange(batch * length).view(batch, length),
        "dppo_behavior_topk_ids": torch.arange(batch * length * slots).view(batch, length, slots),
        "num_items_in_batch": torch.tensor(30),
    }
    shuffled = trl_utils.shuffle_sequence_dict(data)
    for part in trl_utils.split_tensor_dict(shuffled, 3):
        rows = part["completion_ids"][:, 0] // length
        expected = torch.arange(batch * length * slots).view(batch, length, slots)[rows]
        assert torch.equal(part["dppo_behavior_topk_ids"], expected)
        assert part["num_items_in_batch"].item() == 30


def test_checkpoint_staging_seams():
    from transformers import Trainer

    source = inspect.getsource(Trainer._save_checkpoint)
    for fragment in trl_contract.TRAINER_SAVE_CHECKPOINT_FRAGMENTS:
        assert fragment in source, f"Trainer._save_checkpoint changed: missing {fragment!r}"
    for parent in (GRPOTrainer, _async_module().AsyncGRPOTrainer):
        source = inspect.getsource(parent._save_checkpoint)
        for fragment in trl_contract.GRPO_SAVE_CHECKPOINT_FRAGMENTS:
            assert fragment in source, f"{parent.__name__}._save_checkpoint changed: missing {fragment!r}"


def test_generation_cycle_is_counted_in_training_steps():
    source = inspect.getsource(GRPOTrainer._prepare_inputs)
    for fragment in trl_contract.PREPARE_INPUTS_FRAGMENTS:
        assert fragment in source, f"GRPOTrainer._prepare_inputs changed: missing {fragment!r}"


def test_model_card_template_parts():
    from importlib.resources import files

    template = files("trl").joinpath("templates/lm_model_card.md").read_text(encoding="utf-8")
    for fragment in trl_contract.MODEL_CARD_TEMPLATE_FRAGMENTS:
        assert fragment in template, f"TRL's model card template changed: missing {fragment!r}"


def test_vllm_server_mode_contract():
    pytest.importorskip("vllm")
    import importlib
    import importlib.util

    from trl.generation import vllm_client

    assert getattr(vllm_generation, trl_contract.VLLM_GENERATION_CLIENT_SYMBOL) is not None
    init_source = inspect.getsource(vllm_generation.VLLMGeneration._init_vllm)
    for fragment in trl_contract.VLLM_INIT_SERVER_FRAGMENTS:
        assert fragment in init_source, f"VLLMGeneration._init_vllm changed: missing {fragment!r}"
    sync_source = inspect.getsource(vllm_generation.VLLMGeneration.sync_weights)
    for fragment in trl_contract.VLLM_SERVER_SYNC_FRAGMENTS:
        assert fragment in sync_source, f"VLLMGeneration.sync_weights changed: missing {fragment!r}"
    client_init = inspect.getsource(vllm_client.VLLMClient.__init__)
    session, check = (client_init.index(f) for f in trl_contract.VLLM_CLIENT_INIT_FRAGMENTS)
    assert session < check and "self._get(" in client_init[check:], "VLLMClient.__init__ request order changed"
    assert "self._get(" not in client_init[:check] and "self._post(" not in client_init[:check]
    for name, expected in trl_contract.VLLM_CLIENT_METHODS.items():
        params = list(inspect.signature(getattr(vllm_client.VLLMClient, name)).parameters)
        assert params[: len(expected)] == list(expected), f"VLLMClient.{name} signature changed: {params}"

    assert importlib.util.find_spec(trl_contract.VLLM_SERVER_MODULE) is not None
    rpc = importlib.import_module(trl_contract.VLLM_RPC_ROUTE_MODULE)
    assert "/collective_rpc" in {route.path for route in rpc.router.routes}
    from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    params = list(inspect.signature(GPUModelRunner.reload_weights).parameters)
    assert params == list(trl_contract.VLLM_RELOAD_PARAMS)
    # The security note in docs/recipes.md says the API key does not guard the dev endpoints; re-check if this changes.
    assert tuple(GUARDED_PREFIX) == trl_contract.VLLM_API_KEY_GUARDED_PREFIXES


def test_the_old_logps_pass_dppo_declines_is_the_first_pass_of_generation():
    """`DPPOTrainer._parent_recomputes_old_logps` restates TRL's condition, and the pass it declines is π_old."""
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for fragment in trl_contract.OLD_LOGPS_RECOMPUTE_FRAGMENTS:
        assert fragment in source, f"GRPOTrainer's π_old recompute condition changed: missing {fragment!r}"
    first_pass = source.index("self._get_per_token_logps_and_entropies(")
    assert source.index(trl_contract.OLD_LOGPS_PASS) + len("old_per_token_logps, _, _ = ") == first_pass


def test_liger_errors_and_kernels_are_where_dppo_expects_them():
    """GRPOTrainer raises its Liger-related errors in `__init__`; transformers applies the kernels in `train()`."""
    from transformers import Trainer

    init = inspect.getsource(GRPOTrainer.__init__)
    for fragment in trl_contract.LIGER_GRPO_INIT_FRAGMENTS:
        assert fragment in init, f"GRPOTrainer.__init__ changed: missing {fragment!r}"
    assert trl_contract.LIGER_APPLY_FRAGMENT in inspect.getsource(Trainer.train)
    assert trl_contract.LIGER_APPLY_FRAGMENT not in inspect.getsource(Trainer.__init__)
    import transformers.trainer

    module, _, name = trl_contract.LIGER_APPLY_FUNCTION.rpartition(".")
    assert transformers.trainer.apply_liger_kernel is getattr(importlib.import_module(module), name)


def test_get_off_policy_mask_called_on_the_class_is_trls():
    """Outside a DPPO loss call, `DPPOTrainer.get_off_policy_mask` is TRL's static OPSM hook: same signature, same
    values (issue 22: an instance method there broke callers that use it on the class)."""
    generator = torch.Generator().manual_seed(0)
    logps = -torch.rand(4, 5, generator=generator) * 3
    sampling = logps + torch.randn(4, 5, generator=generator)
    sampling[1, 2] = float("nan")
    mask = torch.ones(4, 5)
    mask[2, 3:] = 0
    advantages = torch.tensor([[1.0], [-1.0], [-0.5], [0.0]])
    ours, trls = (inspect.signature(c.get_off_policy_mask).parameters for c in (DPPOTrainer, GRPOTrainer))
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [(p.name, p.kind, p.default) for p in trls.values()]
    for threshold in (0.0, 0.1, 1.0, 10.0):
        kwargs = dict(
            advantages=advantages,
            per_token_logps=logps,
            sampling_per_token_logps=sampling,
            mask=mask,
            off_policy_threshold=threshold,
        )
        want = GRPOTrainer.get_off_policy_mask(**kwargs)
        assert torch.equal(DPPOTrainer.get_off_policy_mask(**kwargs), want)
        assert torch.equal(DPPOTrainer.get_off_policy_mask(*kwargs.values()), want)  # positional, as TRL's


# ---------------------------------------------------------------------------------------------------------------------
# Asynchronous trainer (dppo_trl/trainers/async_dppo_trainer.py, dppo_trl/backends/cpu/async_cpu.py)
# ---------------------------------------------------------------------------------------------------------------------


def _async_module():
    import importlib

    return importlib.import_module(trl_contract.ASYNC_MODULE)


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


def test_fault_handling_internals():
    """transformers' SIGTERM checkpointing and TRL's client session, as `dppo_trl/hardening/preemption.py` and
    `dppo_trl/backends/cpu/` use them."""
    from transformers import trainer_jit_checkpoint
    from trl.generation import vllm_client

    jit_source = inspect.getsource(trainer_jit_checkpoint)
    for fragment in trl_contract.JIT_CHECKPOINT_FRAGMENTS:
        assert fragment in jit_source, f"transformers' JIT checkpoint changed: missing {fragment!r}"
    client_source = inspect.getsource(vllm_client.VLLMClient.__init__)
    for fragment in trl_contract.VLLM_CLIENT_RETRY_FRAGMENTS:
        assert fragment in client_source, f"VLLMClient.__init__ changed: missing {fragment!r}"
    assert trl_contract.VLLM_SYNC_CALL_FRAGMENT in inspect.getsource(GRPOTrainer)
    for symbol in ("LLM", "VLLMClient"):
        assert hasattr(vllm_generation, symbol), f"trl.generation.vllm_generation.{symbol} is gone"


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


def test_cli_uses_trls_parser_presets_rewards_and_vllm_serve():
    """What `dppo-trl` takes from TRL's CLI: the parser's remaining-strings split, the presets, the reward names and
    `trl vllm-serve`'s parser, fields and launcher."""
    from importlib import resources

    import trl.rewards
    from trl import TrlParser
    from trl.scripts import vllm_serve

    params = list(inspect.signature(TrlParser.parse_args_and_config).parameters)
    assert params[1:] == list(trl_contract.CLI_PARSER_PARAMETERS), params
    presets = {p.name for p in resources.files("trl.accelerate_configs").iterdir()}
    assert {f"{name}.yaml" for name in trl_contract.CLI_ACCELERATE_PRESETS} <= presets, presets
    for name in trl_contract.CLI_BUNDLED_REWARDS:
        assert callable(getattr(trl.rewards, name)), name
    fields = {f.name for f in dataclasses.fields(vllm_serve.ScriptArguments)}
    assert set(trl_contract.CLI_VLLM_SERVE_FIELDS) <= fields, set(trl_contract.CLI_VLLM_SERVE_FIELDS) - fields
    for name in trl_contract.CLI_VLLM_SERVE_FUNCTIONS:
        assert callable(getattr(vllm_serve, name)), name
    assert list(inspect.signature(vllm_serve.main).parameters) == ["script_args", "extra_args"]
