"""Top-K DPPO in the asynchronous trainer: μ's top-K lists from the vLLM server, through TRL's rollout worker, queue
dataset, planner and collator, into the loss.

No server here: the reading of the server's `top_logprobs`, the placement of each sampled token's lists in TRL's
reconciled rows (CLEAN / REALIGN / FORK), the packed layout through TRL's own dataset, planner and collator, π at μ's
ids against a full-softmax reference, and the gradient against eq. 11 written out (top-K TV, and π_kept under
truncated sampling). The runs against the real server (`topk_tv`, truncated sampling: μ's lists of up-to-date samples
equal the trainer's π at the same ids to fp32 precision) are in test_async_server.py, which shares its server.
"""

from __future__ import annotations

import math
import queue

import numpy as np
import pytest
import torch
from test_async_dppo import TINY_MODEL, _config, _dataset, _tokenizer
from trainer_setup import byte_mean_reward

from dppo_trl.backends.cpu.async_cpu import cpu_tree_attention

K = 3


# ---------------------------------------------------------------------------------------------------------------------
# The server's lists, and where each sampled token lands in TRL's rows
# ---------------------------------------------------------------------------------------------------------------------


def test_completion_topk_reads_token_id_keys():
    from dppo_trl.trainers.trl116.async_topk import completion_topk

    choice = {
        "token_ids": [5, 6, 7],
        "logprobs": {
            "token_logprobs": [-0.5, -1.0, None],
            "top_logprobs": [
                {"token_id:5": -0.5, "token_id:9": -0.2, "token_id:2": -3.0},  # sampled not first in rank
                {"token_id:6": -1.0, "token_id:3": -9999.0, "token_id:4": -0.3},  # −9999 is the server's −inf
                None,  # the engine reported nothing: the sampled log-prob is NaN (counted invalid by the loss)
            ],
        },
    }
    ids, logps = completion_topk(choice, 2)
    assert ids.tolist() == [[5, 9, 2], [6, 4, 3], [7, -1, -1]]
    assert logps[0].tolist() == pytest.approx([-0.5, -0.2, -3.0])
    assert logps[1].tolist() == [-1.0, pytest.approx(-0.3), -math.inf]
    assert math.isnan(logps[2, 0]) and logps[2, 1:].tolist() == [-math.inf, -math.inf]
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        completion_topk({"token_ids": [5], "logprobs": {"top_logprobs": [{"a": -0.1}]}}, 2)


def _lists(output_ids: list[int], base: float) -> tuple[np.ndarray, np.ndarray]:
    """Distinct per-token lists: slot 0 the sampled id, slot 1 id 1000 + t, log-probs tagged by turn and token."""
    n = len(output_ids)
    ids = np.full((n, K + 1), -1, dtype=np.int64)
    logps = np.full((n, K + 1), -np.inf, dtype=np.float32)
    ids[:, 0], ids[:, 1] = output_ids, 1000 + np.arange(n)
    logps[:, 0], logps[:, 1] = base - np.arange(n), base - 10.0
    return ids, logps


def test_rows_topk_follows_trls_reconciler():
    """A clean append (tool result as context), a realign (the last reply's tail re-rendered: demoted to context) and
    a fork (a new row): each trained token of TRL's rows gets its own sampled token's lists, context none."""
    from trl.experimental.async_grpo.async_rollout_worker import TurnRecord, _chain_to_sequences

    from dppo_trl.trainers.trl116.async_topk import rows_topk

    turns = [
        TurnRecord([1, 2, 3], [10, 11, 12], [-0.1, -0.2, -0.3]),
        TurnRecord([1, 2, 3, 10, 11, 12, 50, 51], [20, 21], [-0.4, -0.5]),  # CLEAN: 50, 51 = tool result
        TurnRecord([1, 2, 3, 10, 11, 12, 50, 51, 20, 60], [30], [-0.6]),  # REALIGN: 21 re-rendered as 60
        TurnRecord([7, 7], [40, 41], [-0.7, -0.8]),  # FORK
    ]
    rows, tally = _chain_to_sequences(turns, "r", 1024)
    assert (tally["clean"], tally["realign"], tally["fork"]) == (1.0, 1.0, 1.0)
    lists = [_lists(t.output_ids, -float(i)) for i, t in enumerate(turns)]
    placed = rows_topk(list(zip(turns, lists)), rows, 1024)
    assert [p.input_ids for p in placed] == [r.input_ids for r in rows]
    assert placed[0].topk_ids[:, 0].tolist() == [10, 11, 12, 20, 30]
    assert placed[0].topk_ids[:, 1].tolist() == [1000, 1001, 1002, 1000, 1000]
    assert placed[0].topk_logps[:, 0].tolist() == [0.0, -1.0, -2.0, -1.0, -2.0]  # turn 0, 0, 0, 1, 2
    assert placed[1].topk_ids[:, 0].tolist() == [40, 41]
    assert placed[1].topk_logps[:, 0].tolist() == [-3.0, -4.0]
    # Rows that are not what these turns reconcile into are refused, not silently misaligned.
    with pytest.raises(RuntimeError, match="do not reconcile"):
        rows_topk(list(zip(turns[:3], lists[:3])), rows, 1024)


