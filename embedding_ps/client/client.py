"""PS client: scatter ids by shard -> one request per shard, all in flight -> gather in caller order.

    with PSClient(config, addresses, worker_id=rank) as ps:
        rows = ps.pull_many_async([0, 1], [ids0, ids1]).result()   # float32 [N0 + N1, D]
        ps.push_many_async([0, 1], [ids0, ids1], grads)            # grads float32 [N0 + N1, D]
        rows = ps.pull(0, ids)                 # one table: a request with one part
        ps.barrier(step)                       # sync mode: "this worker is done with `step`"

`PSClient` implements `embedding_ps.store.EmbeddingStore`. A trainer's step touches every table:
each shard gets one PULL / PUSH whose parts are the tables' ids routed to it (wire:
`embedding_ps.wire.protocol`). A shard request over ps.max_frame_bytes is sent as one request per
table instead (and one table's request over it is refused: split the ids).

The caller's thread deduplicates (when `dedup`: `plan.dedup_ids`), routes (`plan.plan_call`) and
encodes; the I/O thread (`embedding_ps.client.transport`) sends, matches replies by request id,
retries and assembles the result. Rows and gradients travel as ps.wire_dtype; with
ps.shared_memory, those of a shard on this host go through shared-memory segments instead
(docs/wire.md), and a pull from one shard returns a tensor viewing its segment.

Timeouts and retries: a request unanswered for ps.timeout_s is sent again, up to ps.retries
times, then its future fails with ShardUnavailableError naming the shard index and address. A
retried push or barrier keeps its request id, and the shard answers a repeat from its replay cache,
so it is never applied twice. A shard's error reply fails the future with PSRequestError at once
(no retry). In sync mode a pull may be held by the shard until the slowest worker's barrier: set
ps.timeout_s above the longest step of the slowest worker.

Step: every request carries the client's step (`step`, default 0); `barrier(t)` sets it to t + 1,
so a trainer that calls pull/push/barrier in order needs no step arguments (see embedding_ps.shard.gates
for the sync contract).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from embedding_ps.wire import protocol as P
from embedding_ps import native
from embedding_ps.wire import shm
from embedding_ps.wire.auth import job_tag, load_token
from embedding_ps.wire.config import PSConfig
from embedding_ps.client.plan import combine, frames, index_frame, plan_call
from embedding_ps.client.segments import ClientSegments, LateGrads, NotifiedFuture
from embedding_ps.store import call_dim, cat, done_future
from embedding_ps.client.transport import Call, IOThread, PSRequestError, Request, ShardError, ShardUnavailableError

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0


class SaveFailedError(ShardError, RuntimeError):
    """A shard's save failed (or its last save is not the one waited for); names shard and address."""


class SaveTimeoutError(ShardError, TimeoutError):
    """A shard still wrote its background save when `wait_saved` gave up; names shard and address."""


