"""Recipes: what a project adds to `dppo-trl train` / `train-async` without forking the command.

TRL's CLI has a fixed command list and no plug-in point; `dppo-trl` has one. A recipe is a `Recipe` subclass
registered under the entry-point group `dppo_trl.recipes` (`[project.entry-points."dppo_trl.recipes"]`). It brings
its own options (a dataclass parsed with the command's own, so its keys may sit in a `--config` YAML), and it takes
part in a run only when one of those options is set, or when it provides the bundled demo that a run without
`--model_name_or_path` asks for. The repository's development package registers the DAPO-Math recipe this way
(`examples/dapo_math/recipe.py`); a pip install has none, and says so when the demo is asked for.
"""

from __future__ import annotations

from dataclasses import fields
from importlib import metadata
from typing import Any

ENTRY_POINT_GROUP = "dppo_trl.recipes"


class Recipe:
    """A recipe's options and hooks. Every hook has a do-nothing default; override the ones the recipe needs."""

    name: str = "recipe"
    #: A dataclass whose fields become options of `train` and `train-async` (None: no options of its own).
    arguments: type | None = None

    def option_names(self) -> set[str]:
        return {f.name for f in fields(self.arguments)} if self.arguments is not None else set()

    def demo(self, asynchronous: bool) -> dict[str, Any] | None:
        """Settings of the bundled demo (model, data, run shape, and this recipe's options), or None."""
        return None

    def reward_funcs(self, options: Any, training_args: Any) -> list | None:
        """The rewards a run uses when `--reward_funcs` is not given (None: the run must name them)."""
        return None

    def check(self, options: Any, script_args: Any, training_args: Any) -> None:
        """Checks of the recipe's options, before any data or model loads; raise `ValueError` naming the fix."""

    def processing_class(self, model_name_or_path: str) -> Any | None:
        """The tokenizer to train with (None: the model's own)."""
        return None

    def attach(self, trainer: Any, options: Any, script_args: Any, asynchronous: bool) -> None:
        """Add callbacks (evaluation, model-card sections) to the built trainer."""

    def finish(self, trainer: Any, options: Any, asynchronous: bool) -> None:
        """After training, on every process (check `trainer.accelerator.is_main_process` to print once)."""


def installed_recipes() -> list[Recipe]:
    """The recipes registered in this environment, in name order."""
    recipes = []
    for entry in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            recipe = entry.load()
        except ImportError as error:
            # A recipe whose own dependencies are missing must not take the command down with it.
            raise SystemExit(
                f"dppo-trl: the recipe {entry.name!r} ({entry.value}) is registered but cannot be imported: {error}. "
                "Install what it needs, or uninstall the package that registers it."
            ) from error
        recipes.append(recipe() if isinstance(recipe, type) else recipe)
    return recipes