# ---------------------------------------------------------------------------------------------------------------------
# Through TRL's queue dataset, planner and collator into the loss
# ---------------------------------------------------------------------------------------------------------------------


class _QueueWorker:
    """An in-process rollout worker (TRL's `RolloutWorkerProtocol`): the test puts samples on `rollout_buffer`."""

    def __init__(self):
        self.rollout_buffer = queue.Queue()
        self.metrics_queue = queue.Queue()

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version):
        pass

    def check_health(self, stale_after_s):
        pass


def _topk_sample(index: int, version: int, prompt: list[int], completion: list[int]):
    from dppo_trl.trainers.trl116.async_topk import TopKRolloutSample

    ids = np.array(prompt + completion)
    mask = np.array([0] * len(prompt) + [1] * len(completion))
    rng = np.random.default_rng(index)
    mu = -rng.uniform(0.1, 3.0, size=len(completion))
    topk_ids = np.full((len(completion), K + 1), -1, dtype=np.int64)
    topk_logps = np.full((len(completion), K + 1), -np.inf, dtype=np.float32)
    topk_ids[:, 0], topk_logps[:, 0] = completion, mu
    for t in range(len(completion)):
        others = [v for v in rng.choice(200, size=K + 2, replace=False).tolist() if v != completion[t]][:K]
        topk_ids[t, 1:] = others
        topk_logps[t, 1:] = np.sort(-rng.uniform(0.5, 4.0, size=K))[::-1]
    return TopKRolloutSample(
        prompt=[],
        completion=[],
        input_ids=ids,
        completion_mask=mask,
        old_log_probs=np.concatenate([np.zeros(len(prompt)), mu]).astype(np.float32),
        advantage=[1.0, -1.0][index % 2],
        model_version=version,
        group_id=index // 2,  # two samples per group: they share the prompt in the packed row
        metrics={"reward": float(index)},
        topk_ids=topk_ids,
        topk_logps=topk_logps,
    )


class _Recorder:
    def __init__(self):
        self.calls = []


def _recording_trainer(recorder: _Recorder):
    from dppo_trl import AsyncDPPOTrainer

    class RecordingTrainer(AsyncDPPOTrainer):
        def _loss_inputs(self, inputs, forward):
            loss_inputs = super()._loss_inputs(inputs, forward)
            recorder.calls.append((loss_inputs, {k: v for k, v in inputs.items()}))
            return loss_inputs

    return RecordingTrainer


def _plain_copy(model):
    """The trainer's weights in a fresh model with the default attention (the trainer's is the packed tree kernel)."""
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    fresh.load_state_dict(model.state_dict(), strict=True)
    return fresh


