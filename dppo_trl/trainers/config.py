"""`DPPOConfig`: GRPOConfig plus the DPPO trust region (Qi et al., arXiv 2602.04879)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from dppo_trl.core.functional import DEFAULT_DELTAS, DEFAULT_RATIO_CAP, DIVERGENCES
from dppo_trl.core.registry import TRUST_REGIONS
from dppo_trl.core.spec import TrustRegionSpec
from dppo_trl.core.sync_check import (
    DEFAULT_SYNC_MISMATCH_THRESHOLD,
    SYNC_MISMATCH_ACTIONS,
    check_sync_mismatch_settings,
)

# vLLM's default `max_logprobs`; TRL's colocate engine does not raise it, so top-K is capped here.
VLLM_COLOCATE_MAX_LOGPROBS = 20
# Aggregations of the per-token policy-gradient term that DPPO composes with (GRPOTrainer's `loss_type`). TRL's docs
# call `luspo` sequence-level (it recommends `importance_sampling_level="sequence"`), but its loss code aggregates a
# token-level term too — `(per_token_loss * mask).sum(-1).mean()`, pinned in `tests/trl_contract.py` — and
# only warns; with DPPO's per-token term that is the authors' seq-mean-token-sum, which the GPU recipes use.
SUPPORTED_LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "luspo")
ANCHORS = ("behavior", "recompute")


# Kept-set size N asked of a `trl vllm-serve` / CPU server when neither `kept_set_logprobs` nor a fitting top_k says;
# fixed (not read from the server) so every process shapes μ's lists alike. Larger kept sets are counted as overflow.
KEPT_SET_SERVER_LOGPROBS = 64
# Sampling options that reshape the engine's distribution without truncating it: vLLM's processed log-probs μ include
# them, π does not, and no kept set can express the difference.
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


def _generation_kwargs(config: Any) -> dict:
    kwargs = getattr(config, "generation_kwargs", None) or {}
    return json.loads(kwargs) if isinstance(kwargs, str) else dict(kwargs)


def sampling_truncation(config: Any) -> tuple[int, float, float]:
    """`(top_k, top_p, min_p)` the engine samples with: the config's fields, overridden by `generation_kwargs` (as TRL
    builds vLLM's `SamplingParams`); `top_k ≤ 0` means no top-k."""
    extra = _generation_kwargs(config)
    top_k = extra.get("top_k", config.top_k)
    top_p = extra.get("top_p", config.top_p)
    min_p = extra.get("min_p", config.min_p)
    return (int(top_k) if top_k is not None else 0, 1.0 if top_p is None else float(top_p), float(min_p or 0.0))


def truncates_sampling(config: Any) -> bool:
    """Whether the engine samples from a truncated distribution (top-k, top-p or min-p)."""
    top_k, top_p, min_p = sampling_truncation(config)
    return top_k > 0 or top_p < 1.0 or min_p > 0.0


def resolve_kept_set_size(config: Any, limit: int) -> int | None:
    """N for a config whose μ is the engine's (both trainers): `config.kept_set_logprobs`, else `top_k` when it fits
    the engine's `limit` (the kept set then always fits), else `limit`; at least `divergence_top_k` under a top-K
    divergence (its lists are the first K + 1 slots). `None` when the engine does not truncate."""
    if not truncates_sampling(config):
        return None
    top_k = sampling_truncation(config)[0]
    n = config.kept_set_logprobs or (top_k if 0 < top_k <= limit else limit)
    return max(n, config.divergence_top_k) if config.trust_region_spec().uses_top_k else n


