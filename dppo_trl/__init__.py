"""DPPO (Divergence Proximal Policy Optimization) for Hugging Face TRL.

`DPPOConfig`, `DPPOTrainer` and the asynchronous `AsyncDPPOConfig`/`AsyncDPPOTrainer` are imported lazily so the pure-tensor modules (`dppo_trl.trust_region`, ...) load
without importing TRL.
"""

__version__ = "0.1.0"

__all__ = ["AsyncDPPOConfig", "AsyncDPPOTrainer", "DPPOConfig", "DPPOTrainer", "__version__"]


def __getattr__(name: str):
    if name == "DPPOConfig":
        from dppo_trl.config import DPPOConfig

        return DPPOConfig
    if name == "DPPOTrainer":
        from dppo_trl.trainer import DPPOTrainer

        return DPPOTrainer
    if name in ("AsyncDPPOConfig", "AsyncDPPOTrainer"):
        # TRL's experimental asynchronous trainer: imported only when asked for (set TRL_EXPERIMENTAL_SILENCE=1 to
        # silence TRL's experimental-API warning).
        from dppo_trl import async_trainer

        return getattr(async_trainer, name)
    raise AttributeError(f"module 'dppo_trl' has no attribute {name!r}")