def _reference_logps(model, input_ids: list[int], positions: list[int], ids: torch.Tensor) -> torch.Tensor:
    """Full-softmax log π at `ids[j]` for the token at `positions[j]` of one unpacked sequence (test reference)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([input_ids])).logits[0].float()
    logps = torch.log_softmax(logits[[p - 1 for p in positions]], dim=-1)
    return torch.where(
        ids >= 0, logps.gather(-1, ids.clamp(min=0)), torch.full_like(logps[:, : ids.shape[1]], -math.inf)
    )


@pytest.mark.parametrize("divergence", ["topk_tv", "topk_kl"])
def test_topk_reaches_the_loss_through_trls_classes(tmp_path, divergence):
    """Samples with shared prompts pass TRL's real queue dataset, planner and collator; each loss term's μ lists are
    the ones its sample carried, slot 0 is the packed target, and π at those ids (chunked gather on the forward's
    hidden states) equals a full-softmax reference; the divergence's metrics are logged."""
    from dppo_trl.trainers.trl116.async_topk import BEHAVIOR_TOPK_IDS, BEHAVIOR_TOPK_LOGPS

    recorder = _Recorder()
    worker = _QueueWorker()
    trainer = _recording_trainer(recorder)(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=_config(tmp_path, vllm_server_base_url="http://127.0.0.1:1", divergence=divergence, divergence_top_k=K),
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
        rollout_worker=worker,
    )
    assert trainer.rollout_worker is worker  # an injected worker is kept
    trainer.model_version = 1
    trainer.current_gradient_accumulation_steps = 1
    prompts = [[5, 6, 7], [5, 6, 7], [9, 8], [9, 8]] * 2
    completions = [[40, 41, 42], [40, 43], [44, 45, 46, 47], [48], [50, 51], [52], [53, 54], [55, 56, 57]]
    samples = [_topk_sample(i, 1 if i % 3 else 0, p, c) for i, (p, c) in enumerate(zip(prompts, completions))]
    for sample in samples:
        worker.rollout_buffer.put(sample)

    batch = next(iter(trainer.get_train_dataloader()))
    selected = batch["token_index"] >= 0
    assert batch[BEHAVIOR_TOPK_IDS].shape == (*batch["token_index"].shape, K + 1)
    # Slot 0 of every loss term is the packed target token; the lists are the samples' own.
    assert torch.equal(
        batch[BEHAVIOR_TOPK_IDS][selected][:, 0], batch["shift_labels"][0][batch["token_index"][selected]]
    )
    by_first_logp = {float(s.topk_logps[t, 0]): (s, t) for s in samples[:4] for t in range(len(s.topk_ids))}
    for ids, logps in zip(batch[BEHAVIOR_TOPK_IDS][selected], batch[BEHAVIOR_TOPK_LOGPS][selected]):
        sample, t = by_first_logp[float(logps[0])]
        assert ids.tolist() == sample.topk_ids[t].tolist()

    with cpu_tree_attention():
        loss = trainer.compute_loss(trainer.model, batch)
    assert torch.isfinite(loss)
    ((loss_inputs, inputs),) = recorder.calls
    assert loss_inputs.has_topk
    torch.testing.assert_close(loss_inputs.mu_topk_logps, batch[BEHAVIOR_TOPK_LOGPS][selected])
    # π at μ's ids, per sample, against the full softmax of the unpacked sequence.
    segment = batch["segment_id"][selected]
    ids = batch[BEHAVIOR_TOPK_IDS][selected]
    plain = _plain_copy(trainer.model)
    for i in range(int(segment.max()) + 1):
        # `segment_id` numbers the row's samples in the planner's order; find each by its tokens' μ lists.
        terms = segment == i
        sample = by_first_logp[float(batch[BEHAVIOR_TOPK_LOGPS][selected][terms][0, 0])][0]
        positions = [p for p in range(1, len(sample.input_ids)) if sample.completion_mask[p]]
        reference = _reference_logps(plain, sample.input_ids.tolist(), positions, ids[terms])
        torch.testing.assert_close(loss_inputs.pi_topk_logps[terms], reference, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss_inputs.pi_logps.detach()[terms], reference[:, 0], atol=1e-5, rtol=1e-5)
    metrics = trainer._metrics["train"]
    assert "dppo/divergence_mean" in metrics and metrics["dppo/divergence_mean"][-1] > 0


def test_topk_batch_without_lists_is_refused(tmp_path):
    """A top-K divergence with samples that carry no lists (a custom worker pushing plain `RolloutSample`s) raises
    instead of silently training on the binary form."""
    from test_async_dppo import _rollout_sample

    worker = _QueueWorker()
    trainer = _recording_trainer(_Recorder())(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=_config(tmp_path, vllm_server_base_url="http://127.0.0.1:1", divergence="topk_kl", divergence_top_k=K),
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
        rollout_worker=worker,
    )
    trainer.current_gradient_accumulation_steps = 1
    for i in range(8):  # two micro-batches of 4: accelerate fetches one ahead
        worker.rollout_buffer.put(_rollout_sample(0, i, advantage=1.0))
    batch = next(iter(trainer.get_train_dataloader()))
    with pytest.raises(RuntimeError, match="carry no engine lists"), cpu_tree_attention():
        trainer.compute_loss(trainer.model, batch)


