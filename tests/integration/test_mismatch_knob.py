"""The research-only mismatch knob (`benchmarks/sanity/mismatch.py`): exact quantizers, and the real engine sees them.

The quantizers are checked against independent NumPy references and their error bounds; the engine tests sync the
perturbed weights into a real vLLM (CPU, fp32) engine and compare its log-probs with an HF model holding the
reference-perturbed weights, so what the engine samples from is exactly the configured rounding.
"""

import os

import numpy as np
import pytest
import torch
from mismatch import (  # benchmarks/sanity (pytest's pythonpath)
    EngineMismatch,
    WeightMismatch,
    engine_config_fields,
    fake_quant_e4m3,
    fake_quant_int8,
    install_weight_mismatch,
    parse_level,
    relative_noise,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(REPO_ROOT, "examples", "tiny_math_model")


def _weights(seed: int = 0, shape=(96, 64)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of very different magnitude (and one all-zero row): a per-tensor scale would fail the per-channel bounds.
    w = torch.randn(shape, generator=g) * torch.logspace(-4, 1, shape[0]).unsqueeze(1)
    w[3] = 0.0
    return w


def _ref_int8(w: np.ndarray) -> np.ndarray:
    amax = np.abs(w).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax, np.float32(1)).astype(np.float32) / np.float32(127)
    return (np.clip(np.round(w / scale), -127, 127) * scale).astype(np.float32)


def _ref_e4m3(x: np.ndarray) -> np.ndarray:
    """fp8 e4m3 (3 mantissa bits, min normal 2^-6, max 448) round-to-nearest-even of already-scaled values."""
    a = np.abs(x.astype(np.float64))
    exponent = np.maximum(np.floor(np.log2(np.maximum(a, 2.0**-12))), -6)  # below 2^-6: fixed subnormal spacing
    step = 2.0 ** (exponent - 3)
    return (np.sign(x) * np.minimum(np.round(a / step) * step, 448.0)).astype(np.float32)


def test_parse_and_labels():
    assert WeightMismatch.parse("none").off and WeightMismatch.parse(None).off
    assert WeightMismatch.parse("int8") == WeightMismatch(quant="int8")
    assert WeightMismatch.parse("noise=0.3", seed=2) == WeightMismatch(noise=0.3, seed=2)
    assert WeightMismatch.parse("e4m3+noise=1e-2") == WeightMismatch(quant="e4m3", noise=0.01)
    assert WeightMismatch.parse("e4m3+noise=0.01").label == "e4m3+noise=0.01"
    assert WeightMismatch.parse("noise=0.5").label == "noise=0.5"
    for bad in ("int4", "noise=", "noise=-1", "fp8", "int8+e4m3"):
        with pytest.raises(ValueError, match="mismatch"):
            WeightMismatch.parse(bad)


def test_parse_level_splits_engine_and_weight_parts():
    assert parse_level("none") == (WeightMismatch(), EngineMismatch())
    assert parse_level("noise=0.3", seed=1) == (WeightMismatch(noise=0.3, seed=1), EngineMismatch())
    assert parse_level("kv=fp8_e5m2") == (WeightMismatch(), EngineMismatch(kv_cache_dtype="fp8_e5m2"))
    assert parse_level("dtype=float16+kv=fp8") == (WeightMismatch(), EngineMismatch("fp8", "float16"))
    assert parse_level("int8+noise=0.1+kv=fp8") == (WeightMismatch("int8", 0.1), EngineMismatch("fp8"))
    assert EngineMismatch().off and EngineMismatch().llm_kwargs() == {}
    assert EngineMismatch("fp8", "float16").llm_kwargs() == {"kv_cache_dtype": "fp8", "dtype": "float16"}
    for bad in ("kv=fp4", "dtype=int8", "kv=", "kv=fp8+kv=fp8_e5m2", "kv=fp8+int4"):
        with pytest.raises(ValueError, match="mismatch"):
            parse_level(bad)


def test_engine_settings_reach_the_engine_through_the_config(tmp_path):
    """The engine part of a level is a config field (`vllm_cpu_engine_kwargs`): nothing of TRL's is swapped for it,
    and its arguments win over TRL's and the CPU defaults when the engine is built.

    (Its effect on a real engine is recorded per run: `run.py` stores the engine's own `cache_config.cache_dtype`.)
    """
    from dppo_trl import DPPOConfig
    from dppo_trl.backends.cpu.engine import EngineOptions, cpu_llm_factory

    assert engine_config_fields(EngineMismatch()) == {}
    fields = engine_config_fields(EngineMismatch(kv_cache_dtype="fp8", dtype="float16"))
    config = DPPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **fields)
    options = EngineOptions.from_config(config)
    assert options.extra == {"kv_cache_dtype": "fp8", "dtype": "float16"}
    built = {}
    cpu_llm_factory(lambda **kwargs: built.update(kwargs), options)(model="m", dtype="auto", max_num_seqs=4)
    assert built["kv_cache_dtype"] == "fp8" and built["dtype"] == "float16" and built["max_num_seqs"] == 4
    assert built["enforce_eager"] and built["kv_cache_memory_bytes"] == options.kv_cache_memory_bytes


