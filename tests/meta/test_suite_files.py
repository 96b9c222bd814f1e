"""The suite collects as a whole: pytest's default import mode puts each test folder on `sys.path` and imports test
files by basename, so two test files with one basename fail the whole run at collection."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_file_basenames_are_unique():
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert not [name for name, count in names.items() if count > 1], names.most_common(3)
