"""The package's layers: each folder of `dppo_trl/` imports only the layers below it that its row allows and the
third-party packages its row names, with no import circle and no upward import anywhere.

Every import statement counts, wherever it is written: module level, inside functions and methods, under
`if TYPE_CHECKING:` (the whole syntax tree is walked). The order and the allow-lists are `LAYERS` below; docs/index.md
("Layers") shows the same table, checked here.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dppo_trl"

# Bottom to top: layer -> (the lower layers it may import, the third-party packages it may import). A layer is a folder
# of the package (its modules, not its subfolders, which are layers of their own), except `dppo_trl._version`, a module
# of its own below everything (the root folder's `__init__.py` sits near the top: it exports the trainers). Standard
# library modules are always allowed, and so are a layer's imports of its own modules.
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "dppo_trl._version": ((), ()),
    "dppo_trl.core": ((), ("torch",)),
    "dppo_trl.kernels": (("dppo_trl.core",), ("torch",)),
    "dppo_trl.weights": ((), ("torch", "peft", "deepspeed")),
    "dppo_trl.backends": (("dppo_trl.kernels",), ("torch", "transformers", "trl", "requests")),
    "dppo_trl.backends.cpu": (
        ("dppo_trl.kernels", "dppo_trl.backends"),
        ("torch", "transformers", "trl", "vllm", "requests", "safetensors"),
    ),
    "dppo_trl.hardening": (("dppo_trl._version",), ("torch", "transformers", "trl", "requests", "huggingface_hub")),
    "dppo_trl.trainers.trl116": (
        (
            "dppo_trl.core",
            "dppo_trl.kernels",
            "dppo_trl.weights",
            "dppo_trl.backends",
            "dppo_trl.backends.cpu",
            "dppo_trl.hardening",
        ),
        ("torch", "numpy", "transformers", "trl", "accelerate", "aiohttp"),
    ),
    "dppo_trl.trainers": (
        (
            "dppo_trl.core",
            "dppo_trl.kernels",
            "dppo_trl.weights",
            "dppo_trl.backends",
            "dppo_trl.backends.cpu",
            "dppo_trl.hardening",
            "dppo_trl.trainers.trl116",
        ),
        ("torch", "numpy", "transformers", "trl", "accelerate"),
    ),
    "dppo_trl": (("dppo_trl._version", "dppo_trl.trainers"), ()),
    "dppo_trl.cli": (
        ("dppo_trl.backends", "dppo_trl.backends.cpu", "dppo_trl.hardening", "dppo_trl"),
        ("torch", "transformers", "trl", "accelerate", "datasets", "huggingface_hub", "requests", "yaml"),
    ),
}

# Upward imports allowed while a change that removes them is under way, each with where it goes; an entry whose import
# is gone fails the test, so the list only shrinks (issue 40's last one, the async room's top-K data side, moved into
# the room).
PENDING_UPWARD: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def layer_of(module: str) -> str:
    """The layer `module` (a `dppo_trl` module) belongs to: its own name if it is one, else its folder's."""
    if module in LAYERS:
        return module
    folder = module if module in MODULES and _is_package(module) else module.rpartition(".")[0]
    while folder not in LAYERS:
        folder = folder.rpartition(".")[0]
    return folder


def imports(module: str) -> list[tuple[str, int]]:
    """`(imported module, line)` for every import statement anywhere in `module`, relative ones resolved; for
    `from package import name`, the submodule `package.name` when there is one."""
    path = MODULES[module]
    package = module if _is_package(module) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in MODULES]
            found += [(name, node.lineno) for name in names] or [(source, node.lineno)]
    return found


def _internal(name: str) -> str | None:
    """The `dppo_trl` module an imported name is (or lies in), or None for anything outside the package."""
    if name != "dppo_trl" and not name.startswith("dppo_trl."):
        return None
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def test_every_folder_is_a_layer_and_the_allow_lists_point_down():
    folders = {layer_of(module) for module in MODULES}
    packages = {module for module in MODULES if _is_package(module)}
    assert packages <= set(LAYERS), f"folders with no row in LAYERS: {sorted(packages - set(LAYERS))}"
    assert folders <= set(LAYERS)
    order = list(LAYERS)
    for layer, (below, _) in LAYERS.items():
        for allowed in below:
            assert order.index(allowed) < order.index(layer), f"{layer} may import {allowed}, which is not below it"


def test_every_import_is_allowed_by_its_layer():
    problems = []
    for module in MODULES:
        layer = layer_of(module)
        below, third_party = LAYERS[layer]
        for name, line in imports(module):
            where = f"{MODULES[module].relative_to(ROOT)}:{line} imports {name}"
            target = _internal(name)
            if target is None:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in third_party:
                    problems.append(f"{where}: not among {layer}'s packages {third_party}")
                continue
            target_layer = layer_of(target)
            if target_layer == layer or target_layer in below or (module, target) in PENDING_UPWARD:
                continue
            order = list(LAYERS)
            kind = "an upward import" if order.index(target_layer) > order.index(layer) else "not in its allow-list"
            problems.append(f"{where} ({target_layer}): {kind} for {layer}, which may import {below}")
    assert not problems, "\n".join(problems)


def test_pending_upward_imports_still_exist():
    """Each listed exception is still an import (delete the entry once its import is gone)."""
    for module, target in PENDING_UPWARD:
        assert target in {_internal(name) for name, _ in imports(module)}, f"{module} no longer imports {target}"


def test_no_import_circle_anywhere():
    graph = {
        module: {t for name, _ in imports(module) if (t := _internal(name)) not in (None, module)}
        for module in MODULES
    }
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "import circle: " + " -> ".join((*path[path.index(module) :], module))
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, (*path, module))
        done.add(module)

    for module in MODULES:
        visit(module, ())


def _documented_module(path: str) -> str:
    """`dppo_trl/kernels/` -> `dppo_trl.kernels`; `dppo_trl/__init__.py` -> `dppo_trl`."""
    return path.removesuffix("/").removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def test_docs_show_the_same_layers():
    """docs/index.md's "Layers" table: one row per layer, bottom to top, with the layers and packages it may import."""
    text = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    section = text.split("### Layers", 1)[1].split("\n#", 1)[0]
    documented = {}
    for row in (line for line in section.splitlines() if line.startswith("| `")):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        allowed = re.findall(r"`([^`]+)`", cells[-1])
        internal = {_documented_module(name) for name in allowed if name.startswith("dppo_trl")}
        packages = {name for name in allowed if not name.startswith("dppo_trl")}
        documented[_documented_module(cells[0].strip("`"))] = (internal, packages)
    assert list(documented) == list(LAYERS), "docs/index.md lists other layers, or in another order (bottom to top)"
    for layer, (below, third_party) in LAYERS.items():
        assert documented[layer] == (set(below), set(third_party)), layer


def test_core_knows_nothing_of_trl():
    for path in sorted((PACKAGE / "core").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        for word in ("GRPOTrainer", "opened_clip", "clip_ratio/", "aggregate_per_token"):
            assert word not in text, f"{path.relative_to(ROOT)} mentions {word!r}: TRL knowledge belongs in a room"