def check_kept_set(config: Any, n: int | None, colocate: bool) -> None:
    """Refuse a `kept_set_logprobs` below 1, and a `top_k` (alone) larger than N: no kept set would ever be known."""
    if config.kept_set_logprobs is not None and config.kept_set_logprobs < 1:
        raise ValueError(f"kept_set_logprobs must be ≥ 1 or None, got {config.kept_set_logprobs}.")
    top_k, top_p, min_p = sampling_truncation(config)
    if n is not None and top_k > n and top_p >= 1.0 and min_p <= 0.0:
        raise ValueError(
            f"top_k={top_k} keeps {top_k} tokens at every position, more than the {n} log-probs the engine lists "
            "per token, so no position's kept set would be known and every token would be left out of the loss. "
            f"Use top_k ≤ {n}"
            + (
                f" (TRL's colocate engine lists at most {VLLM_COLOCATE_MAX_LOGPROBS}), or vllm_mode='server' "
                "with `--max-logprobs` and kept_set_logprobs ≥ top_k."
                if colocate
                else ", or kept_set_logprobs ≥ top_k (with the server's `--max-logprobs` ≥ it)."
            )
        )


def check_sampling(config: Any) -> None:
    """Refuse the sampling options whose μ the trainer cannot compare with π (both configs call it).

    Truncation (top-k / top-p / min-p) is supported by both trainers, which compare π over the engine's kept set
    (`kept_set_size`); penalties reshape μ in a way π does not follow, so they are refused wherever μ is the
    engine's. With transformers generation (`use_vllm=False`) μ is the trainer's own full softmax, so neither biases
    the comparison.
    """
    engine_mu = getattr(config, "use_vllm", True) and getattr(config, "anchor", "behavior") == "behavior"
    if not engine_mu:
        return
    extra = _generation_kwargs(config)
    for name in _PENALTIES:
        value = extra.get(name, getattr(config, name, None))
        neutral = 1.0 if name == "repetition_penalty" else 0.0
        if value is None or value == neutral:
            continue
        raise ValueError(
            f"{name}={value} reshapes the engine's distribution by token history: vLLM's processed log-probs μ "
            "include the penalty, the trainer's π does not, so π/μ and D(π, μ) are biased at every penalised token "
            f"and the trust region masks tokens that never moved. Set {name}={neutral} for DPPO (see docs/theory.md, 'Truncated sampling')."
        )


