"""Process set-up shared by every recsys entry point (`recsys` CLI, `python -m recsys.train`, a
trainer process of the local launcher): the one logging configuration and the environment
variables recsys turns into plain settings of the packages (which read none)."""

from __future__ import annotations

import logging
import os

NATIVE_ENV_VAR = "EMBEDDING_PS_NATIVE"
"""`EMBEDDING_PS_NATIVE=0` turns off the shards' C fast path (`embedding_ps.native.set_enabled`)."""


def setup_logging(verbose: bool = False, role: str | None = None, log_file: str | None = None) -> None:
    """`role` (e.g. "trainer1") replaces the logger name; `log_file`: every record also goes there
    (appended; a trainer's log in the run directory)."""
    fmt = f"%(asctime)s %(levelname)s {role or '%(name)s'}: %(message)s"
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=fmt)
    # a host that configured logging first (a Ray worker) keeps its handlers; our level still applies
    logging.getLogger().setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:
        for handler in logging.getLogger().handlers:    # fbgemm_gpu logs an INFO line per library it loads
            handler.addFilter(_quiet_fbgemm)
        # torch elastic logs each failed worker with a traceback; recsys says it in one line
        for noisy in ("torch.distributed.elastic", "torch.multiprocessing"):
            logging.getLogger(noisy).setLevel(logging.CRITICAL)
    if log_file is not None:
        os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter(fmt))
        logging.getLogger().addHandler(handler)


def _quiet_fbgemm(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or "fbgemm_gpu" not in record.pathname


def apply_environment() -> None:
    """EMBEDDING_PS_NATIVE and XDG_CACHE_HOME (where the shard's C fast path is cached) as native's settings."""
    value, xdg = os.environ.get(NATIVE_ENV_VAR), os.environ.get("XDG_CACHE_HOME")
    if value is None and not xdg:
        return
    from embedding_ps import native

    if value is not None:
        native.set_enabled(value.strip().lower() not in ("0", "false", "off", "no"))
    if xdg:
        native.set_cache_dir(os.path.join(xdg, "recsys-hybrid"))


__all__ = ["NATIVE_ENV_VAR", "apply_environment", "setup_logging"]
