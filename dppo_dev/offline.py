"""The environment for offline runs (tests, benchmarks, the CPU demo): no Hub calls, no telemetry, quiet TRL."""

from __future__ import annotations

import os

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def set_offline_env(**extra: str) -> None:
    """Set `OFFLINE_ENV` (plus `extra`) where the user has not; call it before importing transformers or TRL."""
    for name, value in {**OFFLINE_ENV, **extra}.items():
        os.environ.setdefault(name, value)
