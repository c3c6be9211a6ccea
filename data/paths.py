"""Data path templates (`{date}`, `{date-1}`, ...) and the glob rule shared by local paths and URIs.

What the placeholders and globs mean, and which names a listing or a glob skips: docs/daily.md,
"Date-partitioned data, warm start and the daily job" (Paths). A path that names nothing fails where
it is listed, not here.
"""

from __future__ import annotations

import datetime
import fnmatch
import re

HIDDEN = (".", "_")
"""A file or directory whose name starts with one of these is not data (directory listings and globs skip it)."""

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_PLACEHOLDER = re.compile(r"\{date(?:([+-])(\d+))?(?::([^{}]+))?\}")
_LOOKALIKE = re.compile(r"\{\s*date\b[^{}]*\}", re.IGNORECASE)


def parse_date(text: str) -> datetime.date:
    """The day `text` names (`YYYY-MM-DD`, a real calendar day); ValueError otherwise."""
    if not isinstance(text, str) or not _DATE.fullmatch(text):
        raise ValueError(f"expected a date YYYY-MM-DD, got {text!r}")
    try:
        return datetime.date.fromisoformat(text)
    except ValueError:
        raise ValueError(f"expected a date YYYY-MM-DD, got {text!r} (no such day)") from None


def has_date(path: str) -> bool:
    """Whether `path` holds a date placeholder (or something that looks like one)."""
    return _LOOKALIKE.search(path) is not None


def fill_date(path: str, date: str) -> str:
    """`path` with every `{date±N[:FMT]}` replaced by that day (`date`: `YYYY-MM-DD`). ValueError
    for a malformed placeholder, or for a placeholder when `date` is "" (no date given)."""
    if not has_date(path):
        return path
    if not date:
        raise ValueError("has a {date} placeholder but no date is set")
    day = parse_date(date)

    def one(m: re.Match[str]) -> str:
        sign, n, fmt = m.groups()
        try:
            d = day + datetime.timedelta(days=(-1 if sign == "-" else 1) * int(n or 0))
        except OverflowError:
            raise ValueError(f"{m.group(0)}: {date} {sign}{n} days is outside the calendar") from None
        return d.strftime(fmt) if fmt else d.isoformat()

    out = _PLACEHOLDER.sub(one, path)
    bad = _LOOKALIKE.search(_PLACEHOLDER.sub("", path))
    if bad:
        raise ValueError(f"{bad.group(0)} is not a date placeholder (use {{date}}, {{date-N}}, {{date+N}}, "
                         f"optionally with :FMT, e.g. {{date-1:%Y/%m/%d}})")
    return out


def glob_match(pattern: str, path: str) -> bool:
    """Whether `/`-separated `path` matches glob `pattern` name by name, as `glob.glob(pattern,
    recursive=True)` matches it, except that a name starting with `.` or `_` is matched only by a
    pattern name that starts with the same character (never by `*` or `**`)."""
    return _match(tuple(p for p in pattern.split("/") if p), tuple(p for p in path.split("/") if p))


def _match(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    if not pattern:
        return not parts
    head = pattern[0]
    if head == "**":                     # zero or more directories, none of them hidden
        for i in range(len(parts) + 1):
            if _match(pattern[1:], parts[i:]):
                return True
            if i < len(parts) and parts[i].startswith(HIDDEN):
                return False
        return False
    return (bool(parts) and fnmatch.fnmatchcase(parts[0], head)
            and (not parts[0].startswith(HIDDEN) or head.startswith(parts[0][0])) and _match(pattern[1:], parts[1:]))


__all__ = ["HIDDEN", "fill_date", "glob_match", "has_date", "parse_date"]
