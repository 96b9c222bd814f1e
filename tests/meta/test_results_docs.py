"""docs/results.md quotes the committed analyses of issue 27 exactly: the docs and the data agree."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "sanity" / "results"
# Each committed analysis and how many of its leading tables docs/results.md quotes (the cells and the tests; the
# Fig. 6 histograms are quoted through fig6_vocab.md).
QUOTED = {
    RESULTS / "mismatch_seeds100" / "compare.md": 2,
    RESULTS / "bpe_seeds40" / "compare.md": 2,
    RESULTS / "fig6_vocab" / "fig6_vocab.md": 1,
}


def _tables(markdown: str) -> list[list[str]]:
    tables, current = [], []
    for line in markdown.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables + ([current] if current else [])


@pytest.mark.parametrize("path", sorted(QUOTED), ids=lambda p: str(p.relative_to(RESULTS)))
def test_results_page_quotes_the_committed_tables(path):
    docs = (ROOT / "docs" / "results.md").read_text(encoding="utf-8").splitlines()
    analysis = path.read_text(encoding="utf-8")
    assert "interim" not in analysis.split("\n\n", 2)[1], f"{path.name} is still interim"
    for table in _tables(analysis)[: QUOTED[path]]:
        for row in table[2:]:  # the data rows; headers may be reworded
            assert row in docs, f"docs/results.md does not quote this row of {path.relative_to(ROOT)}:\n{row}"