@dataclass
class TrustRegionFields:
    """The fields `DPPOConfig` and `AsyncDPPOConfig` share, declared once (docs in `DPPOConfig`): the trust region
    and the check of each weight sync against μ.

    `trust_region_spec()` validates the trust region into the frozen `TrustRegionSpec` the loss reads; each config
    calls `_resolve_trust_region` in `__post_init__`, which also validates the sync check, and keeps the resolved δs.
    """

    divergence: str = field(
        default="binary_tv",
        metadata={
            "help": "Divergence D of the trust region: `binary_tv` (|π−μ| of the sampled token, eq. 13), `binary_kl` "
            "(KL of the Bernoulli pair (μ, 1−μ)‖(π, 1−π), eq. 14), `topk_tv` / `topk_kl` (TV / KL(μ‖π) over "
            "TopK(μ) ∪ {sampled} plus one 'other' bucket, eqs. 15–16).",
            "choices": list(DIVERGENCES),
        },
    )
    delta_low: float | None = field(
        default=None,
        metadata={
            "help": "Trust-region threshold δ_low for negative-advantage tokens. `None` uses the authors' value: "
            f"{DEFAULT_DELTAS['tv']} for TV divergences, {DEFAULT_DELTAS['kl']} for KL divergences."
        },
    )
    delta_high: float | None = field(
        default=None,
        metadata={
            "help": "Trust-region threshold δ_high for positive-advantage tokens. `None` uses the authors' value: "
            f"{DEFAULT_DELTAS['tv']} for TV divergences, {DEFAULT_DELTAS['kl']} for KL divergences."
        },
    )
    divergence_top_k: int = field(
        default=20,
        metadata={
            "help": "K for the top-K divergences: how many of μ's most likely tokens the engine reports per position. "
            "vLLM colocate mode caps it at 20 (vLLM's default `max_logprobs`); a `trl vllm-serve` server (or "
            "`python -m dppo_trl.backends.cpu.vllm_server` on CPU) must run with `--max-logprobs` ≥ K. Ignored by "
            "the binary divergences."
        },
    )
    ratio_cap: float = field(
        default=DEFAULT_RATIO_CAP,
        metadata={
            "help": "Safety cap C in `stopgrad(min(π/μ, C))` (eq. 11). It bounds the weight of rare tokens the engine "
            "sampled at a much lower probability than the trainer assigns. The authors ran with the cap effectively "
            f"off (C = 10000); {DEFAULT_RATIO_CAP} follows TRL's removed DPPOTrainer. Must be finite and ≥ 1."
        },
    )
    mu_kl_coef: float = field(
        default=0.0,
        metadata={
            "help": "τ of the μ-KL penalty τ · (log π − log μ)² on every valid completion token (A = 0 tokens "
            "included), aggregated exactly like the policy term for each `loss_type`; prime-rl's `kl_tau` (1e-3 "
            "there). 0.0 (default) turns it off. Must be finite and ≥ 0."
        },
    )
    anchor: str = field(
        default="behavior",
        metadata={
            "help": "What μ is. `behavior` (default): the log-probs the rollout engine reported when it sampled "
            "(vLLM's processed log-probs, or the generating weights on the transformers path). `recompute`: the "
            "trainer's recomputed π_old — an ablation only (the paper, §5.2, shows it collapses); it costs an "
            "extra forward pass per generation batch.",
            "choices": list(ANCHORS),
        },
    )
    trust_region: str = field(
        default="dppo",
        metadata={
            "help": "Ablations only: replace DPPO's trust region by a baseline, on the same μ-anchored data path. "
            "`grpo_clip` (ratio clip ε=`epsilon`), `clip_higher` (ε_high=0.28), `cispo` (truncated IS at 5, no "
            "mask), `pg_is` (no trust region), `minirl` (clip on π/π_old, IS π_old/μ), `dppo_decoupled` (mask from "
            "D(π, π_old)), `relax_low`/`relax_high`/`relax_both` (GRPO clip with the negative/positive/both sides "
            "removed for tokens with μ < `relax_alpha`; our reading of the paper's §6). The list is "
            "`dppo_trl.core.registry.TRUST_REGIONS`.",
            "choices": list(TRUST_REGIONS),
        },
    )
    relax_alpha: float = field(
        default=0.1,
        metadata={"help": "α of the `relax_*` ablations: tokens whose behavior probability μ is below α are relaxed."},
    )
    # --- The check of every weight sync (dppo_trl.core.sync_check; docs/api.md, "Weight-sync check") ---
    sync_mismatch_threshold: float = field(
        default=DEFAULT_SYNC_MISMATCH_THRESHOLD,
        metadata={
            "help": "On the first optimizer step after each weight sync, the mean |π − μ| (probability of the "
            "sampled token) over the fresh rollout's loss tokens, logged as `dppo/sync_mismatch`, is compared with "
            "this threshold. A sync that reached the engine leaves only its rounding (measured: ~1e-6 fp32, "
            "≤ 3.3e-3 with a bf16 engine, up to 0.025 for a bf16 LoRA run at lr 3e-2); a failed one measured 0.06 to "
            f"0.8. Default {DEFAULT_SYNC_MISMATCH_THRESHOLD}. A number in (0, 1). Only where μ is the engine's "
            "(vLLM, `anchor='behavior'`)."
        },
    )
    sync_mismatch_action: str = field(
        default="warn",
        metadata={
            "help": "What a weight sync whose `dppo/sync_mismatch` exceeds `sync_mismatch_threshold` does: `warn` "
            "(default: a `SyncMismatchWarning` naming the likely causes), `raise` (a `SyncMismatchError` before that "
            "step's optimizer update, naming the last complete checkpoint), `off` (not computed, not logged).",
            "choices": list(SYNC_MISMATCH_ACTIONS),
        },
    )

    def trust_region_spec(self) -> TrustRegionSpec:
        """The validated, frozen spec of these fields (δs resolved) that the loss reads."""
        return TrustRegionSpec.from_config(self)

    def _resolve_trust_region(self) -> None:
        """Validate the shared fields and keep the resolved δs (`None` → the authors' value)."""
        if self.anchor not in ANCHORS:
            raise ValueError(f"anchor={self.anchor!r} is not supported; choose one of {list(ANCHORS)}.")
        spec = self.trust_region_spec()
        self.delta_low, self.delta_high = spec.delta_low, spec.delta_high
        check_sampling(self)
        check_sync_mismatch_settings(self.sync_mismatch_threshold, self.sync_mismatch_action)


