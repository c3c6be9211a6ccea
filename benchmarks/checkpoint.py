"""What a PS shard checkpoint costs: blocking save, load, and a background save's pause, extra memory and write.

    python benchmarks/checkpoint.py [--json] [--rows 1e5,1e6,1e7] [--dim 64] [--repeats 1] [--threads 2]
                                    [--push-rows 8192] [--push-zipf A] [--tmpdir DIR] [--no-server]

For each size, one in-process ShardState holds one table of `rows` rows x `dim` fp32 with row-wise
Adagrad (`ps.checkpoint_extra_memory` at its default, 0.1), filled by pushing every id once (chunks
of 2**18). Timed, on the same state:

- blocking save: `ShardState.save(dir)`: checksummed files written under the lock (the shard
  serves nothing meanwhile), fsynced, renamed into place. The baseline of every ratio.
- background save, as the server does it, with training-like pushes running DURING it: a thread
  pushes `--push-rows` random existing ids (unique; uniform over the table, the worst case for the
  side buffer, or Zipf with `--push-zipf A`: hot rows need one pre-image each) per step, back to back,
  from the snapshot until the write ended, so that copy-on-write is exercised. `snapshot()` is the
  pause (the shard's lock held, serving nothing; copies the id map and small arrays and freezes the
  rows copy-on-write), then `ShardSnapshot.write(dir)` (the writer, here on the main thread) walks
  the rows in chunks, each copied under the lock (`chunk_hold_max_s`: the longest such hold).
  The pushes of rows the writer has not passed first save their pre-image in the side buffer, and
  wait for the writer when it is full (`push_wait_s` in all, `pushes_during_save` steps made).
- load: `ShardState.load(dir)` into a fresh shard (read + sha256 check of every file).

Ratios (same run): pause_ratio = snapshot_s / blocking_save_s (target <= 0.1);
extra_memory_ratio = the peak resident memory the background save added / the rows' bytes (target
<= 0.1), measured: VmHWM reset through /proc/self/clear_refs right before the snapshot (the pusher
thread has run and is idle, so its own buffers are resident already), minus VmRSS then;
extra_memory_accounted_ratio = the save's own accounting (`CowSave.extra_bytes_peak`: copies of the
id map and small arrays, flags, chunk buffer, side buffer) / the rows' bytes. prepare_s: time
spent before the pause preparing it (0: the copy-on-write snapshot prepares nothing). The rows'
bytes are `hwm * (4 * dim + 4 + 8)` (weights, the row-wise accumulator, the counters), the files a
little more (the id map, 12 bytes a row).

The two saves are compared file by file (sha256 in the manifests): they must be identical (the
pushes start only after the snapshot, and none of them may reach its files).

The trainer's view (`--server`, on by default): a shard process (spawned, as `recsys train` starts
one) is filled through a PSClient, then the client times `save(background=False)` (training stands
still for the whole write) and two `save(background=True)` calls (training stands still until the
shard has taken its snapshot), each followed by `wait_saved`. trainer_pause_fraction = the slower
background call / the blocking call.

With --repeats N each timing is the median of N. Files go under a temp dir (in --tmpdir) that is
deleted. Memory: the table (rows * (4 * dim + 12) bytes plus the id map) and, during the load, the
files' bytes plus the new table. On a shared machine the numbers are noisy: compare sizes and
ratios from one run.

The blocking save is the baseline of every ratio: when it fails, the script exits 1 unless
--allow-missing-baseline (then `blocking_save_s` / `client_blocking_save_s` and every ratio are
null and `notes` says why). --json prints one line with every figure and ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from embedding_ps.client.client import PSClient
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.loop import serve
from embedding_ps.shard.state import ShardState, release_free_heap, verify_shard

CHUNK = 1 << 18


def fill(rows: int, dim: int) -> ShardState:
    """A shard whose one table holds ids 0..rows-1 after one push each."""
    cfg = PSConfig(tables=(TableConfig(name="t", dim=dim, optimizer="rowwise_adagrad"),))
    state = ShardState(cfg, 0)
    grads = torch.full((CHUNK, dim), 0.01)
    for lo in range(0, rows, CHUNK):
        ids = torch.arange(lo, min(lo + CHUNK, rows))
        state.push(0, ids, grads[: ids.numel()], step=0)
    release_free_heap()
    return state


def timed(fn, *args) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def files_of(directory: str) -> dict:
    with open(os.path.join(directory, "manifest.json")) as f:
        return json.load(f)["files"]


def baseline(notes: list[str], what: str, fn, *args) -> float | None:
    """Seconds of the baseline call `fn(*args)`, or None (and a note) when it raises."""
    try:
        return timed(fn, *args)[0]
    except Exception as e:
        notes.append(f"baseline {what} failed ({type(e).__name__}: {e}); reported as null")
        return None


def fraction(part: float, whole: float | None) -> float | None:
    return None if whole is None else part / whole


def proc_status_kb(key: str) -> int | None:
    """A field of /proc/self/status in kB (VmRSS, VmHWM), None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """VmHWM := VmRSS now (writing 5 to /proc/self/clear_refs); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Pusher:
    """A thread pushing `n` random existing ids per step (unique; uniform, or Zipf(`zipf`) ranks
    scattered over the table by a multiplicative hash) to `state`, as a trainer would: it makes
    `warmup` pushes at once, then waits for `go`, then pushes back to back until `stop`."""

    def __init__(self, state: ShardState, rows: int, dim: int, n: int, zipf: float = 0.0, warmup: int = 8) -> None:
        self.state, self.rows, self.n, self.zipf = state, rows, min(n, rows), zipf
        self.rng = np.random.default_rng(0)
        self.grads = torch.full((self.n, dim), 1e-3)
        self.go, self.stop, self.warm = threading.Event(), threading.Event(), threading.Event()
        self.pushes, self.step, self.error, self.alone_rate = 0, 1, None, 0.0
        self.gen = torch.Generator().manual_seed(0)
        self.thread = threading.Thread(target=self._run, args=(warmup,), daemon=True)
        self.thread.start()
        if not self.warm.wait(600):
            raise RuntimeError("pusher never warmed up")

    def _push(self) -> None:
        if self.zipf:
            ranks = self.rng.zipf(self.zipf, self.n) % self.rows
            ids = torch.unique(torch.from_numpy((ranks * 0x9E3779B1) % self.rows))
        else:
            ids = torch.unique(torch.randint(0, self.rows, (self.n,), generator=self.gen))
        self.state.push(0, ids, self.grads[: ids.numel()], self.step)
        self.step += 1

    def _run(self, warmup: int) -> None:
        try:
            self._push()
            t0 = time.perf_counter()
            for _ in range(warmup):
                self._push()
            self.alone_rate = warmup * self.n / (time.perf_counter() - t0)     # rows/s without a save
            self.warm.set()
            self.go.wait()
            while not self.stop.is_set():
                self._push()
                self.pushes += 1
        except BaseException as e:       # reported by join()
            self.error = e
            self.warm.set()

    def join(self) -> int:
        self.stop.set()
        self.go.set()
        self.thread.join(600)
        if self.error is not None:
            raise RuntimeError(f"pusher failed: {self.error!r}") from self.error
        return self.pushes


def background_save(state: ShardState, directory: str, pusher: Pusher) -> dict:
    """One background save with `pusher` (warmed up, waiting) pushing from the snapshot to the end of the write."""
    try:
        measured = reset_peak_rss()
        rss0 = proc_status_kb("VmRSS")
        snap = state.snapshot()
        pusher.go.set()
        t0 = time.perf_counter()
        write_s = snap.write(directory)["write_s"]
        done_s = time.perf_counter() - t0
    finally:
        pushes = pusher.join()
    hwm = proc_status_kb("VmHWM")
    stats = snap.stats()
    rss_extra = (hwm - rss0) * 1024 if measured and hwm is not None and rss0 is not None else None
    return {"snapshot_s": snap.snapshot_s, "prepare_s": 0.0, "write_s": write_s, "nbytes": snap.nbytes,
            "rss_extra": rss_extra, "pushes": pushes, "push_rate": pushes * pusher.n / done_s,
            "push_rate_alone": pusher.alone_rate, **stats}


def bench_size(rows: int, dim: int, repeats: int, push_rows: int, zipf: float, tmp: str,
               notes: list[str]) -> dict[str, float | int | bool | None]:
    fill_s, state = timed(fill, rows, dim)
    blocking, background = os.path.join(tmp, f"blocking-{rows}"), os.path.join(tmp, f"background-{rows}")
    save_s, runs = [], []
    for _ in range(repeats):
        pusher = Pusher(state, rows, dim, push_rows, zipf)      # warmed up before the blocking save, then idle
        save_s.append(baseline(notes, f"blocking save ({rows:.0e} rows)", state.save, blocking))
        runs.append(background_save(state, background, pusher))
        release_free_heap()
    missing = None in save_s
    identical = None if missing else files_of(blocking) == files_of(background)
    del state
    release_free_heap()
    verify_s = timed(verify_shard, background)[0]
    load_s = []
    for _ in range(repeats):      # from the background save's files when the blocking one is missing
        fresh = ShardState(PSConfig(tables=(TableConfig(name="t", dim=dim, optimizer="rowwise_adagrad"),)), 0)
        load_s.append(timed(fresh.load, background if missing else blocking)[0])
        del fresh
        release_free_heap()
    shutil.rmtree(blocking, ignore_errors=True)
    shutil.rmtree(background)
    save = None if missing else statistics.median(save_s)
    med = lambda key: statistics.median(r[key] for r in runs)   # noqa: E731
    rows_bytes = runs[-1]["rows_bytes"]
    rss = None if any(r["rss_extra"] is None for r in runs) else med("rss_extra")
    if rss is None:
        notes.append("peak RSS not measurable here (/proc/self/clear_refs refused): extra_memory_ratio is the "
                      "accounted one")
    accounted = med("extra_bytes_peak")
    return {"rows": rows, "dim": dim, "bytes": runs[-1]["nbytes"], "rows_bytes": rows_bytes, "fill_s": fill_s,
            "blocking_save_s": save, "load_s": statistics.median(load_s), "prepare_s": med("prepare_s"),
            "snapshot_s": med("snapshot_s"), "background_write_s": med("write_s"), "verify_s": verify_s,
            "pause_fraction": fraction(med("snapshot_s"), save),
            "chunk_hold_max_s": med("chunk_hold_max_s"), "chunk_hold_total_s": med("chunk_hold_total_s"),
            "extra_bytes_peak_rss": rss, "extra_bytes_peak_accounted": accounted,
            "extra_bytes_bound": runs[-1]["extra_bytes_bound"],
            "extra_memory_ratio": (accounted if rss is None else rss) / rows_bytes,
            "extra_memory_accounted_ratio": accounted / rows_bytes,
            "push_rows": push_rows, "push_zipf": zipf, "pushes_during_save": med("pushes"),
            "push_rows_per_s_during_save": med("push_rate"),
            "push_rows_per_s_alone": med("push_rate_alone"),
            "push_rate_ratio_during_save": med("push_rate") / med("push_rate_alone"),
            "preserved_rows": med("preserved_rows"), "push_waits": med("push_waits"), "push_wait_s": med("push_wait_s"),
            "push_wait_max_s": med("push_wait_max_s"),
            "identical": identical}


def _shard_main(config: PSConfig, ready_file: str) -> None:
    torch.set_num_threads(1)
    serve(config, 0, ready_file=ready_file)


def _wait_ready(path: str, proc) -> str:
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"shard process not ready (exit code {proc.exitcode})")
        time.sleep(0.05)
    with open(path) as f:
        return f.read().strip()


def bench_server(rows: int, dim: int, tmp: str, notes: list[str]) -> dict[str, float | int | None]:
    """What a trainer waits for: a blocking save and two background saves through a shard process."""
    config = PSConfig(tables=(TableConfig(name="t", dim=dim, optimizer="rowwise_adagrad"),), mode="async",
                      timeout_s=600.0)
    ready = os.path.join(tmp, f"server-{rows}.ready")
    proc = mp.get_context("spawn").Process(target=_shard_main, args=(config, ready), daemon=True)
    proc.start()
    try:
        with PSClient(config, [_wait_ready(ready, proc)]) as client:
            grads = torch.full((CHUNK, dim), 0.01)
            for lo in range(0, rows, CHUNK):
                ids = torch.arange(lo, min(lo + CHUNK, rows))
                client.push(0, ids, grads[: ids.numel()])
            out: dict[str, float | int | None] = {"rows": rows, "dim": dim}
            out["client_blocking_save_s"] = baseline(notes, f"client blocking save ({rows:.0e} rows)", client.save,
                                                     os.path.join(tmp, f"srv-block-{rows}"))
            for name in ("first", "second"):
                directory = os.path.join(tmp, f"srv-{name}-{rows}")
                out[f"trainer_pause_{name}_s"] = timed(lambda: client.save(directory, background=True))[0]
                out[f"background_done_{name}_s"] = timed(client.wait_saved, directory, 600.0)[0]
            client.shutdown()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    for name in ("first", "second"):
        out[f"trainer_pause_{name}_fraction"] = fraction(out[f"trainer_pause_{name}_s"], out["client_blocking_save_s"])
    out["trainer_pause_fraction"] = fraction(max(out["trainer_pause_first_s"], out["trainer_pause_second_s"]),
                                             out["client_blocking_save_s"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.add_argument("--rows", default="1e5,1e6,1e7", help="comma-separated table sizes (rows)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="median of this many saves / loads per size")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (the snapshot copy)")
    p.add_argument("--push-rows", type=int, default=8192,
                   help="ids per push of the thread pushing during the background save")
    p.add_argument("--push-zipf", type=float, default=0.0,
                   help="> 1: the pushed ids follow Zipf(this) instead of uniform (hot rows need one pre-image)")
    p.add_argument("--tmpdir", default=None, help="where the temp dir goes (default: the system's)")
    p.add_argument("--no-server", dest="server", action="store_false",
                   help="skip the trainer's view through a shard process")
    p.add_argument("--allow-missing-baseline", action="store_true",
                   help="report null for the blocking-save baseline (and exit 0) when it fails")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(float(r)) for r in args.rows.split(",")]
    tmp = tempfile.mkdtemp(prefix="ps-checkpoint-bench-", dir=args.tmpdir)
    results, served, notes = [], [], []
    try:
        for rows in sizes:
            results.append(bench_size(rows, args.dim, args.repeats, args.push_rows, args.push_zipf, tmp, notes))
            if not args.json:
                print_row(results[-1], header=len(results) == 1)
        for rows in sizes if args.server else ():
            served.append(bench_server(rows, args.dim, tmp, notes))
            if not args.json:
                print_server_row(served[-1], header=len(served) == 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    largest = max(results, key=lambda r: r["rows"])
    summary = {"pause_ratio": largest["pause_fraction"], "extra_memory_ratio": largest["extra_memory_ratio"],
               "prepare_s": largest["prepare_s"], "blocking_save_s": largest["blocking_save_s"],
               "pause_fraction": largest["pause_fraction"],
               "extra_memory_accounted_ratio": largest["extra_memory_accounted_ratio"],
               "chunk_hold_max_s": largest["chunk_hold_max_s"], "push_wait_s": largest["push_wait_s"],
               "push_wait_max_s": largest["push_wait_max_s"],
               "push_rate_ratio_during_save": largest["push_rate_ratio_during_save"]}
    if served:
        summary["trainer_pause_fraction"] = served[-1]["trainer_pause_fraction"]
        summary["trainer_pause_first_fraction"] = served[-1]["trainer_pause_first_fraction"]
        summary["trainer_pause_second_fraction"] = served[-1]["trainer_pause_second_fraction"]
    missing = any(n.startswith("baseline") for n in notes)
    if args.json:
        print(json.dumps({"threads": args.threads, "repeats": args.repeats, "sizes": results, "server": served,
                          **summary, "notes": notes}))
    else:
        print(f"at {largest['rows']:.0e} rows: "
              + ", ".join(f"{k} {'null' if v is None else f'{v:.3f}'}" for k, v in summary.items())
              + " (pause_ratio, extra_memory_ratio: targets <= 0.1)")
        for n in notes:
            print(f"note: {n}")
    if missing and not args.allow_missing_baseline:
        print("error: the blocking-save baseline failed (see notes); --allow-missing-baseline to report it as null",
              file=sys.stderr)
        return 1
    return 0


def print_row(r: dict, header: bool) -> None:
    if header:
        print(f"{'rows':>10} {'MB':>8} {'save s':>8} {'load s':>8} {'prep s':>8} {'pause s':>8} {'write s':>8} "
              f"{'pause/save':>10} {'hold max s':>10} {'extra mem':>9} {'accounted':>9} {'push wait s':>11} "
              f"{'pushes':>6} identical")
    save = r["blocking_save_s"]
    num = lambda v, w: "null".rjust(w) if v is None else f"{v:>{w}.3f}"   # noqa: E731
    print(f"{r['rows']:>10.0e} {r['bytes'] / 1e6:>8.1f} {num(save, 8)} {r['load_s']:>8.3f} "
          f"{r['prepare_s']:>8.3f} {r['snapshot_s']:>8.3f} {r['background_write_s']:>8.3f} "
          f"{num(r['pause_fraction'], 10)} {r['chunk_hold_max_s']:>10.4f} {r['extra_memory_ratio']:>9.3f} "
          f"{r['extra_memory_accounted_ratio']:>9.3f} {r['push_wait_s']:>11.3f} {r['pushes_during_save']:>6} "
          f"{r['identical']}", flush=True)


def print_server_row(r: dict, header: bool) -> None:
    if header:
        print(f"\ntrainer's view (a shard process, PSClient):\n{'rows':>10} {'blocking s':>10} {'pause 1st':>9} "
              f"{'pause 2nd':>9} {'write s':>9} {'slower/blocking':>15}")
    num = lambda v, w: "null".rjust(w) if v is None else f"{v:>{w}.3f}"   # noqa: E731
    print(f"{r['rows']:>10.0e} {num(r['client_blocking_save_s'], 10)} {r['trainer_pause_first_s']:>9.3f} "
          f"{r['trainer_pause_second_s']:>9.3f} {r['background_done_second_s']:>9.3f} "
          f"{num(r['trainer_pause_fraction'], 15)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
