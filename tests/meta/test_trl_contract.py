"""Contract tests: the TRL internals listed in `tests/trl_contract.py` still look the way DPPOTrainer expects."""

import dataclasses
import importlib
import inspect

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
# Both trainers' fault handling and the CLI; the asynchronous trainer's contract is test_trl_contract_async.py
# ---------------------------------------------------------------------------------------------------------------------


def _async_module():
    import importlib

    return importlib.import_module(trl_contract.ASYNC_MODULE)


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
