"""A PS shard's saves: blocking (`save`), or snapshot now + write on a background thread (`start`); the
last one's status.

Status of the last save (what SAVE_STATUS returns)::

    {"shard": i, "directory": "<dir>/shard<i>" | None, "state": "none" | "writing" | "done" | "failed",
     "error": "<type>: <message>" | None, "write_s": s | None, "bytes": n | None,
     "snapshot_s": s | None, "prepare_s": s | None, "background": bool | None, "step": t | None,
     "extra_bytes_peak": n | None, "extra_bytes_bound": n | None, "push_wait_s": s | None}

snapshot_s is the pause (the snapshot under the shard's lock); prepare_s is 0 (nothing is prepared
ahead); extra_bytes_peak / _bound the background save's accounted extra memory and its bound
(`ps.checkpoint_extra_memory`), push_wait_s how long updates waited for the writer.

A failed write leaves no half directory behind (`ShardSnapshot.write` removes its tmp dir), is
logged, and is reported here; the server keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

JOIN_LOG_S = 10.0
"""`wait()` logs that it is still waiting every this many seconds."""
_COW_KEYS = ("extra_bytes_peak", "extra_bytes_bound", "push_wait_s")
"""Figures of a copy-on-write save (`CowSave.stats`) the status reports once the write ended."""


class BackgroundSaver:
    """Runs one shard's saves; thread-safe `status`. `name` ("ps shard 3") prefixes log lines."""

    def __init__(self, name: str, shard: int) -> None:
        self.name, self.shard = name, shard
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._snap: Any = None
        self.busy = False
        """True while a write runs (its status is not final yet)."""
        self._finished = threading.Event()
        self._begin(None, "none")

    def start(self, state: Any, directory: str, step: int) -> dict:
        """Snapshot `state` now, write it to `directory` on a thread; returns the SAVE reply body.
        Not while `busy` (the caller parks the request); raises whatever `state.snapshot()` raises
        (nothing is started then).
        """
        snap = state.snapshot()
        self._begin(directory, "writing", snapshot_s=snap.snapshot_s, prepare_s=0.0, background=True, step=step)
        self.busy = True
        self._finished.clear()
        self._snap = snap          # handed over through an attribute, so the thread's args keep no reference
        self._thread = threading.Thread(target=self._write, args=(directory,), name=f"{self.name} save",
                                        daemon=True)
        self._thread.start()
        logger.info("%s: snapshot for %s in %.3f s (%.1f MB); writing in the background", self.name, directory,
                    snap.snapshot_s, snap.nbytes / 1e6)
        return {"shard": self.shard, "directory": directory, "snapshot_s": snap.snapshot_s, "background": True}

    def save(self, state: Any, directory: str, step: int) -> dict:
        """`state.save(directory)` now (blocking, not while `busy`); recorded in the status, errors re-raised."""
        t0 = time.perf_counter()
        self._begin(directory, "writing", background=False, step=step)
        try:
            info = state.save(directory) or {}
        except Exception as e:
            self._end("failed", error=f"{type(e).__name__}: {e}", write_s=time.perf_counter() - t0)
            raise
        self._end("done", write_s=info.get("write_s", time.perf_counter() - t0), bytes=info.get("bytes"))
        logger.info("%s: saved to %s", self.name, directory)
        return {"shard": self.shard, "directory": directory, "background": False, "write_s": self._status["write_s"],
                "bytes": self._status["bytes"]}

    def status(self) -> dict:
        with self._lock:
            return dict(self._status)

    def take_finished(self) -> bool:
        """True once after a write ended (the server then retries parked requests)."""
        if self._finished.is_set():
            self._finished.clear()
            return True
        return False

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for a running write to end (shutdown); False if it still runs after `timeout_s`."""
        thread = self._thread
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while thread is not None and thread.is_alive():
            left = JOIN_LOG_S if deadline is None else min(JOIN_LOG_S, deadline - time.monotonic())
            if left <= 0:
                return False
            thread.join(left)
            if thread.is_alive():
                logger.info("%s: waiting for the background save to %s", self.name, self._status["directory"])
        return True

    # -- internals ------------------------------------------------------------------------------

    def _write(self, directory: str) -> None:
        t0 = time.perf_counter()
        snap, self._snap = self._snap, None
        try:
            try:
                info = snap.write(directory)
                end = {"state": "done", "write_s": info["write_s"], "bytes": info["bytes"]}
            except Exception as e:     # reported through the status; the shard keeps serving
                logger.exception("%s: background save to %s failed", self.name, directory)
                end = {"state": "failed", "error": f"{type(e).__name__}: {e}", "write_s": time.perf_counter() - t0}
            stats = snap.stats()
            self._end(**end, **{k: stats.get(k) for k in _COW_KEYS})
        finally:
            snap = None            # the snapshot's memory goes back now, not when the next save starts
            self.busy = False
            self._finished.set()

    def _end(self, state: str, **fields: Any) -> None:
        with self._lock:
            self._status.update(state=state, **fields)

    def _begin(self, directory: str | None, state: str, **fields: Any) -> None:
        with self._lock:
            self._status = {"shard": self.shard, "directory": directory, "state": state, "error": None, "write_s": None,
                            "bytes": None, "snapshot_s": None, "prepare_s": None, "background": None, "step": None,
                            **dict.fromkeys(_COW_KEYS), **fields}


__all__ = ["BackgroundSaver"]
