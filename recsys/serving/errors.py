"""The error of serving's inputs (kept apart so that every serving module can raise it without cycles)."""

from __future__ import annotations


class ExportError(ValueError):
    """An export directory or file is missing, corrupt or does not fit; the message names it."""
