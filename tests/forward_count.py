"""Count the trainer's log-prob forwards made while a generation batch is built (a π_old recompute would be one).

A forward is a call that reaches GRPOTrainer's own `_get_per_token_logps_and_entropies`: a pass DPPOTrainer declines
(its π_old pass under a μ anchor) never runs the model and is not counted."""

from __future__ import annotations

import contextlib

import pytest
from trl import GRPOTrainer

from dppo_trl import DPPOTrainer


class GenerationPasses:
    """Per `_generate_and_score_completions` call, the models of the `_get_per_token_logps_and_entropies` calls made
    inside it (`"policy"` for the trainer's model, `"ref"` for a separate reference model)."""

    def __init__(self):
        self.batches: list[list[str]] = []

    def policy_counts(self) -> list[int]:
        return [sum(kind == "policy" for kind in batch) for batch in self.batches]


@contextlib.contextmanager
def count_generation_passes():
    """Patch `DPPOTrainer` (class-wide, restored on exit) so every trainer built or run inside counts its passes.

    Class-wide so it also reaches trainers built inside a script's `main()`.
    """
    passes = GenerationPasses()
    generate, logps = DPPOTrainer._generate_and_score_completions, GRPOTrainer._get_per_token_logps_and_entropies
    inside = []

    def generate_and_score(self, inputs):
        passes.batches.append([])
        inside.append(True)
        try:
            return generate(self, inputs)
        finally:
            inside.pop()

    def per_token_logps(self, model, *args, **kwargs):
        if inside:
            passes.batches[-1].append("policy" if model is self.model else "ref")
        return logps(self, model, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DPPOTrainer, "_generate_and_score_completions", generate_and_score)
        patch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", per_token_logps)
        yield passes