def test_trainer_runs_trls_worker_with_the_topk_loop(tmp_path):
    """Without a `rollout_worker`, a top-K trainer runs TRL's worker (same arguments) with `TopKRolloutLoop`; a binary
    trainer runs it with `ContextFitRolloutLoop` (the base of both: turns fitted to the server's context)."""
    from dppo_trl import AsyncDPPOTrainer
    from dppo_trl.trainers.trl116.async_context import ContextFitRolloutLoop, ContextFitRolloutWorker
    from dppo_trl.trainers.trl116.async_grpo import TopKRolloutLoop, TopKRolloutWorker

    def build(path, divergence):
        return AsyncDPPOTrainer(
            model=TINY_MODEL,
            reward_funcs=byte_mean_reward,
            args=_config(path, vllm_server_base_url="http://127.0.0.1:1", divergence=divergence, divergence_top_k=K),
            train_dataset=_dataset(),
            processing_class=_tokenizer(),
        )

    binary, topk = build(tmp_path / "b", "binary_tv"), build(tmp_path / "t", "topk_tv")
    assert type(binary.rollout_worker) is ContextFitRolloutWorker
    assert binary.rollout_worker._loop_cls is ContextFitRolloutLoop and issubclass(
        TopKRolloutLoop, ContextFitRolloutLoop
    )
    assert binary.rollout_queue is binary.rollout_worker.rollout_buffer
    assert type(topk.rollout_worker) is TopKRolloutWorker and topk.rollout_worker._loop_cls is TopKRolloutLoop
    assert topk.rollout_queue is topk.rollout_worker.rollout_buffer
    kwargs = dict(topk.rollout_worker._loop_kwargs)
    assert kwargs.pop("logprobs_top_k") == K
    assert kwargs.keys() == binary.rollout_worker._loop_kwargs.keys()


def _multi_turn_sample(index: int, ids: list[int], mask: list[int], advantage: float):
    """A sample shaped like a tool-calling row: trained tokens, then context (a tool result), then trained tokens."""
    from dppo_trl.trainers.trl116.async_topk import TopKRolloutSample

    rng = np.random.default_rng(100 + index)
    trained = [p for p, m in enumerate(mask) if m]
    mu = -rng.uniform(0.5, 5.0, size=len(trained))
    topk_ids = np.full((len(trained), K + 1), -1, dtype=np.int64)
    topk_logps = np.full((len(trained), K + 1), -np.inf, dtype=np.float32)
    for row, p in enumerate(trained):
        others = [v for v in rng.choice(250, size=K + 1, replace=False).tolist() if v != ids[p]][:K]
        topk_ids[row] = [ids[p], *others]
        topk_logps[row] = [mu[row], *np.sort(-rng.uniform(0.2, 3.0, size=K))[::-1]]
    old = np.zeros(len(ids), dtype=np.float32)
    old[trained] = mu
    return TopKRolloutSample(
        prompt=[],
        completion=[],
        input_ids=np.array(ids),
        completion_mask=np.array(mask),
        old_log_probs=old,
        advantage=advantage,
        model_version=0,
        group_id=index,
        metrics={},
        topk_ids=topk_ids,
        topk_logps=topk_logps,
    )


