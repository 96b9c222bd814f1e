"""The engine's kept set under truncated sampling, read from μ's log-prob lists.

With `logprobs_mode="processed_logprobs"` vLLM computes its log-probs after top-k, top-p and min-p have set the
dropped tokens' logits to `-inf`. Its N-entry list per token (`VLLMTopKCapture`'s slots: sampled token first, then the
others by rank) therefore holds every kept token with a finite log-prob, followed by dropped ones at `-inf`, whenever
the kept set has fewer than N tokens. When N entries are finite the kept set may be larger than the list (overflow),
unless `0 < top_k ≤ N` bounds it.

Over HTTP (server mode) vLLM's OpenAI-compatible layer floors `-inf` to `-9999.0` (JSON has no infinity), so a dropped
token arrives as `-9999.0`: `engine_lists` maps that floor back to `-inf` before anything reads the kept set.
"""

from __future__ import annotations

import math

import torch

from dppo_trl.trainers.trl116.vllm_topk import VLLM_LOGPROB_FLOOR


def engine_lists(mu_lists: torch.Tensor) -> torch.Tensor:
    """μ's lists with the server's floor read as what it stands for: `-inf`, a token the sampler dropped (a kept token
    of probability `exp(-9999)` would be 0 in float32 anyway). NaN stays NaN."""
    return torch.where(mu_lists <= VLLM_LOGPROB_FLOOR, torch.full_like(mu_lists, -math.inf), mu_lists)


def kept_set_overflow(mu_lists: torch.Tensor, n: int, top_k: int) -> torch.Tensor:
    """`(B, T)` bool: positions whose kept set the engine's N-entry list `mu_lists` `(B, T, N + 1)` may not hold.

    The sampler keeps a prefix of the tokens sorted by probability, so if the sampled token is outside the top N, all
    N listed tokens are kept too: N or more finite entries means the kept set may not fit, except under
    `0 < top_k ≤ N`, where it cannot exceed top_k. A NaN entry (a log-prob the engine did not report) leaves the
    kept set unknown and counts as overflow too.
    """
    finite = torch.isfinite(mu_lists).sum(-1)
    overflow = finite >= n
    if 0 < top_k <= n:
        overflow = torch.zeros_like(overflow)
    return overflow | mu_lists[..., 1:].isnan().any(-1)
