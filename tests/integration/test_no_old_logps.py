"""No π_old pass when μ comes from the engine: GRPOTrainer recomputes π_old while generating whenever
`gradient_accumulation_steps % (steps_per_generation · num_iterations) != 0`; DPPO anchors on μ and declines it.

Two real vLLM colocate trainers serve the module (binary without a reference model, top-K with β > 0). Each test sets
the GA / `steps_per_generation` / `num_iterations` shape on the trainer (the parent reads them when it generates) and
calls `_generate_and_score_completions` on one generation batch. "Before" is the same call with the skip turned off.
The ablations that need π_old are reached on the binary trainer by setting `anchor` / `trust_region` on its config:
nothing `__init__` builds depends on them for a binary divergence. Server mode is in `tests/system/test_vllm_server.py`.
"""

import math

import pytest
import torch
from forward_count import count_generation_passes
from trainer_setup import PROMPTS, make_trainer

from dppo_trl.trainers.dppo_trainer import BEHAVIOR_LOGPS, BEHAVIOR_VALID

TINY_GROUPS = [{"prompt": p} for p in PROMPTS[:2] for _ in range(4)]  # 2 prompts x num_generations=4
VLLM = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64)
# (gradient_accumulation_steps, steps_per_generation, num_iterations) -> does TRL recompute π_old?
SHAPES = {
    "example-default": ((1, 8, 1), True),  # examples/train_dapo_math.py with no arguments
    "gpu-recipe": ((16, 128, 1), True),  # qwen3_1.7b_base_dapo_math.yaml
    "num-iterations-2": ((1, 1, 2), True),
    "aligned": ((4, 4, 1), False),
}


@pytest.fixture(scope="module")
def engine_env():
    from conftest import get_free_port

    with pytest.MonkeyPatch.context() as env:  # TRL's colocate engine reads them; a port of our own
        env.setenv("MASTER_ADDR", "127.0.0.1")
        env.setenv("MASTER_PORT", str(get_free_port()))
        yield


@pytest.fixture(scope="module")
def binary(engine_env, tiny_model_dir, tmp_path_factory):
    trainer = make_trainer(tiny_model_dir, tmp_path_factory.mktemp("binary"), divergence="binary_tv", **VLLM)
    trainer.model.train()
    return trainer