@dataclass
class DPPOConfig(TrustRegionFields, GRPOConfig):
    r"""
    Configuration for [`DPPOTrainer`]: every [`~trl.GRPOConfig`] field, plus the DPPO trust region.

    DPPO replaces GRPO's ratio clipping with a trust region on the divergence D between the trainer policy π and the
    behavior policy μ that sampled the completion (the inference engine's own log-probs). Per completion token
    (eq. 11): `loss = −A · sg(min(π/μ, ratio_cap) · M) · log π`, where `M = 0` only for tokens that move *away* from
    μ by more than `delta_high` (A > 0) or `delta_low` (A < 0) (eq. 12). See `docs/theory.md`.

    Parameters:
        > Parameters that define the trust region (eqs. 11-16)

        divergence (`str`, *optional*, defaults to `"binary_tv"`):
            D of the trust region: `binary_tv` (|π−μ| of the sampled token, eq. 13), `binary_kl` (Bernoulli KL
            (μ, 1−μ)‖(π, 1−π), eq. 14), `topk_tv` / `topk_kl` (TV / KL(μ‖π) over TopK(μ) ∪ {sampled} plus one
            'other' bucket, eqs. 15-16).
        delta_low (`float` or `None`, *optional*, defaults to `None`):
            δ_low of eq. 12, for negative-advantage tokens. `None`: the authors' 0.15 (TV) / 0.05 (KL).
        delta_high (`float` or `None`, *optional*, defaults to `None`):
            δ_high of eq. 12, for positive-advantage tokens. `None`: the authors' 0.15 (TV) / 0.05 (KL).
        divergence_top_k (`int`, *optional*, defaults to `20`):
            K of eqs. 15-16: how many of μ's most likely tokens the engine reports per position (≤ 20 in vLLM
            colocate mode). Ignored by the binary divergences.
        ratio_cap (`float`, *optional*, defaults to `20.0`):
            C of eq. 11, the safety cap in `sg(min(π/μ, C))`. Finite and ≥ 1.

        mu_kl_coef (`float`, *optional*, defaults to `0.0`):
            τ of the μ-KL penalty `τ · (log π − log μ)²` added to every valid completion token's loss (prime-rl's
            `kl_tau`, 1e-3 there) and aggregated like the policy term. `0.0` turns it off. Finite and ≥ 0.

        kept_set_logprobs (`int` or `None`, *optional*, defaults to `None`):
            Truncated sampling (top_k > 0, top_p < 1 or min_p > 0) with vLLM: how many log-probs N the engine lists
            per token, from which the kept set is read. `None`: `top_k` when it fits the engine's limit (the kept set
            then always fits), else the limit (20 in colocate mode, 64 in server mode). Positions whose kept set may
            exceed N are left out of the loss and counted in `dppo/kept_set_overflow_ratio`.

        > Parameters that define the anchor (where μ comes from)

        anchor (`str`, *optional*, defaults to `"behavior"`):
            `behavior`: μ is the log-probs the rollout engine reported when it sampled (the paper's method).
            `recompute`: μ is the trainer's recomputed π_old — an ablation (§5.2: it collapses), one extra forward.
        vllm_importance_sampling_correction (`bool`, *optional*, defaults to `False`):
            TRL's truncated IS correction π_old/μ. Must stay `False` with `anchor="behavior"` (π/μ already
            corrects the train–inference mismatch).

        > Parameters for ablations (the paper's §5-6 baselines on the same μ-anchored data path)

        trust_region (`str`, *optional*, defaults to `"dppo"`):
            Replace DPPO's trust region by a baseline of `dppo_trl.core.registry.TRUST_REGIONS`: `grpo_clip`,
            `clip_higher`, `cispo`, `pg_is`, `minirl`, `dppo_decoupled`, `relax_low`/`relax_high`/`relax_both`.
        relax_alpha (`float`, *optional*, defaults to `0.1`):
            α of the `relax_*` ablations: tokens with μ < α are relaxed.

        > Parameters for the weight-sync check (docs/api.md, "Weight-sync check")

        sync_mismatch_threshold (`float`, *optional*, defaults to `0.05`):
            On the first optimizer step after each weight sync, the fresh rollout's mean |π − μ| (logged as
            `dppo/sync_mismatch`) above which the sync is reported: the engine is then not computing with the
            trainer's weights. In (0, 1). Measured floors: ~1e-6 (fp32), ≤ 3.3e-3 (bf16 engine).
        sync_mismatch_action (`str`, *optional*, defaults to `"warn"`):
            `warn` (a `SyncMismatchWarning`), `raise` (a `SyncMismatchError` before that step's update) or `off`.
            Only where μ is the engine's (vLLM and `anchor="behavior"`).

        > Parameters for faults

        vllm_server_request_timeout (`float` or `None`, *optional*, defaults to `1800.0`):
            Server mode: seconds a request to the vLLM server may go unanswered before training stops with an error
            naming the server and the resume command. `None`: TRL's unbounded wait. See `docs/faults.md`.

        > Parameters for vLLM's CPU build (ignored elsewhere)

        vllm_cpu_dtype (`str`, *optional*, defaults to `"float32"`):
            dtype of the colocated engine: `float32`, `bfloat16`, or `auto` (bfloat16 where the CPU has native bf16).
        vllm_cpu_engine_kwargs (`dict`, `str` or `None`, *optional*, defaults to `None`):
            Further `vllm.LLM` arguments for the colocated engine (a dict or its JSON string), e.g.
            `{"kv_cache_dtype": "fp8"}`; they override every other engine argument.

    Defaults that differ from `GRPOConfig`: `vllm_importance_sampling_correction=False`. GRPO's
    `epsilon`/`epsilon_high` clip is not used by DPPO (only by the `grpo_clip`-family ablations).
    """

    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={
            "help": "TRL's truncated importance-sampling correction π_old/μ. DPPO's μ anchor already corrects the "
            "train–inference mismatch, so it must stay `False` with `anchor='behavior'`; with `anchor='recompute'` "
            "it may be enabled to study the decoupled variant."
        },
    )
    kept_set_logprobs: int | None = field(
        default=None,
        metadata={
            "help": "Truncated sampling (top_k > 0, top_p < 1 or min_p > 0) with vLLM: the number N of log-probs the "
            "engine lists per token; the finite ones are the tokens its sampler kept, over which π is renormalised to "
            "compare with μ. `None`: `top_k` when it fits the engine's limit, else the limit (20 in colocate mode, "
            f"{KEPT_SET_SERVER_LOGPROBS} in server mode; the server's `--max-logprobs` must allow it). Positions "
            "whose kept set may exceed N are left out of the loss and counted in `dppo/kept_set_overflow_ratio`."
        },
    )
    vllm_server_request_timeout: float | None = field(
        default=1800.0,
        metadata={
            "help": "Server mode: seconds one request to the vLLM server may go without an answer before training "
            "stops with an error naming the server and the resume command (TRL sets no bound, so a hung server "
            "hangs training). Must exceed the longest generation request. A killed server fails sooner: refused "
            "connections end after TRL's retries (about 1 min). `None`: no bound."
        },
    )

    # --- vLLM CPU engine (read by dppo_trl.backends.cpu.engine.EngineOptions.from_config; ignored off vLLM's CPU
    # platform and outside colocate mode) ---
    vllm_cpu_dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype of the colocated vLLM engine on vLLM's CPU build: `float32` (default; the engine then "
            "matches an fp32 trainer to ~1e-6), `bfloat16`, or `auto` (bfloat16 where the CPU has native bf16, "
            "AVX512-BF16 or AMX, else float32). Ignored elsewhere.",
            "choices": ["float32", "bfloat16", "auto"],
        },
    )
    vllm_cpu_engine_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Further `vllm.LLM` arguments for the colocated engine on vLLM's CPU build (a dict, or its JSON "
            'string), e.g. `{"kv_cache_dtype": "fp8"}`; they override every other engine argument. Ignored elsewhere.'
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self._resolve_trust_region()
        self._validate_dppo()

    @property
    def kept_set_size(self) -> int | None:
        """N, the log-probs per token the vLLM engine lists so the trainer can read its sampler's kept set; `None`
        when π needs no kept set (untruncated sampling, transformers generation, or `anchor='recompute'`)."""
        if not (self.use_vllm and self.anchor == "behavior"):
            return None
        limit = VLLM_COLOCATE_MAX_LOGPROBS if self.vllm_mode == "colocate" else KEPT_SET_SERVER_LOGPROBS
        return resolve_kept_set_size(self, limit)

    def _validate_dppo(self) -> None:
        if self.kept_set_logprobs is not None:
            if self.use_vllm and self.vllm_mode == "colocate" and self.kept_set_logprobs > VLLM_COLOCATE_MAX_LOGPROBS:
                raise ValueError(
                    f"kept_set_logprobs={self.kept_set_logprobs} exceeds vLLM's `max_logprobs` "
                    f"({VLLM_COLOCATE_MAX_LOGPROBS}), which TRL's colocate engine does not raise. Use "
                    f"kept_set_logprobs ≤ {VLLM_COLOCATE_MAX_LOGPROBS}, or vllm_mode='server' with `--max-logprobs`."
                )
        check_kept_set(self, self.kept_set_size, colocate=self.use_vllm and self.vllm_mode == "colocate")
        if self.trust_region_spec().uses_top_k:
            if self.use_vllm and self.vllm_mode == "colocate" and self.divergence_top_k > VLLM_COLOCATE_MAX_LOGPROBS:
                raise ValueError(
                    f"divergence_top_k={self.divergence_top_k} exceeds vLLM's `max_logprobs` "
                    f"({VLLM_COLOCATE_MAX_LOGPROBS}), which TRL's colocate engine does not raise. Use "
                    f"divergence_top_k ≤ {VLLM_COLOCATE_MAX_LOGPROBS}, or vllm_mode='server' with `--max-logprobs`."
                )
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ValueError(
                f"loss_type={self.loss_type!r} is its own trust region and cannot be combined with DPPO's. Use one of "
                f"the aggregations {list(SUPPORTED_LOSS_TYPES)} (default 'dapo'), or GRPOTrainer for "
                f"loss_type={self.loss_type!r}."
            )
        if self.importance_sampling_level != "token":
            raise ValueError(
                "importance_sampling_level='sequence' (GSPO) is not supported: DPPO's trust region is per token. "
                "Use importance_sampling_level='token'"
                + (
                    " (loss_type='luspo' then aggregates the per-token term as a sum over each completion's tokens, "
                    "averaged over completions: the DPPO authors' seq-mean-token-sum)."
                    if self.loss_type == "luspo"
                    else "."
                )
            )
        if self.delta is not None:
            raise ValueError(
                f"delta={self.delta} (GRPO's two-sided ratio clip) is not used by DPPO; the ratio is capped by "
                "`ratio_cap` and the trust region is `delta_low`/`delta_high`. Leave `delta=None`."
            )
        if self.epsilon_high is not None:
            raise ValueError(
                "epsilon_high is GRPO's ratio clip and has no effect under DPPO. Set the DPPO thresholds "
                "`delta_low`/`delta_high` instead."
            )
        if self.vllm_importance_sampling_correction and self.anchor == "behavior":
            raise ValueError(
                "vllm_importance_sampling_correction=True would correct the train–inference mismatch twice: DPPO's "
                "ratio π/μ is already anchored on the engine's log-probs. Leave it False (the DPPOConfig default), or "
                "use anchor='recompute' to study the decoupled variant."
            )
        if self.anchor == "recompute":
            warnings.warn(
                "anchor='recompute' anchors the trust region on the trainer's recomputed π_old instead of the engine's "
                "μ. It is an ablation: the paper (§5.2) shows it collapses under train–inference mismatch, and it "
                "costs an extra forward pass per generation batch. Use anchor='behavior' for training.",
                UserWarning,
                stacklevel=3,
            )
