"""BENCHMARKS.md: the summary table at its top is complete, and every section the code cites exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "BENCHMARKS.md").read_text()
HEADINGS = re.findall(r"^## (.+)$", DOC, re.M)
CITE = re.compile(r'BENCHMARKS\.md, (?:section )?"([^"]+)"')


def _exists(section: str) -> bool:
    return any(h.startswith(section) for h in HEADINGS)


def _joined(path: Path) -> str:
    """The file's text with line breaks, indentation and comment marks folded into single spaces."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())


def test_summary_table_is_first_and_complete() -> None:
    assert HEADINGS[0] == "Summary: every current figure"
    table = DOC.split("## Summary: every current figure\n", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| figure |")]
    assert len(rows) >= 20
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 7, row
        figure, value, _target, date, machine, command, section = cells
        assert figure and value and date and machine and section, row
        assert command.startswith("`") or command.startswith("same run"), row


def test_code_cites_existing_sections() -> None:
    cited: dict[str, list[str]] = {}
    for package in ("recsys", "embedding_ps", "data", "benchmarks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for section in CITE.findall(_joined(path)):
                cited.setdefault(section, []).append(str(path.relative_to(ROOT)))
    assert "Update kernels: fbgemm vs native C vs torch" in cited          # where kernel = "fbgemm" is weighed
    assert "benchmarks/ps_table.py" in cited["Update kernels: fbgemm vs native C vs torch"]
    missing = {s: files for s, files in cited.items() if not _exists(s)}
    assert not missing, f"sections cited but not in BENCHMARKS.md: {missing}"