@pytest.fixture(scope="module")
def topk_with_ref(engine_env, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("topk")
    trainer = make_trainer(tiny_model_dir, out, divergence="topk_tv", divergence_top_k=4, beta=0.04, **VLLM)
    trainer.model.train()
    return trainer


def _generate(trainer, monkeypatch, shape, skip=True):
    """One generation batch at `shape`; returns (the batch, the pass kinds made while generating it)."""
    ga, spg, iterations = shape
    monkeypatch.setattr(trainer.args, "gradient_accumulation_steps", ga)
    monkeypatch.setattr(trainer.args, "steps_per_generation", spg)
    # A trainer built with `num_iterations=iterations` has it in both places: TRL reads its attribute, DPPO the config.
    monkeypatch.setattr(trainer, "num_iterations", iterations)
    monkeypatch.setattr(trainer.args, "num_iterations", iterations)
    if not skip:
        monkeypatch.setattr(trainer, "_discards_parent_old_logps", lambda: False)
    with count_generation_passes() as passes:
        output = trainer._generate_and_score_completions(TINY_GROUPS)
    assert type(trainer.num_iterations) is int and trainer.num_iterations == iterations  # never overridden
    assert trainer._decline_old_pass is False
    monkeypatch.undo()
    return output, passes.batches[0]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_engine_mu_needs_no_policy_pass(binary, monkeypatch, name):
    shape, trl_recomputes = SHAPES[name]
    _, before = _generate(binary, monkeypatch, shape, skip=False)
    output, after = _generate(binary, monkeypatch, shape)
    print(
        f"\n{name} (GA, spg, num_iterations)={shape}: policy passes per generation batch {len(before)} -> {len(after)}"
    )
    assert before == (["policy"] if trl_recomputes else [])
    assert after == []
    # No π_old in the batch: the anchor is μ, which the room writes into the parent's slot for its loss call only.
    assert output.get("old_per_token_logps") is None
    mu = torch.where(output[BEHAVIOR_VALID], output[BEHAVIOR_LOGPS], torch.full_like(output[BEHAVIOR_LOGPS], math.nan))
    torch.testing.assert_close(binary._anchor_logps(output), mu, atol=0, rtol=0, equal_nan=True)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", ["example-default", "num-iterations-2"])
def test_topk_with_reference_keeps_only_the_reference_pass(topk_with_ref, monkeypatch, name):
    shape, _ = SHAPES[name]
    _, before = _generate(topk_with_ref, monkeypatch, shape, skip=False)
    output, after = _generate(topk_with_ref, monkeypatch, shape)
    print(f"\ntop-K, beta>0, {name}: passes per generation batch {before} -> {after}")
    assert sorted(before) == ["policy", "ref"]
    assert after == ["ref"]  # β > 0 keeps its reference pass
    assert output["ref_per_token_logps"] is not None and "dppo_behavior_topk_ids" in output


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("setting", [("anchor", "recompute"), ("trust_region", "minirl")], ids=lambda s: s[1])
@pytest.mark.parametrize("name", ["example-default", "aligned"])
def test_ablations_that_need_pi_old_still_get_one_pass(binary, monkeypatch, setting, name):
    monkeypatch.setattr(binary.args, *setting)
    # The trainer reads the trust region from the spec it froze at construction.
    monkeypatch.setattr(binary, "trust_region_spec", binary.args.trust_region_spec())
    assert not binary._discards_parent_old_logps()
    _, passes = _generate(binary, monkeypatch, SHAPES[name][0])
    assert passes == ["policy"]


@pytest.mark.vllm
@pytest.mark.slow
def test_nothing_is_left_declined_when_generation_fails(binary, monkeypatch):
    def broken_rewards(*args, **kwargs):
        raise RuntimeError("reward server down")

    monkeypatch.setattr(binary, "_calculate_rewards", broken_rewards)
    with pytest.raises(RuntimeError, match="reward server down"):
        binary._generate_and_score_completions(TINY_GROUPS)
    assert type(binary.num_iterations) is int and binary.num_iterations == binary.args.num_iterations
    assert binary._decline_old_pass is False  # the next call into the parent is not declined


@pytest.mark.vllm
@pytest.mark.slow
def test_loss_and_gradient_do_not_depend_on_the_skipped_pass(binary, monkeypatch):
    """Before, the parent's π_old reached the batch and was replaced by μ; the loss and gradient are the same."""
    output, _ = _generate(binary, monkeypatch, SHAPES["example-default"][0])
    with torch.no_grad():
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        pi_old, _, _ = binary._get_per_token_logps_and_entropies(
            binary.model, input_ids, attention_mask, output["completion_ids"].size(1), batch_size=4
        )
    monkeypatch.setattr(binary, "current_gradient_accumulation_steps", 1, raising=False)  # set by Trainer.train
    with_pi_old = {**output, "old_per_token_logps": pi_old}  # what the parent put there before the skip

    def loss_and_grads(batch):
        binary.model.zero_grad()
        loss = binary.compute_loss(binary.model, batch)
        loss.backward()
        grads = [p.grad.clone() for p in binary.model.parameters() if p.grad is not None]
        binary.model.zero_grad()
        return loss.detach(), grads

    loss_now, grads_now = loss_and_grads(output)
    loss_before, grads_before = loss_and_grads(with_pi_old)
    assert torch.equal(loss_now, loss_before)
    assert grads_now and all(torch.equal(a, b) for a, b in zip(grads_now, grads_before, strict=True))


@pytest.mark.parametrize("spg", [1, 2])
def test_transformers_generation_keeps_its_recompute(tiny_model_dir, tmp_path, spg):
    """Without an engine, the parent's recompute of the generating weights *is* μ (off-policy), or μ ≡ π (on)."""
    trainer = make_trainer(tiny_model_dir, tmp_path, steps_per_generation=spg, max_steps=1)
    assert not trainer._discards_parent_old_logps()
    with count_generation_passes() as passes:
        trainer.train()
    assert passes.policy_counts() == [spg - 1]  # GA 1: off-policy exactly when spg > 1


def _example_default_argv(recipe_dir) -> list[str]:
    """`python examples/train_dapo_math.py` with no arguments, for one optimizer step and without its evaluation."""
    return ["--max_steps", "1", "--math_eval_datasets", "none", "--output_dir", str(recipe_dir)]


def _shrunk_recipe_argv(recipe_dir) -> list[str]:
    from test_recipes_shrunk import TINY_MODEL, _recipe_path, shrunk_argv

    argv, _ = shrunk_argv(_recipe_path("qwen3_8b_base_dapo_math.yaml"), TINY_MODEL, str(recipe_dir))
    return argv + ["--max_steps", "1", "--math_eval_datasets", "none", "--save_strategy", "no"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("argv", [_example_default_argv, _shrunk_recipe_argv], ids=["example-default", "gpu-recipe"])
def test_example_runs_generate_without_a_policy_pass(example, engine_env, tmp_path, argv):
    parsed = example.parse_args(argv(tmp_path))
    args = parsed[1]
    assert args.steps_per_generation > args.gradient_accumulation_steps  # TRL would recompute π_old here
    with count_generation_passes() as passes:
        trainer = example.main(*parsed)
    assert trainer.state.global_step == 1
    print(
        f"\n{argv.__name__}: GA {args.gradient_accumulation_steps}, spg {args.steps_per_generation}: {passes.batches}"
    )
    assert passes.policy_counts() == [0]
