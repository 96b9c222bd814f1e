"""The code base stays `ruff` clean (lint and format), as CI would otherwise not notice."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("ruff is not installed: it is part of the `test` extra")
    return [exe]


def test_ruff_check():
    result = subprocess.run([*_ruff(), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format():
    result = subprocess.run([*_ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_test_asserts_a_measured_time():
    # A wall-clock figure depends on the machine and its load; compared with anything (even `> 0`) it fails by chance.
    timed = re.compile(
        r"(time|_s|seconds|elapsed|duration|per_token|speed)[\"'\]]*\)?\]?\s*(>|>=|<|<=)\s*[-0-9.]"
        r"|\b(t|dt|elapsed)\s*(>|>=|<|<=)\s*[-0-9.]"
    )
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if line.lstrip().startswith("assert") and timed.search(line)
    ]
    assert not offenders, "tests must not assert measured times:\n" + "\n".join(offenders)
