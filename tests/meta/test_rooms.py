"""The rooms hold every trick on TRL's internals, and docs/upstream.md lists what they provide row for row.

- A private name of TRL, transformers or vLLM is named only in `dppo_trl/trainers/trl116/` (the rooms) and
  `dppo_trl/backends/`. Elsewhere in `dppo_trl/` every private name (`_x`, not a dunder) that the code reads or sets as
  an attribute, defines in a class, passes to `getattr` and friends, or imports must be the package's own: defined by
  `dppo_trl` and by none of the library classes its classes inherit from (by name: an own attribute that shares a
  library private's name is renamed). `ALLOWED` lists the exceptions, each with why; an entry that nothing uses any
  more fails too.
- Each room's docstring holds one table of the hooks it provides, `docs/upstream.md` the same rows, and the tables
  together name every hook of `tests/contract_hooks.py` (the sync room the `grpo-`/`cpu-` ones, the async room the
  `async-` ones).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path

import contract_hooks

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dppo_trl"
ROOMS = ("dppo_trl/trainers/trl116/", "dppo_trl/backends/")
LIBRARIES = ("trl", "transformers", "vllm")
UPSTREAM = ROOT / "docs" / "upstream.md"

# (file, name) the package names outside the rooms although the name is not its own; "*" for any file.
ALLOWED: dict[tuple[str, str], str] = {
    ("*", "_tag_names"): "TRL's class attributes a trainer subclass sets for its model card (every TRL trainer does)",
    ("*", "_name"): "TRL's class attributes a trainer subclass sets for its model card (every TRL trainer does)",
    ("*", "_paper"): "TRL's class attributes a trainer subclass sets for its model card (every TRL trainer does)",
    ("dppo_trl/hardening/checkpoints.py", "_get_output_dir"): (
        "transformers' checkpoint folder, shadowed for a staged save (TRAINER_SAVE_CHECKPOINT_FRAGMENTS, kept)"
    ),
    ("dppo_trl/hardening/preemption.py", "_get_output_dir"): "transformers' checkpoint folder, read (kept)",
    ("dppo_trl/hardening/training.py", "_get_output_dir"): "transformers' checkpoint folder, read (kept)",
    ("dppo_trl/hardening/model_card.py", "_name_or_path"): "the model config's recorded name, read for the card",
    ("dppo_trl/hardening/inputs.py", "_name_or_path"): "the model config's recorded name, read for an error message",
    ("dppo_trl/weights/lora_merge.py", "_did_swap_in_out_features"): (
        "PEFT's (not TRL's) record of a transposed LoRA base weight, read by the out-of-place merge"
    ),
}


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _sources() -> dict[str, ast.Module]:
    return {_relative(path): ast.parse(path.read_text(encoding="utf-8")) for path in sorted(PACKAGE.rglob("*.py"))}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


def _named(tree: ast.Module) -> list[tuple[str, int, bool]]:
    """Every private name a module names: `(name, line, imported from a library)`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            found.append((node.attr, node.lineno, False))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and _private(item.name):
                    found.append((item.name, item.lineno, False))
                targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                for target in targets if isinstance(item, ast.Assign | ast.AnnAssign) else ():
                    if isinstance(target, ast.Name) and _private(target.id):
                        found.append((target.id, item.lineno, False))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            library = node.module.split(".")[0] in LIBRARIES
            found += [(alias.name, node.lineno, library) for alias in node.names if _private(alias.name)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                    found.append((name.value, node.lineno, False))
    return found


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, module and class attributes, `self.x` assignments."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Name):
                names.add(target.id)
            elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                if target.value.id in ("self", "cls"):
                    names.add(target.attr)
    return {name for name in names if _private(name)}


def _library_privates() -> set[str]:
    """The private names of the library classes the package's classes inherit from (their class attributes and the
    `self._x` their source assigns)."""
    for module in ("dppo_trl.trainers.dppo_trainer", "dppo_trl.trainers.async_dppo_trainer", "dppo_trl.cli.main"):
        importlib.import_module(module)
    bases = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("dppo_trl"):
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__.startswith("dppo_trl"):
                bases |= {base for base in cls.__mro__ if base.__module__.split(".")[0] in LIBRARIES}
    names = set()
    for base in bases:
        names |= {name for name in vars(base) if _private(name)}
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        names |= {name for name in re.findall(r"self\.(_\w+)\s*[:=]", source) if _private(name)}
    return names


def test_library_privates_are_named_only_in_the_rooms_and_backends():
    sources = _sources()
    library = _library_privates()
    own = set().union(*(_defined(tree) for tree in sources.values())) - library
    used: set[tuple[str, str]] = set()
    offences = []
    for path, tree in sources.items():
        if path.startswith(ROOMS):
            continue
        for name, line, imported in _named(tree):
            if imported or name in library or name not in own:
                key = (path, name) if (path, name) in ALLOWED else ("*", name)
                if key in ALLOWED:
                    used.add(key)
                else:
                    offences.append(f"{path}:{line}: {name}")
    assert not offences, "TRL/transformers/vLLM privates outside trainers/trl116/ and backends/:\n" + "\n".join(
        offences
    )
    assert set(ALLOWED) <= used, f"ALLOWED entries nothing needs any more: {sorted(set(ALLOWED) - used)}"


# ---------------------------------------------------------------------------------------------------------------------
# The rooms' tables and docs/upstream.md
# ---------------------------------------------------------------------------------------------------------------------
ROOM_MODULES = {"grpo": "dppo_trl/trainers/trl116/grpo.py", "async_grpo": "dppo_trl/trainers/trl116/async_grpo.py"}
SECTIONS = {"grpo": "## GRPOTrainer\n", "async_grpo": "## AsyncGRPOTrainer\n"}


def _tables(text: str) -> list[list[str]]:
    """The Markdown tables of `text`: runs of consecutive lines starting with `|`."""
    tables: list[list[str]] = []
    previous = False
    for line in text.splitlines():
        row = line.startswith("|")
        if row and not previous:
            tables.append([])
        if row:
            tables[-1].append(line.rstrip())
        previous = row
    return tables


def _room_table(room: str) -> list[str]:
    docstring = ast.get_docstring(ast.parse((ROOT / ROOM_MODULES[room]).read_text(encoding="utf-8")))
    assert docstring is not None
    tables = _tables(docstring)
    assert len(tables) == 1, f"{ROOM_MODULES[room]}: the docstring must hold one hook table, in one piece"
    return tables[0]


def _hook_ids(table: list[str]) -> set[str]:
    return {row.rsplit("|", 2)[-2].strip() for row in table[2:]}


def test_each_room_table_is_docs_upstream_row_for_row():
    text = UPSTREAM.read_text(encoding="utf-8")
    for room, heading in SECTIONS.items():
        section = text.split(heading, 1)[1].split("\n## ", 1)[0]
        rows = _room_table(room)
        assert rows in _tables(section), f"docs/upstream.md {heading.strip()!r} lacks {ROOM_MODULES[room]}'s table"


def test_the_room_tables_name_every_hook():
    sync, asynchronous = _hook_ids(_room_table("grpo")), _hook_ids(_room_table("async_grpo"))
    hooks = set(contract_hooks.HOOKS)
    assert {h for h in hooks if h.startswith(("grpo-", "cpu-"))} <= sync
    assert {h for h in hooks if h.startswith("async-")} <= asynchronous
    assert (sync | asynchronous) <= hooks | {contract_hooks.KEPT}
