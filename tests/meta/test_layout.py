"""The package's layering holds: `dppo_trl/core/` imports torch only and knows nothing of TRL, without import circles."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "dppo_trl" / "core"


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, type-only imports included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_imports_torch_only():
    for path in sorted(CORE.glob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            allowed = top in sys.stdlib_module_names or top == "torch" or name.startswith("dppo_trl.core")
            assert allowed, f"{path.relative_to(ROOT)} imports {name}: core/ imports torch only"


def test_core_has_no_import_circles():
    graph = {
        f"dppo_trl.core.{path.stem}": {n for n in _imports(path) if n.startswith("dppo_trl.core.")}
        for path in CORE.glob("*.py")
    }
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "import circle: " + " -> ".join((*path, module))
        if module in done:
            return
        for imported in graph.get(module, ()):
            visit(imported, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_core_knows_nothing_of_trl():
    for path in sorted(CORE.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        for word in ("GRPOTrainer", "opened_clip", "clip_ratio/", "aggregate_per_token"):
            assert word not in text, f"{path.relative_to(ROOT)} mentions {word!r}: TRL knowledge belongs in a room"


def test_weights_know_nothing_of_trl_and_the_lower_layers_nothing_of_them():
    """`dppo_trl/weights` (the out-of-place LoRA merge) imports no TRL: the rooms bridge it onto TRL's syncs. The core
    and the kernels do not import it."""
    for path in sorted((ROOT / "dppo_trl" / "weights").glob("*.py")):
        assert not any(name.split(".")[0] == "trl" for name in _imports(path)), path.name
    for folder in ("core", "kernels"):
        for path in sorted((ROOT / "dppo_trl" / folder).glob("*.py")):
            assert not any(name.startswith("dppo_trl.weights") for name in _imports(path)), path
