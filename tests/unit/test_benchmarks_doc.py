"""BENCHMARKS.md: the summary table at its top is complete, one section per benchmark script, and every section
the code cites exists (as do the history files it cites)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "BENCHMARKS.md").read_text()
HEADINGS = re.findall(r"^## (.+)$", DOC, re.M)
CITE = re.compile(r'BENCHMARKS\.md, (?:section )?"([^"]+)"')
HISTORY = re.compile(r"benchmarks/history/[\w.-]+\.md")
PACKAGES = ("recsys", "embedding_ps", "data", "benchmarks")


def _exists(section: str) -> bool:
    return any(h.startswith(section) for h in HEADINGS)


def _joined(path: Path) -> str:
    """The file's text with line breaks, indentation and comment marks folded into single spaces."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())


def _sources() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]


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
        assert section in HEADINGS, f"the summary names a section this file does not have: {row}"


def test_one_section_per_benchmark_script_and_each_names_a_script() -> None:
    scripts = [h for h in HEADINGS if h.startswith("benchmarks/")]
    assert len(scripts) >= 15
    assert len(scripts) == len(set(scripts)), "a script has two sections"
    for heading in scripts:
        assert re.fullmatch(r"benchmarks/\w+\.py", heading), heading
        assert (ROOT / heading).is_file(), f"section for a script that does not exist: {heading}"


def test_code_cites_existing_sections() -> None:
    cited: dict[str, list[str]] = {}
    for path in _sources():
        for section in CITE.findall(_joined(path)):
            cited.setdefault(section, []).append(str(path.relative_to(ROOT)))
    assert "benchmarks/ps_table.py" in cited                    # where kernel = "fbgemm" is weighed
    assert "embedding_ps/shard/kernels.py" in cited["benchmarks/ps_table.py"]
    missing = {s: files for s, files in cited.items() if not _exists(s)}
    assert not missing, f"sections cited but not in BENCHMARKS.md: {missing}"


def test_cited_history_files_exist() -> None:
    cited = {m: str(p.relative_to(ROOT)) for p in _sources() for m in HISTORY.findall(p.read_text())}
    cited.update({m: "BENCHMARKS.md" for m in HISTORY.findall(DOC)})
    assert cited, "nothing cites benchmarks/history/"
    missing = {m: where for m, where in cited.items() if not (ROOT / m).is_file()}
    assert not missing, f"history files cited but missing: {missing}"
    index = (ROOT / "benchmarks/history/README.md").read_text()
    for f in sorted((ROOT / "benchmarks/history").glob("*.md")):
        if f.name != "README.md":
            assert f"]({f.name})" in index, f"benchmarks/history/README.md does not list {f.name}"
