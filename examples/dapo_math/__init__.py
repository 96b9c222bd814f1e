"""The DAPO-Math recipe's parts: data loading (`data`), math-verify rewards (`rewards`) and avg@k evaluation
(`evaluation`). Used by `examples/train_dapo_math.py`; needs the `examples` extra (math-verify, matplotlib, pyyaml)."""