class PSClient:
    """Pull rows from / push gradients to every PS shard (an `EmbeddingStore`). See the module docstring.

    addresses: `tcp://host:port` of shard 0..S-1. worker_id: this trainer's rank (sync mode).
    dedup: deduplicate ids before sending (one hash pass in C, or torch.unique's sort without the C
    library; a duplicate's gradients are summed here, in arrival order). A caller whose ids are
    already unique (the sparse arch) passes False and saves that pass; duplicates stay correct
    either way (the shard sums duplicate gradients), they only cost wire bytes.
    late_grads, notify: shared-memory requests use protocol.FLAG_GRADS_LATE (fp32 pushes) and
    FLAG_NOTIFY (`segments.NotifiedFuture`; docs/wire.md). Both on in the product (the measured
    winners); benchmarks/ps_shm_push.py and ps_throughput.py compare them with off.
    pin_rows: pulled rows assembled from several shards' replies land in page-locked memory (a
    trainer on a GPU: `recsys.models.on_device` then copies them without staging; needs CUDA).
    """

    def __init__(self, config: PSConfig, addresses: Sequence[str], worker_id: int = 0, *,
                 dedup: bool = True, late_grads: bool = True, notify: bool = True, pin_rows: bool = False) -> None:
        if len(addresses) != config.num_shards:
            raise ValueError(f"PSClient: {len(addresses)} addresses for ps.num_shards = {config.num_shards}")
        if not 0 <= worker_id < 2**32:
            raise ValueError(f"PSClient: worker_id must be in [0, 2**32), got {worker_id}")
        self.config, self.addresses, self.worker_id = config, list(addresses), worker_id
        self.step = 0
        self.dedup, self.late_grads, self.notify, self.pin_rows = dedup, late_grads, notify, pin_rows
        self.wire = P.WIRE_DTYPES[config.wire_dtype]
        self._token = load_token(config) if config.auth == "token" else b""
        self._client = secrets.randbits(64)
        self._ids = itertools.count(1)
        self._pushes: set[Future] = set()
        self._lock = threading.Lock()
        # ps.shared_memory: row frames of shards on this host go through shared memory (embedding_ps.wire.shm)
        self._shm = ClientSegments(self.addresses, config.shared_memory, job=job_tag(config, self._token))
        self._io = IOThread(config, self.addresses, self._token)
        self._io.start()
        self._closed = False

    # -- rows -----------------------------------------------------------------------------------

    def pull_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor],
                        step: int | None = None) -> "Future[torch.Tensor]":
        """A Future of float32 rows [sum N_t, D]: the rows of every table's int64 ids [N_t], in order."""
        dim = call_dim(self.config, tables, ids)
        plan = plan_call(self.config, self.dedup, tables, ids)
        shards = plan.by_shard(plan.sent)
        if not shards:
            return done_future(torch.empty(0, dim))
        if self._too_big("pull", tables, shards, dim):     # one request per table instead
            return combine([self.pull_async(t, x, step) for t, x in zip(tables, ids)], torch.cat)
        notify = self.notify and native.available()
        reqs, segs, fallbacks, words = self._requests(P.Op.PULL, tables, shards, dim, step, notify)
        counts = {s: [c.numel() for _, c in parts] for s, parts in shards.items()}
        call = [] if segs else None        # the Call, to see retries (the done callback lets go of it)

        def assemble(replies: dict) -> torch.Tensor:
            return plan.assemble(counts, replies, dim, segs, call, self.pin_rows)

        future = None
        if words and len(words) == len(shards):     # every shard notifies: the rows without the replies
            stub = {s: (P.Header(op=P.Op.PULL, dtype=self.wire), []) for s in shards}
            future = NotifiedFuture(words, lambda: assemble(stub), lambda out: self._shm.settle(segs, out))
        fut = self._submit(P.Op.PULL, reqs, assemble, call, fallbacks, future)
        if segs:
            fut.add_done_callback(self._shm.on_done(segs, call))
        return fut

    def push_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor], grads: torch.Tensor,
                        step: int | None = None) -> "Future[None]":
        """Send float32 grads [sum N_t, D] of every table's ids [N_t] (rows in pull_many's order)."""
        dim = call_dim(self.config, tables, ids, grads)
        grads = grads.detach().to("cpu", torch.float32)
        plan = plan_call(self.config, self.dedup, tables, ids)
        shards = plan.by_shard(plan.sent)
        if not shards:
            return done_future(None)
        if self._too_big("push", tables, shards, dim):     # one request per table instead
            splits = torch.split(grads, [x.numel() for x in ids])
            return combine([self.push_async(t, x, g, step) for t, x, g in zip(tables, ids, splits)],
                            lambda _: None)
        fast = native.available()         # late grads and done words wait on C's futexes
        late = LateGrads() if self.late_grads and self.wire == P.DType.FP32 and fast else None
        reqs, segs, fallbacks, words = self._requests(P.Op.PUSH, tables, shards, dim, step, self.notify and fast,
                                                      plan.by_shard(plan.to_sent(grads)), late)

        call = [] if segs else None
        future = (NotifiedFuture(words, lambda: None, lambda _: self._shm.settle(segs))
                  if words and len(words) == len(shards) else None)
        sent = False
        try:            # late: the I/O thread is woken by the first copy (no contention for the GIL)
            # finish: None, holding the segments until the reply
            fut = self._submit(P.Op.PUSH, reqs, lambda _, busy=segs: None, call, fallbacks, future, wake=not late)
            sent = True
        finally:
            if late:       # the shards wait for the grads (abandoned if _submit failed)
                late.write(self._io.wake_w if sent else -1, self._io.wake if sent else None)
        if segs:
            fut.add_done_callback(self._shm.on_done(segs, call))
        with self._lock:
            self._pushes.add(fut)
        fut.add_done_callback(self._push_done)
        return fut

    def pull_async(self, table: int, ids: torch.Tensor, step: int | None = None) -> "Future[torch.Tensor]":
        """A Future of float32 rows [N, D] of one table's int64 ids [N] (any order, duplicates fine)."""
        return self.pull_many_async([table], [ids], step)

    def pull(self, table: int, ids: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """float32 rows [N, D] of int64 ids [N]."""
        return self._wait(self.pull_async(table, ids, step))

    def push_async(self, table: int, ids: torch.Tensor, grads: torch.Tensor,
                   step: int | None = None) -> "Future[None]":
        """Send float32 grads [N, D] of one table's ids [N]; rows of duplicate ids get the sum."""
        return self.push_many_async([table], [ids], grads, step)

    def push(self, table: int, ids: torch.Tensor, grads: torch.Tensor, step: int | None = None) -> None:
        self._wait(self.push_async(table, ids, grads, step))

    # -- whole-shard operations -----------------------------------------------------------------

    def barrier(self, step: int) -> None:
        """Wait for this client's pushes, tell every shard this worker is done with `step`.

        Sets `self.step = step + 1`. Sync mode: the shards apply step `step` once every worker
        has called barrier(step); async mode: reports progress (for ps.max_staleness).
        """
        with self._lock:
            pushes = list(self._pushes)
        for fut in pushes:
            self._wait(fut)
        self._broadcast(P.Op.BARRIER, step=step)
        self.step = step + 1

    def barrier_async(self, step: int) -> "Future[list]":
        """`barrier(step)` without waiting for this client's pushes or the shards' replies.

        For async mode, where the barrier only reports progress: each shard serves one
        connection's requests in order, so it sees this worker's pushes of `step` before the
        barrier (unless a push had to be retried after a timeout). Sets `self.step = step + 1`.
        """
        fut = self._broadcast_async(P.Op.BARRIER, step=step)
        self.step = step + 1
        return fut

    def stats(self) -> list[dict]:
        """Per shard (in shard order): request counts, errors, sync state and `ShardState.stats()`."""
        return self._broadcast(P.Op.STATS)

    def health(self) -> list[dict]:
        return self._broadcast(P.Op.HEALTH)

    def save(self, directory: str, step: int | None = None, background: bool = False) -> list[dict]:
        """Every shard saves its state under `directory`/shard<i> (a path on the shards' machine).

        step: the request's step (default `self.step`); in sync mode each shard first applies
        every step < `step`. background=False: returns once every shard has written its files,
        [{"shard", "directory", "background": False, "write_s", "bytes"}, ...]. background=True:
        returns once every shard has copied its state (the consistent cut; pushes after it are
        not in the save): [{"shard", "directory", "snapshot_s", "background": True}, ...], while
        the shards write in the background: `wait_saved(directory, timeout_s)` before relying on it.
        A shard still writing an earlier background save finishes that one first.
        """
        flags = P.FLAG_BACKGROUND if background else 0
        return self._broadcast(P.Op.SAVE, step=step, text=directory, flags=flags)

    def save_status(self) -> list[dict]:
        """Per shard, the last save: {"shard", "root" (the directory a client named), "directory" (the
        shard's part under it), "state": "none" | "writing" | "done" |
        "failed", "error", "write_s", "bytes", "snapshot_s", "prepare_s", "background", "step",
        "extra_bytes_peak", "extra_bytes_bound", "push_wait_s"} (`embedding_ps.shard.saver`)."""
        return self._broadcast(P.Op.SAVE_STATUS)

    def wait_saved(self, directory: str, timeout_s: float) -> list[dict]:
        """Poll `save_status` until every shard's last save is `directory` and done; returns the statuses.

        Raises SaveFailedError naming the shard index and address if a shard's write failed or its
        last save is another directory, SaveTimeoutError if one still writes after `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            statuses = self.save_status()
            for s, st in enumerate(statuses):
                if st["root"] != directory:
                    raise SaveFailedError(s, self.addresses[s], f"its last save is {st['directory']!r} "
                                          f"({st['state']}), not one under {directory!r}")
                if st["state"] == "failed":
                    raise SaveFailedError(s, self.addresses[s], f"save to {st['directory']} failed: {st['error']}")
            writing = [s for s, st in enumerate(statuses) if st["state"] != "done"]
            if not writing:
                return statuses
            left = deadline - time.monotonic()
            if left <= 0:
                s = writing[0]
                raise SaveTimeoutError(s, self.addresses[s], f"save to {statuses[s]['directory']} still "
                                       f"{statuses[s]['state']} after {timeout_s:g} s")
            time.sleep(min(delay, left))
            delay = min(2 * delay, 0.25)

    def load(self, directory: str) -> list[dict]:
        """Every shard loads its state from `directory`."""
        return self._broadcast(P.Op.LOAD, text=directory)

    def sweep(self, step: int) -> list[dict]:
        """Every shard drops rows past their TTL as of `step`; returns `ShardState.sweep` per shard."""
        return self._broadcast(P.Op.SWEEP, step=step)

    def shutdown(self) -> None:
        """Ask every shard process to exit (after replying)."""
        self._broadcast(P.Op.SHUTDOWN)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._io.is_alive():
            self._io.submit(None)
            self._io.join(CLOSE_TIMEOUT_S)
            if self._io.is_alive():
                logger.warning("PSClient I/O thread did not stop within %g s", CLOSE_TIMEOUT_S)
        self._shm.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _header(self, op: P.Op, step: int | None = None, **fields: int) -> P.Header:
        return P.Header(op=op, step=self.step if step is None else step, worker=self.worker_id,
                        client=self._client, request=next(self._ids), **fields)

    def _submit(self, op: P.Op, reqs: list[tuple[int, P.Header, list]],
                finish: Callable[[dict], Any], call_out: list | None = None,
                fallbacks: dict[int, Callable] | None = None, future: Future | None = None,
                wake: bool = True) -> Future:
        if self._closed:
            raise RuntimeError("PSClient is closed")
        call = Call(op, future or Future(), finish, waiting=len(reqs))
        if call_out is not None:
            call_out.append(call)
        fallbacks = fallbacks or {}
        items = [Request(call, shard, h.request, [h.pack(), self._token, *payload], fallback=fallbacks.get(shard))
                 for shard, h, payload in reqs]
        self._io.submit(items, wake)
        return call.future

    def _requests(self, op: P.Op, tables: Sequence[int], shards: dict[int, list[tuple[int, torch.Tensor]]],
                  dim: int, step: int | None, notify: bool, grads: dict | None = None,
                  late: "LateGrads | None" = None) -> tuple[list, dict, dict, list]:
        """(requests [(shard, header, payload)], segs {shard: the rows of its segment}, fallbacks {shard:
        `_fallback`}, done words with `notify`) of a PULL (grads None) or PUSH of `shards`' parts: through
        a shared-memory segment where `self._shm` gives one (a shard on this host), else the socket.
        grads: {shard: [(part, grads [M_p, D])]}, written cast to the wire dtype into the segment (by
        `late` when given) or into a frame."""
        reqs, segs, fallbacks, words = [], {}, {}, []
        for shard, parts in shards.items():
            m = sum(c.numel() for _, c in parts)
            rows_bytes = m * dim * P.ITEM_SIZE[self.wire]
            seg = self._shm.take(shard, shm.seg_bytes(rows_bytes, m, bool(late or notify)))   # rows, ids, trailer
            flags = (P.FLAG_SHM | (P.FLAG_GRADS_LATE if late else 0) | (P.FLAG_NOTIFY if notify else 0)) if seg else 0
            h = self._header(op, step, dtype=self.wire, count=len(parts), dim=dim, flags=flags)
            g = None if grads is None else [c for _, c in grads[shard]]
            if seg is None:          # grads [M_s, D] cast to the wire dtype (no copy for fp32)
                rows = [] if g is None else [P.tensor_frame(cat(g).to(P.TORCH_DTYPES[self.wire]))]
                reqs.append((shard, h, [*frames(tables, parts), *rows]))
                continue
            torch.cat([c for _, c in parts], out=shm.ids_view(seg[1], rows_bytes, m))   # ids [M_s] (shm.ids_offset)
            if notify:               # its done word, reset to "not served"
                words.append(shm.done_word(shm.trailer(seg[1], rows_bytes, m)))
                words[-1][0] = 0
            segs[shard] = seg[1][:rows_bytes]
            dst = None
            if g is not None:        # the grads go into the segment, cast to the wire type: [M_s, D]
                dst = P.frame_tensor(memoryview(segs[shard]), self.wire, m, dim)
                if late:             # written once the request is on its way (LateGrads.write)
                    late.add(h.request, g, dst, shm.trailer(seg[1], rows_bytes, m))
                elif len(g) > 1 and self.wire == P.DType.FP32:
                    torch.cat(g, out=dst)
                else:
                    dst.copy_(cat(g))
            fallbacks[shard] = self._fallback(shard, h, tables, parts, segs, dst, late)
            reqs.append((shard, h, [index_frame(tables, parts), b"", seg[0]]))
        return reqs, segs, fallbacks, words

    def _fallback(self, shard: int, h: P.Header, tables: Sequence[int], parts: list, segs: dict,
                  grads: torch.Tensor | None = None, late: "LateGrads | None" = None
                  ) -> Callable[[str], tuple[int, list]]:
        """The socket form of a shared-memory PULL (grads None) or PUSH (grads: wire dtype [M, D] in the
        segment, written by `late` when given) to `shard`, for when the shard answers NO_SHM; called
        on the I/O thread."""
        def fallback(message: str) -> tuple[int, list]:
            if late is not None and not late.wait(self.config.timeout_s):
                raise RuntimeError(f"push to ps shard {shard}: its grads were not written into shared memory")
            self._shm.refused(shard, message)
            segs.pop(shard, None)          # the shard never opened it: no rows there, reusable
            again = dataclasses.replace(h, flags=h.flags & ~P.FLAG_SHM, request=next(self._ids))
            rows = [] if grads is None else [P.tensor_frame(grads.clone())]
            return again.request, [again.pack(), self._token, *frames(tables, parts), *rows]

        return fallback

    def _broadcast(self, op: P.Op, step: int | None = None, text: str | None = None, flags: int = 0) -> list:
        return self._wait(self._broadcast_async(op, step, text, flags))

    def _broadcast_async(self, op: P.Op, step: int | None = None, text: str | None = None,
                         flags: int = 0) -> Future:
        payload = [] if text is None else [P.text_frame(text)]
        reqs = [(s, self._header(op, step=step, dtype=P.DType.BYTES if text else P.DType.NONE,
                                 count=len(payload[0]) if text else 0, flags=flags), payload)
                for s in range(self.config.num_shards)]

        def finish(parts: dict[int, tuple[P.Header, list]]) -> list:
            return [json.loads(bytes(parts[s][1][0])) if parts[s][1] else None for s in range(len(reqs))]

        return self._submit(op, reqs, finish)

    def _wait(self, fut: Future) -> Any:
        # the I/O thread fails every future by its deadline; this bound only guards against a bug
        return fut.result(timeout=self.config.timeout_s * (self.config.retries + 1) + 30.0)

    def _push_done(self, fut: Future) -> None:
        with self._lock:
            self._pushes.discard(fut)

    def _too_big(self, op: str, tables: Sequence[int], shards: dict[int, list[tuple[int, torch.Tensor]]],
                 dim: int) -> bool:
        """Whether a shard's request would pass ps.max_frame_bytes (module docstring); one table: ValueError."""
        limit = self.config.max_frame_bytes
        for shard, parts in shards.items():
            n = sum(c.numel() for _, c in parts)
            size = max(n * dim * P.ITEM_SIZE[self.wire], 16 * len(parts), 8 * n)
            if size <= limit:
                continue
            if len(tables) > 1:
                return True
            raise ValueError(f"{op} of {n} rows of table {tables[0]} (dim {dim}) to ps shard {shard} at "
                             f"{self.addresses[shard]} is {size} bytes, over ps.max_frame_bytes = {limit}; "
                             f"split the ids")
        return False


__all__ = ["PSClient", "ShardUnavailableError", "PSRequestError", "SaveFailedError", "SaveTimeoutError"]
