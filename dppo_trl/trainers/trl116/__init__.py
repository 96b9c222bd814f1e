"""TRL 1.16's bridging, one room per parent: `grpo` (`GRPOTrainer`) and `async_grpo` (`AsyncGRPOTrainer`).

Each room subclasses its TRL parent and *provides*, on TRL 1.16, the hooks docs/upstream.md proposes to TRL; the DPPO
trainers subclass the rooms and use only those hooks. Every trick on TRL's internals lives in a room, pinned in
tests/trl_contract.py; when TRL ships a hook, its part of the room is deleted. `common` holds what both rooms share
(the loss hook's typed forward, the hidden-state capture, the hardening overrides); `vllm_topk`, `context_fit`,
`async_topk` and `async_context` hold the rooms' parts on TRL's generation objects and rollout worker.
"""

# The ratio-clip metrics both parents log. DPPO replaces the clip by its trust region, so these are always 0 and the
# rooms drop them rather than log them as if they meant something.
PARENT_CLIP_METRICS = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)
