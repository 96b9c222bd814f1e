"""tests/README.md's map ("Where each module is tested") names the test files of every module of `dppo_trl/`, and only
files that exist, so a newcomer finds a module's tests without a grep."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _map() -> dict[str, list[str]]:
    section = (TESTS / "README.md").read_text(encoding="utf-8").split("## Where each module is tested", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `dppo_trl/"):
            module, tests = (cell.strip() for cell in line.strip("|").split("|"))
            assert module.strip("`") not in rows, f"{module} has two rows"
            rows[module.strip("`")] = re.findall(r"`([^`]+)`", tests)
    return rows


def _has_code(path: Path) -> bool:
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return bool(body)


def test_every_module_is_mapped_to_its_tests():
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "dppo_trl").rglob("*.py") if _has_code(p)}
    mapped = _map()
    assert not modules - set(mapped), f"modules with no row in tests/README.md: {sorted(modules - set(mapped))}"
    assert not set(mapped) - modules, f"rows for modules that do not exist: {sorted(set(mapped) - modules)}"


def test_mapped_test_files_exist():
    for module, tests in _map().items():
        assert tests, f"{module}: no test file named"
        for test in tests:
            assert (TESTS / test).is_file(), f"{module}: tests/{test} does not exist"
            assert Path(test).name.startswith("test_"), test
