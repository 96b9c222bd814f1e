"""DPPO (Divergence Proximal Policy Optimization) for Hugging Face TRL.

`DPPOConfig`, `DPPOTrainer` and the asynchronous `AsyncDPPOConfig`/`AsyncDPPOTrainer` are imported lazily so the pure-tensor modules (`dppo_trl.core.functional`, ...) load
without importing TRL.
"""

from dppo_trl._version import __version__

__all__ = ["AsyncDPPOConfig", "AsyncDPPOTrainer", "DPPOConfig", "DPPOTrainer", "__version__"]


def __getattr__(name: str):
    if name == "DPPOConfig":
        from dppo_trl.trainers.config import DPPOConfig

        return DPPOConfig
    if name == "DPPOTrainer":
        from dppo_trl.trainers.dppo_trainer import DPPOTrainer

        return DPPOTrainer
    if name in ("AsyncDPPOConfig", "AsyncDPPOTrainer"):
        # TRL's experimental asynchronous trainer: imported only when asked for (set TRL_EXPERIMENTAL_SILENCE=1 to
        # silence TRL's experimental-API warning).
        from dppo_trl.trainers import async_dppo_trainer as async_trainer

        return getattr(async_trainer, name)
    raise AttributeError(f"module 'dppo_trl' has no attribute {name!r}")
