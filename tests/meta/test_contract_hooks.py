"""The map from each pinned TRL internal to the upstream hook that would remove it stays complete and true."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import contract_hooks
import trl_contract

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "benchmarks" / "contract_size.py"
UPSTREAM = ROOT / "docs" / "upstream.md"
SECTIONS = {"grpo": "GRPOTrainer", "cpu": "CPU runtime", "async": "AsyncGRPOTrainer"}


def _contract_values() -> dict[str, ast.expr]:
    source = Path(trl_contract.__file__).read_text(encoding="utf-8")
    values = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if target.id != "TESTED_TRL_RANGE":
                values[target.id] = node.value
    return values


def test_every_pin_names_its_removal():
    values = _contract_values()
    assert set(contract_hooks.REMOVED_BY) == set(values), "tests/contract_hooks.py and tests/trl_contract.py differ"
    allowed = set(contract_hooks.HOOKS) | {contract_hooks.KEPT}
    for name, mapping in contract_hooks.REMOVED_BY.items():
        if isinstance(mapping, str):
            assert mapping in allowed, f"{name}: unknown hook {mapping!r}"
            continue
        constant = getattr(trl_contract, name)
        assert set(mapping) == set(constant), f"{name}: the per-entry map must name every entry, and only those"
        assert set(mapping.values()) <= allowed, f"{name}: unknown hook in {mapping}"


def test_every_hook_is_a_section_of_docs_upstream():
    text = UPSTREAM.read_text(encoding="utf-8")
    for hook, heading in contract_hooks.HOOKS.items():
        part = f"## {SECTIONS[hook.split('-')[0]]}\n"
        assert part in text, f"docs/upstream.md has no {part.strip()!r} section"
        section = text.split(part, 1)[1].split("\n## ", 1)[0]
        assert f"### {heading}\n" in section, f"{hook}: no heading {heading!r} under {part.strip()!r}"


def test_benchmark_prints_one_json_object_that_the_docs_table_repeats():
    run = subprocess.run([sys.executable, str(BENCHMARK)], capture_output=True, text=True, check=True, timeout=60)
    result = json.loads(run.stdout)
    assert result["pins"] == sum(result["by_hook"].values())
    assert result["removable_by_hooks"] == result["pins"] - result["by_hook"]["kept"]
    assert set(result["by_hook"]) <= set(contract_hooks.HOOKS) | {contract_hooks.KEPT}

    text = UPSTREAM.read_text(encoding="utf-8")
    table = text.split("## What the hooks would remove", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| ([a-z0-9-]+) \|[^|\n]*\| (\d+) \|$", table, flags=re.MULTILINE))
    assert {hook: int(count) for hook, count in rows.items() if hook != "total"} == result["by_hook"]
    assert int(rows["total"]) == result["pins"]
    assert f"{result['by_hook']['kept']} would be left" in table
    # The restated TRL lines: counted in marked regions, all inside the TRL 1.16 rooms, and quoted by the docs.
    assert result["restated_lines"] == sum(result["restated_by_file"].values())
    assert all(path.startswith("dppo_trl/trainers/trl116/") for path in result["restated_by_file"])
    assert f"({result['restated_lines']} lines today" in text
