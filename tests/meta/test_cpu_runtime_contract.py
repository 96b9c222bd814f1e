"""The TRL internals vLLM's CPU runtime relies on (`dppo_trl/backends/cpu/`), each with its reason in
`tests/trl_contract.py` ("CPU runtime" and "vLLM server mode on a CPU trainer")."""

import inspect

import pytest
import trl_contract


def _colocate_llm_call(source: str) -> str:
    start = source.index(trl_contract.VLLM_INIT_COLOCATE_FRAGMENTS[0])
    return source[start : source.index("\n            )", start)]


def test_colocate_engine_is_built_through_the_module_symbol_without_cpu_arguments():
    pytest.importorskip("vllm")
    import trl.generation.vllm_generation as vllm_generation

    assert hasattr(vllm_generation, "LLM"), "trl.generation.vllm_generation.LLM is gone"
    source = inspect.getsource(vllm_generation.VLLMGeneration._init_vllm)
    for fragment in trl_contract.VLLM_INIT_COLOCATE_FRAGMENTS:
        assert fragment in source, f"VLLMGeneration._init_vllm changed: missing {fragment!r}"
    call = _colocate_llm_call(source)
    for argument in trl_contract.CPU_ENGINE_ARGUMENTS_TRL_DOES_NOT_PASS:
        assert argument not in call, f"TRL now passes {argument!r} to vllm.LLM: the CPU default no longer applies"
    params = inspect.signature(vllm_generation.VLLMGeneration.__init__).parameters
    engine_kwargs = [name for name in params if name.endswith("kwargs") and name != "generation_kwargs"]
    assert not engine_kwargs, f"VLLMGeneration takes {engine_kwargs} now: pass EngineOptions there, drop the swap"


def test_async_peak_flops_lookup_is_a_module_symbol():
    pytest.importorskip("trl.experimental.async_grpo")
    from trl.experimental.async_grpo import async_grpo_trainer

    from dppo_trl.backends.cpu.async_cpu import cpu_peak_flops

    original = getattr(async_grpo_trainer, trl_contract.ASYNC_PEAK_FLOPS_SYMBOL)
    with cpu_peak_flops():
        assert getattr(async_grpo_trainer, trl_contract.ASYNC_PEAK_FLOPS_SYMBOL)(None, "float32") is None
    assert getattr(async_grpo_trainer, trl_contract.ASYNC_PEAK_FLOPS_SYMBOL) is original
