"""
How many TRL/vLLM internals dppo-trl pins, and how many the proposed TRL hooks (docs/upstream.md) would remove.

Counts `tests/trl_contract.py` two ways:

- `pins`: one per thing that can break on its own — a method signature, an attribute, a batch key, a module symbol, a
  source fragment (a dict of signatures counts its methods; a `*_PARAMS` tuple or an `*_ARITY` is one signature);
- `pins_flat`: every string of every constant, signature parameters included (the count issue 25 quoted as "about
  240").

`by_hook` splits `pins` by the hook in `tests/contract_hooks.py` that would make each pin unnecessary; `kept` are the
pins no proposed hook removes, which is what would be left if every hook landed. `--commit REV` counts the contract as
it was at a git revision (its path moved from `dppo_trl/trl_contract.py` to `tests/`).

`restated_lines` counts the lines of `dppo_trl/` that restate TRL code (TRL's statements written again, not calls
into TRL): the regions between a `# restates-trl: begin <TRL source>` and a `# restates-trl: end` comment, non-blank
and non-comment lines only, per file in `restated_by_file`. A pin fails when TRL changes under it; a restated line
silently keeps TRL's old behaviour, so each region also has a contract pin or a test against TRL's real code.

Prints one JSON object:

    .venv/bin/python benchmarks/contract_size.py [--commit d771e7b]
"""

from __future__ import annotations

import argparse
import ast
import json
import runpy
import subprocess
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACT_PATHS = ("tests/trl_contract.py", "dppo_trl/trl_contract.py")
NOT_PINS = ("TESTED_TRL_RANGE",)
PACKAGE = "dppo_trl"
RESTATED_BEGIN, RESTATED_END = "# restates-trl: begin", "# restates-trl: end"


def contract_constants(source: str) -> dict[str, ast.expr]:
    """The contract's module-level constants, by name, as expressions."""
    constants = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and target.id not in NOT_PINS and node.value is not None:
                constants[target.id] = node.value
    return constants


def entries(name: str, value: ast.expr) -> list[str]:
    """The constant's pins, each named by its dict key or literal (or the constant's name when it is one pin)."""
    if isinstance(value, ast.Dict):
        return [ast.literal_eval(key) for key in value.keys if key is not None]
    if name.endswith(("_PARAMS", "_ARITY")) or not isinstance(value, ast.Tuple | ast.List | ast.Set):
        return [name]
    return [ast.literal_eval(element) if isinstance(element, ast.Constant) else name for element in value.elts]


def flat_count(value: ast.expr) -> int:
    if isinstance(value, ast.Tuple | ast.List | ast.Set):
        return sum(flat_count(element) for element in value.elts)
    if isinstance(value, ast.Dict):
        return sum(1 + flat_count(v) for v in value.values)
    return 1


def hook_of(removed_by: dict, name: str, entry: str) -> str:
    mapping = removed_by[name]
    return mapping if isinstance(mapping, str) else mapping[entry]


def measure(source: str, removed_by: dict | None) -> dict:
    constants = contract_constants(source)
    pins = {name: entries(name, value) for name, value in constants.items()}
    result: dict = {
        "constants": len(constants),
        "pins": sum(len(v) for v in pins.values()),
        "pins_flat": sum(flat_count(v) for v in constants.values()),
    }
    if removed_by is not None:
        by_hook = Counter(hook_of(removed_by, name, entry) for name, names in pins.items() for entry in names)
        result["by_hook"] = dict(sorted(by_hook.items()))
        result["removable_by_hooks"] = result["pins"] - by_hook.get("kept", 0)
    return result


def restated_lines(source: str, path: str) -> int:
    """The code lines of `source` inside `# restates-trl: begin … end` regions (regions must pair up)."""
    count, inside = 0, False
    for number, line in enumerate(source.splitlines(), 1):
        text = line.strip()
        if text.startswith(RESTATED_BEGIN):
            if inside:
                raise SystemExit(f"{path}:{number}: nested `{RESTATED_BEGIN}`")
            inside = True
        elif text.startswith(RESTATED_END):
            if not inside:
                raise SystemExit(f"{path}:{number}: `{RESTATED_END}` without a begin")
            inside = False
        elif inside and text and not text.startswith("#"):
            count += 1
    if inside:
        raise SystemExit(f"{path}: `{RESTATED_BEGIN}` without an end")
    return count


def measure_restated(commit: str | None) -> dict[str, int]:
    """Restated lines per file of the package, at `commit` or in the working tree (files with none left out)."""
    if commit is None:
        files = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in (ROOT / PACKAGE).rglob("*.py")}
    else:
        listed = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", commit, PACKAGE], cwd=ROOT, capture_output=True, text=True
        ).stdout.split()
        files = {
            path: subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True).stdout
            for path in listed
            if path.endswith(".py")
        }
    counts = {path: restated_lines(source, path) for path, source in sorted(files.items())}
    return {path: n for path, n in counts.items() if n}


def read_contract(commit: str | None) -> str:
    if commit is None:
        return (ROOT / CONTRACT_PATHS[0]).read_text(encoding="utf-8")
    for path in CONTRACT_PATHS:
        shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode == 0:
            return shown.stdout
    raise SystemExit(f"no contract at {commit} (looked for {', '.join(CONTRACT_PATHS)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--commit", help="count the contract at this git revision (no hook split)")
    args = parser.parse_args()
    removed_by = None
    if args.commit is None:
        removed_by = runpy.run_path(str(ROOT / "tests" / "contract_hooks.py"))["REMOVED_BY"]
    result = {"commit": args.commit or "working tree", **measure(read_contract(args.commit), removed_by)}
    restated = measure_restated(args.commit)
    result["restated_lines"] = sum(restated.values())
    result["restated_by_file"] = restated
    print(json.dumps(result))


if __name__ == "__main__":
    main()
