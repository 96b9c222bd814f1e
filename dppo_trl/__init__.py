"""DPPO (Divergence Proximal Policy Optimization) for Hugging Face TRL.

`DPPOConfig` and `DPPOTrainer` are imported lazily so the pure-tensor modules (`dppo_trl.trust_region`, ...) load
without importing TRL.
"""

__version__ = "0.1.0"

__all__ = ["DPPOConfig", "DPPOTrainer", "__version__"]


def __getattr__(name: str):
    if name == "DPPOConfig":
        from dppo_trl.config import DPPOConfig

        return DPPOConfig
    if name == "DPPOTrainer":
        from dppo_trl.trainer import DPPOTrainer

        return DPPOTrainer
    raise AttributeError(f"module 'dppo_trl' has no attribute {name!r}")