def test_topk_gradient_is_literal_eq11_over_model_tokens(tmp_path):
    """The gradient of `AsyncDPPOTrainer.compute_loss` (TRL's real loss with A = 0 plus DPPO's term) with `topk_tv`
    equals eq. 11 written out on unpacked sequences — −A·min(π/μ, C)·M·∇log π summed over the trained tokens only,
    M from eq. 12 with the top-K TV of eq. 15 on a full softmax — divided by the loss terms, as TRL normalises. Rows
    hold context (a tool result) between trained tokens; the mask fires on some tokens."""
    from references import dppo_per_token_loss

    trainer = _recording_trainer(_Recorder())(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=_config(
            tmp_path,
            vllm_server_base_url="http://127.0.0.1:1",
            divergence="topk_tv",
            divergence_top_k=K,
            delta_low=0.3,
            delta_high=0.3,
        ),
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
        rollout_worker=_QueueWorker(),
    )
    trainer.current_gradient_accumulation_steps = 1
    rows = [
        ([5, 6, 7, 40, 41, 90, 91, 92, 42, 43], [0, 0, 0, 1, 1, 0, 0, 0, 1, 1], 1.0),
        ([5, 6, 8, 44, 93, 94, 45, 46, 47], [0, 0, 0, 1, 0, 0, 1, 1, 1], -1.0),
        ([9, 8, 48, 49, 95, 50], [0, 0, 1, 1, 0, 1], 0.5),
        ([9, 8, 51, 96, 97, 52, 53], [0, 0, 1, 0, 0, 1, 1], -0.7),
    ]
    samples = [_multi_turn_sample(i, ids, mask, adv) for i, (ids, mask, adv) in enumerate(rows)]
    for sample in samples * 2:  # two micro-batches of 4: accelerate fetches one ahead
        trainer.rollout_worker.rollout_buffer.put(sample)
    batch = next(iter(trainer.get_train_dataloader()))
    n_terms = int((batch["token_index"] >= 0).sum())
    assert n_terms == sum(sum(mask) for _, mask, _ in rows)

    trainer.model.zero_grad()
    with cpu_tree_attention():
        trainer.compute_loss(trainer.model, batch).backward()
    ours = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    mask_ratio = trainer._metrics["train"]["dppo/mask_ratio"][-1]
    assert 0.0 < mask_ratio < 1.0, "the test should mask some tokens and keep others"

    plain = _plain_copy(trainer.model)
    spec = trainer.trust_region_spec
    total = 0.0
    for sample in samples:
        ids = torch.tensor(sample.input_ids)
        trained = [p for p in range(len(ids)) if sample.completion_mask[p]]
        logps = torch.log_softmax(plain(input_ids=ids[None]).logits[0].float(), dim=-1)[[p - 1 for p in trained]]
        pi = logps.gather(-1, ids[trained][:, None])[:, 0]
        mu = torch.tensor(sample.topk_logps[:, 0])
        topk_ids = torch.tensor(sample.topk_ids)
        pi_probs = torch.where(topk_ids >= 0, logps.detach().gather(-1, topk_ids.clamp(min=0)).exp(), 0.0)
        mu_probs = torch.where(topk_ids >= 0, torch.tensor(sample.topk_logps).exp(), 0.0)
        rest = (1 - pi_probs.sum(-1)) - (1 - mu_probs.sum(-1))
        divergence = 0.5 * ((pi_probs - mu_probs).abs().sum(-1) + rest.abs())
        adv = torch.full_like(pi, sample.advantage)
        drop = ((adv > 0) & (pi.detach() > mu) & (divergence > spec.delta_high)) | (
            (adv < 0) & (pi.detach() < mu) & (divergence > spec.delta_low)
        )
        total = total + dppo_per_token_loss(pi, mu, adv, (~drop).float(), spec.ratio_cap).sum()
    (total / n_terms).backward()
    for name, param in plain.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, atol=1e-6, rtol=1e-4, msg=name)


N_KEPT = 4  # the server's list length in the kept-set gradient test: ≥ 4 finite entries is an overflow