def test_int8_is_per_channel_symmetric_and_matches_reference():
    w = _weights()
    q, scale = fake_quant_int8(w)
    assert scale.shape == (w.shape[0], 1)
    # Round-to-nearest: at most half a quantization step per channel (plus fp32 rounding of the product).
    assert ((w - q).abs() <= scale / 2 * (1 + 1e-6)).all()
    levels = q / scale
    assert torch.allclose(levels, levels.round(), atol=1e-4) and levels.abs().max() <= 127 + 1e-4
    np.testing.assert_array_equal(q.numpy(), _ref_int8(w.numpy()))
    assert torch.equal(q[3], torch.zeros_like(q[3]))
    assert WeightMismatch(quant="int8").perturb("x.weight", w).equal(q)


def test_e4m3_is_per_channel_scaled_fp8_and_matches_reference():
    w = _weights(1)
    q, scale = fake_quant_e4m3(w)
    x = (w / scale).numpy()
    np.testing.assert_array_equal(q.numpy(), _ref_e4m3(x) * scale.numpy())
    # Half an ulp: 2^-4 relative for normal values, 2^-10 of the scale in the subnormal range.
    bound = torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert ((w - q).abs() <= bound).all()
    assert (q.abs().amax(dim=1) <= 448 * scale.squeeze(1) * (1 + 1e-6)).all()
    assert not torch.equal(q, fake_quant_int8(w)[0])
    assert WeightMismatch(quant="e4m3").perturb("x.weight", w).equal(q)


def test_noise_has_the_configured_relative_std_and_is_fixed_per_tensor():
    w = _weights(2, shape=(128, 256))
    rms = w.pow(2).mean(dim=1, keepdim=True).sqrt()
    rms[3] = 1.0  # the zero row gets zero noise
    knob = WeightMismatch(noise=0.05, seed=7)
    delta = knob.perturb("model.layers.0.mlp.up_proj.weight", w) - w
    z = (delta / rms)[torch.arange(128) != 3]
    assert abs(z.std().item() - 0.05) < 0.05 * 0.02  # 32k samples: sampling error of the std ~0.4%
    assert abs(z.mean().item()) < 0.05 * 0.02
    per_channel = z.std(dim=1) / 0.05
    assert per_channel.min() > 0.8 and per_channel.max() < 1.2  # scaled per channel, not per tensor
    assert torch.equal(delta[3], torch.zeros_like(delta[3]))
    # The same tensor gets the same pattern at every sync; other tensors and seeds get other patterns.
    assert torch.equal(knob.perturb("model.layers.0.mlp.up_proj.weight", w), delta + w)
    assert not torch.equal(knob.perturb("model.layers.1.mlp.up_proj.weight", w), delta + w)
    assert not torch.equal(
        WeightMismatch(noise=0.05, seed=8).perturb("model.layers.0.mlp.up_proj.weight", w), delta + w
    )
    torch.testing.assert_close(relative_noise(w, 0.05, knob.tensor_seed("model.layers.0.mlp.up_proj.weight")), delta)


def test_vectors_and_off_pass_through_untouched():
    norm = torch.rand(64)
    assert WeightMismatch(quant="int8", noise=0.5).perturb("model.norm.weight", norm) is norm
    w = _weights()
    assert WeightMismatch().perturb("x.weight", w) is w
    out = WeightMismatch(quant="e4m3").perturb("x.weight", w.double())
    assert out.dtype == torch.float64  # the engine receives the dtype the trainer sends


# ---------------------------------------------------------------------------------------------------------------------
# Through the real engine (vLLM CPU, fp32 so that only the configured perturbation separates engine and trainer)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer():
    from dppo_trl.backends.cpu.platform import is_vllm_cpu_platform

    if not is_vllm_cpu_platform():
        pytest.skip("needs the CPU build of vLLM")
    if not os.path.isdir(MODEL):
        pytest.skip("examples/tiny_math_model is not built")
    from conftest import get_free_port
    from transformers import AutoTokenizer

    from dapo_math.data import load_dapo_math
    from dapo_math.rewards import accuracy_reward
    from dppo_trl import DPPOConfig, DPPOTrainer

    # DPPOConfig's default engine dtype is float32: parity with the trainer to ~1e-7 when the knob is off.
    with pytest.MonkeyPatch.context() as mp, __import__("tempfile").TemporaryDirectory() as tmp:
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(get_free_port()))
        config = DPPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            per_device_train_batch_size=16,
            num_generations=4,
            max_completion_length=12,
            max_steps=1,
            learning_rate=1e-3,
            use_vllm=True,
            vllm_mode="colocate",
            vllm_max_model_length=160,
            seed=0,
        )
        yield DPPOTrainer(
            model=MODEL,
            reward_funcs=[accuracy_reward],
            args=config,
            train_dataset=load_dapo_math(
                os.path.join(REPO_ROOT, "examples", "data", "tiny_math", "train.jsonl"), split="train", max_samples=8
            ),
            processing_class=AutoTokenizer.from_pretrained(MODEL),
        )


