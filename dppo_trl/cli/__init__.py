"""The `dppo-trl` command: `train` (DPPOTrainer), `train-async` (AsyncDPPOTrainer) and `vllm-serve`, driven like
`trl grpo` (TRL's parser and `--config` recipes, `--accelerate_config` presets, rewards by import path).

Everything a pip user needs lives here: parsing, reward resolution, dataset loading, the input checks and the
launch through `accelerate launch`. The bundled CPU demo (tiny model, tiny math set, math rewards) is not part of the
wheel: a clone's development package registers it as a recipe (`dppo_trl.cli.recipes`).
"""

from dppo_trl.cli.main import main

__all__ = ["main"]
