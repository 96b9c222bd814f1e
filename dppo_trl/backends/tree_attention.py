"""TRL's tree attention on any device: which function runs under TRL's `tree_fa3` name, and its registration.

TRL 1.16's `AsyncGRPOTrainer` builds its model with `attn_implementation="tree_fa3"`, registered in transformers'
`AttentionInterface` as a FlashAttention-3 varlen kernel fetched from the Hub (`trl.experimental.async_grpo.packing`).
The functions that can take its place are math (`dppo_trl.kernels.tree_attention`: `tree_attention_sdpa` and the
float32 reference `tree_attention_cpu`); putting one under TRL's name, and probing whether TRL's own kernel loads and
runs, needs transformers' and TRL's internals, so it lives here:

- [`resolve_tree_attention`]: what `AsyncDPPOConfig.tree_attention` means on a device (TRL's kernel where it loads and
  runs, else `tree_attention_sdpa`), with the reason; [`fa3_unavailable`] is its probe of TRL's kernel.
- [`registered_tree_attention`]: registers a function under TRL's name for a `with` block, then restores what was
  there (the async room wraps every forward and backward in it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dppo_trl.kernels.tree_attention import tree_attention_cpu, tree_attention_sdpa

__all__ = [
    "FA3_FIX",
    "TREE_ATTENTION_CHOICES",
    "TreeAttentionChoice",
    "fa3_unavailable",
    "registered_tree_attention",
    "resolve_tree_attention",
]

# `AsyncDPPOConfig.tree_attention`: "auto" picks; "fa3" is TRL's Hub kernel; "sdpa" is `tree_attention_sdpa`;
# "eager" is the float32 reference `tree_attention_cpu` (O(L^2) memory: debugging).
TREE_ATTENTION_CHOICES = ("auto", "fa3", "sdpa", "eager")

FA3_FIX = (
    "install the `kernels` package (`pip install kernels`, TRL's `kernels` extra) and make the Hub repository "
    "`kernels-community/flash-attn3` loadable (Hub access, or a copy in the Hugging Face cache with HF_HUB_OFFLINE=1), "
    "on a GPU FlashAttention-3 supports (Hopper: H100/H200); or set `tree_attention='sdpa'` (or 'auto')"
)


@contextlib.contextmanager
def registered_tree_attention(function: Callable) -> Iterator[None]:
    """Register `function` (and TRL's no-op mask) under TRL's tree-attention name for the `with` block only, then
    restore the previous registrations (TRL's FA3 function, or nothing)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from trl.experimental.async_grpo.packing import TREE_ATTENTION

    saved = []
    for interface in (AttentionInterface, AttentionMaskInterface):
        mapping = interface._global_mapping
        saved.append((mapping, TREE_ATTENTION in mapping, mapping.get(TREE_ATTENTION)))
    AttentionInterface.register(TREE_ATTENTION, function)
    AttentionMaskInterface.register(TREE_ATTENTION, _no_mask)
    try:
        yield
    finally:
        for mapping, had, previous in saved:
            if had:
                mapping[TREE_ATTENTION] = previous
            else:
                mapping.pop(TREE_ATTENTION, None)


def _no_mask(**kwargs) -> None:
    # Tree attention builds its own masking from the segment tables; transformers must not build a dense mask.
    return None


@dataclass(frozen=True)
class TreeAttentionChoice:
    """What runs as TRL's tree attention: `name` ("fa3", "sdpa" or "eager"), the `function` to register under TRL's
    name while the trainer's forward and backward run (`None`: TRL's own FA3 registration stays), and why."""

    name: str
    function: Callable | None
    reason: str


def fa3_unavailable(device: torch.device) -> str | None:
    """Why TRL's FlashAttention-3 tree attention cannot run on `device`, or `None` when it can.

    On CUDA it loads the kernel through TRL's own loader (`packing._flash_attn`, `kernels.get_kernel` from the Hub,
    cached by TRL once it succeeds) and runs TRL's `tree_attention` once on a two-token row, so a kernel that loads but
    has no build for this card is caught here rather than in the first training step."""
    if device.type != "cuda":
        return f"FlashAttention-3 needs a CUDA device, not {device.type}"
    from trl.experimental.async_grpo import packing

    try:
        packing._flash_attn()
    except Exception as error:  # any failure to load is a reason to say, not to crash "auto"
        return f"loading kernels-community/flash-attn3 failed ({type(error).__name__}: {error})"
    try:
        q = torch.randn(1, 1, 2, 64, device=device, dtype=torch.bfloat16)
        packing.tree_attention(
            None,
            q,
            q,
            q,
            None,
            tree_kv_index=torch.arange(2, device=device),
            tree_cu_seqlens_q=torch.tensor([0, 2], device=device, dtype=torch.int32),
            tree_cu_seqlens_k=torch.tensor([0, 2], device=device, dtype=torch.int32),
            tree_max_seqlen_q=2,
            tree_max_seqlen_k=2,
        )
        torch.cuda.synchronize(device)
    except Exception as error:
        return f"the kernel loaded but does not run on this GPU ({type(error).__name__}: {error})"
    return None


def resolve_tree_attention(choice: str, device: torch.device) -> TreeAttentionChoice:
    """The tree attention `AsyncDPPOConfig.tree_attention = choice` runs on `device`.

    "auto": TRL's FA3 kernel where it loads and runs (CUDA), else `tree_attention_sdpa`. "fa3" raises a `RuntimeError`
    naming the fix when the kernel cannot run. "sdpa" and "eager" are taken as asked."""
    if choice not in TREE_ATTENTION_CHOICES:
        raise ValueError(f"tree_attention must be one of {TREE_ATTENTION_CHOICES}, got {choice!r}.")
    if choice == "sdpa":
        return TreeAttentionChoice("sdpa", tree_attention_sdpa, "tree_attention='sdpa' was asked for")
    if choice == "eager":
        return TreeAttentionChoice("eager", tree_attention_cpu, "tree_attention='eager' was asked for")
    failure = fa3_unavailable(device)
    if failure is None:
        return TreeAttentionChoice("fa3", None, "TRL's FlashAttention-3 kernel loaded and ran on this GPU")
    if choice == "fa3":
        raise RuntimeError(f"tree_attention='fa3' cannot run: {failure}. To fix: {FA3_FIX}.")
    return TreeAttentionChoice("sdpa", tree_attention_sdpa, failure)