def test_kept_set_gradient_is_literal_eq11_with_pi_kept(tmp_path):
    """Truncated sampling asynchronously: the gradient of `AsyncDPPOTrainer.compute_loss` (TRL's real loss with A = 0
    plus DPPO's term, through TRL's queue dataset, planner and collator) equals eq. 11 with π_kept = π / π(kept) written
    out on unpacked sequences — −A·min(π_kept/μ, C)·M·∇log π_kept over the trained tokens, M from D(π_kept, μ) —
    divided by the loss terms; positions whose list is full (overflow) carry no gradient and are counted."""
    from references import dppo_per_token_loss

    from dppo_trl.core.functional import binary_tv
    from dppo_trl.trainers.trl116.async_topk import TopKRolloutSample

    recorder = _Recorder()
    trainer = _recording_trainer(recorder)(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=_config(
            tmp_path,
            vllm_server_base_url="http://127.0.0.1:1",
            top_p=0.9,
            kept_set_logprobs=N_KEPT,
            delta_low=0.05,
            delta_high=0.05,
        ),
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
        rollout_worker=_QueueWorker(),
    )
    assert trainer.args.kept_set_size == N_KEPT
    trainer.current_gradient_accumulation_steps = 1
    rows = [
        ([5, 6, 7, 40, 41, 90, 91, 92, 42, 43], [0, 0, 0, 1, 1, 0, 0, 0, 1, 1], 1.0),
        ([5, 6, 8, 44, 93, 94, 45, 46, 47], [0, 0, 0, 1, 0, 0, 1, 1, 1], -1.0),
        ([9, 8, 48, 49, 95, 50], [0, 0, 1, 1, 0, 1], 0.5),
        ([9, 8, 51, 96, 97, 52, 53], [0, 0, 1, 0, 0, 1, 1], -0.7),
    ]
    plain = _plain_copy(trainer.model)
    rng = np.random.default_rng(7)
    samples, references = [], []
    for index, (ids, mask, advantage) in enumerate(rows):
        trained = [p for p, m in enumerate(mask) if m]
        with torch.no_grad():
            full = torch.log_softmax(plain(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        list_ids = np.full((len(trained), N_KEPT + 1), -1, dtype=np.int64)
        kept = np.zeros((len(trained), N_KEPT + 1), dtype=bool)
        for row, p in enumerate(trained):
            others = [v for v in rng.choice(250, size=N_KEPT + 1, replace=False).tolist() if v != ids[p]][:N_KEPT]
            list_ids[row] = [ids[p], *others]
            kept[row, : 1 + int(rng.integers(0, N_KEPT + 1))] = True  # 1..N+1 kept; N or more is an overflow
        at_ids = full[[p - 1 for p in trained]].gather(-1, torch.tensor(list_ids))
        log_mass = torch.logsumexp(at_ids.masked_fill(~torch.tensor(kept), -math.inf), -1)
        mu_lists = torch.where(torch.tensor(kept), at_ids - log_mass[:, None], -math.inf).numpy().astype(np.float32)
        # μ of the sampled token: π_kept moved by a random log-ratio, so the trust region masks some tokens.
        mu_lists[:, 0] = np.minimum(mu_lists[:, 0] + rng.normal(0.0, 0.4, size=len(trained)), 0.0)
        old = np.zeros(len(ids), dtype=np.float32)
        old[trained] = mu_lists[:, 0]
        samples.append(
            TopKRolloutSample(
                prompt=[],
                completion=[],
                input_ids=np.array(ids),
                completion_mask=np.array(mask),
                old_log_probs=old,
                advantage=advantage,
                model_version=0,
                group_id=index,
                metrics={},
                topk_ids=list_ids,
                topk_logps=mu_lists,
            )
        )
        references.append((trained, torch.tensor(list_ids), torch.tensor(kept), torch.tensor(mu_lists[:, 0])))
    for sample in samples * 2:  # two micro-batches of 4: accelerate fetches one ahead
        trainer.rollout_worker.rollout_buffer.put(sample)
    batch = next(iter(trainer.get_train_dataloader()))
    n_terms = int((batch["token_index"] >= 0).sum())

    trainer.model.zero_grad()
    with cpu_tree_attention():
        trainer.compute_loss(trainer.model, batch).backward()
    ours = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    ((loss_inputs, _),) = recorder.calls
    n_overflow = sum(int((kept.sum(-1) >= N_KEPT).sum()) for _, _, kept, _ in references)
    assert 0 < int(loss_inputs.kept_overflow.sum()) == n_overflow < n_terms
    assert trainer._metrics["train"]["dppo/kept_set_overflow_ratio"][-1] == pytest.approx(n_overflow / n_terms)
    mask_ratio = trainer._metrics["train"]["dppo/mask_ratio"][-1]
    assert 0.0 < mask_ratio < 1.0, "the test should mask some tokens and keep others"

    spec = trainer.trust_region_spec
    total = 0.0
    for sample, (trained, list_ids, kept, mu) in zip(samples, references):
        ids = torch.tensor(sample.input_ids)
        full = torch.log_softmax(plain(input_ids=ids[None]).logits[0].float(), dim=-1)[[p - 1 for p in trained]]
        at_ids = full.gather(-1, list_ids)
        pi_kept = at_ids[:, 0] - torch.logsumexp(at_ids.masked_fill(~kept, -math.inf), -1)
        adv = torch.full_like(pi_kept, sample.advantage)
        divergence = binary_tv(pi_kept.detach(), mu)
        drop = ((adv > 0) & (pi_kept.detach() > mu) & (divergence > spec.delta_high)) | (
            (adv < 0) & (pi_kept.detach() < mu) & (divergence > spec.delta_low)
        )
        keep = (~drop & (kept.sum(-1) < N_KEPT)).float()
        total = total + dppo_per_token_loss(pi_kept, mu, adv, keep, spec.ratio_cap).sum()
    (total / n_terms).backward()
    for name, param in plain.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, atol=1e-6, rtol=1e-4, msg=name)