def _sequences(trainer) -> list[list[int]]:
    """Chat-formatted problems with their answers: tokens the trained model is confident about (realistic logps)."""
    tok = trainer.processing_class
    rows = trainer.train_dataset.select(range(4))
    texts = [
        tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        + f"Answer: {r['ground_truth']}"
        for r in rows
    ]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _engine_logps(trainer, seqs) -> torch.Tensor:
    from vllm import SamplingParams

    outs = trainer.vllm_generation.llm.generate(
        [{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    )
    return torch.cat(
        [torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])]) for o, s in zip(outs, seqs)]
    )


def _hf_logps(model, seqs) -> torch.Tensor:
    parts = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            parts.append(logps.gather(-1, ids[0, 1:, None])[:, 0])
    return torch.cat(parts)


def _reference_model(trainer, transform):
    """A fresh HF copy of the trainer's weights whose matrices are replaced by `transform(name, w)`.

    Fresh, not `deepcopy(trainer.model)`: TRL swaps in a fused LM-head `forward` bound to the original module.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    model.load_state_dict(trainer.model.state_dict())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.copy_(transform(name, param.detach()))
    return model


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_receives_exactly_the_configured_weights(trainer):
    seqs = _sequences(trainer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    exact = _hf_logps(_reference_model(trainer, lambda name, w: w), seqs)

    def ref_int8(name, w):
        return torch.from_numpy(_ref_int8(w.numpy()))

    def ref_e4m3(name, w):
        _, scale = fake_quant_e4m3(w)
        return torch.from_numpy(_ref_e4m3((w / scale).numpy())) * scale

    noise = WeightMismatch(noise=0.3, seed=0)

    def ref_noise(name, w):
        return w + relative_noise(w, 0.3, noise.tensor_seed(name))

    cases = [
        (WeightMismatch(quant="int8"), ref_int8),
        (WeightMismatch(quant="e4m3"), ref_e4m3),
        (noise, ref_noise),
    ]
    for knob, reference in cases:
        install_weight_mismatch(trainer, knob)
        trainer.vllm_generation.sync_weights()
        engine = _engine_logps(trainer, seqs)
        expected = _hf_logps(_reference_model(trainer, reference), seqs)
        # The engine holds the reference-perturbed weights (fp32 kernel parity ~1e-6) and not the trainer's.
        assert (engine - expected).abs().max() < 2e-5, knob
        assert (engine - exact).abs().max() > 20 * (engine - expected).abs().max(), knob

    # Off: TRL's own iterator again, so the engine gets the trainer's tensors unchanged. Log-probs down to -11 agree
    # to fp32 rounding (measured 7e-6 in log space, ~7e-7 relative; 1.1e-6 as probabilities).
    generation = trainer.vllm_generation
    install_weight_mismatch(trainer, WeightMismatch())
    assert generation._iter_named_params == generation._dppo_original_iter_named_params
    generation.sync_weights()
    engine = _engine_logps(trainer, seqs)
    assert (engine - exact).abs().max() <= 2e-5
    assert (engine.exp() - exact.exp()).abs().max() <= 2e-6
    # The trainer's weights were never touched by any of the perturbed syncs.
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name


@pytest.mark.vllm
@pytest.mark.slow
def test_first_generation_already_samples_from_perturbed_weights(trainer):
    """TRL syncs before the first generation (`_last_loaded_step = -1`), so μ of step 1 carries the mismatch."""
    install_weight_mismatch(trainer, WeightMismatch(noise=0.5))
    trainer.train()
    (fresh,) = [h["dppo/mismatch_abs_mean"] for h in trainer.state.log_history if "dppo/mismatch_abs_mean" in h]
    # Off, this is fp32 parity (~1e-7); the calibration for noise=0.5 gives a few 1e-2 on this model.
    assert fresh > 1e-3
    # The weight-sync check reads exactly this engine-side mismatch at the first step after the sync.
    assert [h["dppo/sync_mismatch"] for h in trainer.state.log_history if "dppo/sync_mismatch" in h] == [fresh]
