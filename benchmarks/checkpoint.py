"""What a PS shard checkpoint costs: blocking save, load, and a background save's pause and write.

    python benchmarks/checkpoint.py [--json] [--rows 1e5,1e6,1e7] [--dim 64] [--repeats 1] [--threads 2]
                                    [--tmpdir DIR]

For each size, one in-process ShardState holds one table of `rows` rows x `dim` fp32 with row-wise
Adagrad, filled by pushing every id once (chunks of 2**18). Timed, on the same state:

- blocking save: `ShardState.save(dir)`: checksummed files written under the lock (the shard
  serves nothing meanwhile), fsynced, renamed into place;
- background save, as the server does it: `snapshot_buffers()` (fresh memory for the copy, faulted
  in without the lock; the server does this on a thread while it serves: "prepare"), `snapshot(buffers)`
  (the copy under the lock: the only pause the shard sees) and `ShardSnapshot.write(dir)` (what the
  writer thread does, timed here on the main thread);
- load: `ShardState.load(dir)` into a fresh shard (read + sha256 check of every file).

pause_fraction = snapshot_s / blocking_save_s in the same run; the target is <= 0.25 at 1e7 rows.

The trainer's view (`--server`, on by default): a shard process (spawned, as `recsys train` starts
one) is filled through a PSClient, then the client times `save(background=False)` (training stands
still for the whole write) and two `save(background=True)` calls (training stands still until the
shard has copied its state: prepare + copy), each followed by `wait_saved`, then a third one after
`prepare_save()` made the memory ready ahead (what the trainer does half-way between checkpoints):
its pause is the copy alone. `trainer_pause_fraction` = that prepared call's time / the blocking
call's; the unprepared first and second calls are reported too (a fresh process's first touch of
that much memory is slow on a VM).

The two saves are compared file by file (sha256 in the manifests): they must be identical. With
--repeats N each timing is the median of N. Files go under a temp dir (in --tmpdir) that is deleted.
Memory: the table (rows * (4 * dim + 12) bytes plus the id map), once more for the snapshot, and
during the load the files' bytes plus the new table; 1e7 x 64 peaked at 6.1 GB resident.
"prepare" is a process's first touch of that much fresh memory: on the VM this was written on,
4.8-5.9 s for 2.8 GB the first time, 0.26 s on later saves of the same process (pages the kernel
had just taken back). On a shared machine the numbers are noisy: compare sizes and fractions
from one run.

The blocking save is the baseline of every fraction: when it fails, the script exits 1 unless
--allow-missing-baseline (then `blocking_save_s` / `client_blocking_save_s` and every fraction are
null and `notes` says why). --json prints one line with every figure and fraction.
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
import time

import torch

from embedding_ps.client import PSClient
from embedding_ps.config import PSConfig, TableConfig
from embedding_ps.server import serve
from embedding_ps.shard import ShardState, release_free_heap, verify_shard

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


def bench_size(rows: int, dim: int, repeats: int, tmp: str, notes: list[str]) -> dict[str, float | int | bool]:
    fill_s, state = timed(fill, rows, dim)
    blocking, background = os.path.join(tmp, f"blocking-{rows}"), os.path.join(tmp, f"background-{rows}")
    save_s, prepare_s, pause_s, write_s = [], [], [], []
    for _ in range(repeats):
        save_s.append(baseline(notes, f"blocking save ({rows:.0e} rows)", state.save, blocking))
        t, buffers = timed(state.snapshot_buffers)
        prepare_s.append(t)
        snap = state.snapshot(buffers)
        del buffers
        pause_s.append(snap.snapshot_s)
        write_s.append(snap.write(background)["write_s"])
        nbytes = snap.nbytes
        del snap
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
    pause = statistics.median(pause_s)
    return {"rows": rows, "dim": dim, "bytes": nbytes, "fill_s": fill_s, "blocking_save_s": save,
            "load_s": statistics.median(load_s), "prepare_s": statistics.median(prepare_s), "snapshot_s": pause,
            "background_write_s": statistics.median(write_s),
            "verify_s": verify_s, "pause_fraction": fraction(pause, save), "identical": identical}


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
            for name in ("first", "second", "prepared"):
                directory = os.path.join(tmp, f"srv-{name}-{rows}")
                if name == "prepared":
                    client.prepare_save().result(timeout=60)
                    deadline = time.monotonic() + 600
                    while any(r["phase"] != "ready" for r in client.prepare_save().result(timeout=60)):
                        assert time.monotonic() < deadline, "snapshot memory never got ready"
                        time.sleep(0.01)
                out[f"trainer_pause_{name}_s"] = timed(lambda: client.save(directory, background=True))[0]
                out[f"background_done_{name}_s"] = timed(client.wait_saved, directory, 600.0)[0]
            client.shutdown()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    for name, key in (("prepared", "trainer_pause_fraction"), ("first", "trainer_pause_first_fraction"),
                      ("second", "trainer_pause_second_fraction")):
        out[key] = fraction(out[f"trainer_pause_{name}_s"], out["client_blocking_save_s"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.add_argument("--rows", default="1e5,1e6,1e7", help="comma-separated table sizes (rows)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="median of this many saves / loads per size")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (the snapshot copy)")
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
            results.append(bench_size(rows, args.dim, args.repeats, tmp, notes))
            if not args.json:
                print_row(results[-1], header=len(results) == 1)
        for rows in sizes if args.server else ():
            served.append(bench_server(rows, args.dim, tmp, notes))
            if not args.json:
                print_server_row(served[-1], header=len(served) == 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    largest = max(results, key=lambda r: r["rows"])
    summary = {"pause_fraction": largest["pause_fraction"]}
    if served:
        summary["trainer_pause_fraction"] = served[-1]["trainer_pause_fraction"]
        summary["trainer_pause_first_fraction"] = served[-1]["trainer_pause_first_fraction"]
        summary["trainer_pause_second_fraction"] = served[-1]["trainer_pause_second_fraction"]
    summary["prepare_s"] = largest["prepare_s"]
    missing = bool(notes)
    if args.json:
        print(json.dumps({"threads": args.threads, "repeats": args.repeats, "sizes": results, "server": served,
                          **summary, "notes": notes}))
    else:
        print(f"at {largest['rows']:.0e} rows: "
              + ", ".join(f"{k} {'null' if v is None else f'{v:.3f}'}" for k, v in summary.items())
              + " (fractions: target <= 0.25)")
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
              f"{'pause/save':>10} {'save GB/s':>9} {'copy GB/s':>9} identical")
    gb, save = r["bytes"] / 1e9, r["blocking_save_s"]
    num = lambda v, w: "null".rjust(w) if v is None else f"{v:>{w}.3f}"   # noqa: E731
    print(f"{r['rows']:>10.0e} {r['bytes'] / 1e6:>8.1f} {num(save, 8)} {r['load_s']:>8.3f} "
          f"{r['prepare_s']:>8.3f} {r['snapshot_s']:>8.3f} {r['background_write_s']:>8.3f} "
          f"{num(r['pause_fraction'], 10)} "
          f"{num(None if save is None else gb / save, 9)} {gb / r['snapshot_s']:>9.2f} {r['identical']}", flush=True)


def print_server_row(r: dict, header: bool) -> None:
    if header:
        print(f"\ntrainer's view (a shard process, PSClient):\n{'rows':>10} {'blocking s':>10} {'pause 1st':>9} "
              f"{'pause 2nd':>9} {'prepared':>9} {'write s':>9} {'prepared/blocking':>17}")
    num = lambda v, w: "null".rjust(w) if v is None else f"{v:>{w}.3f}"   # noqa: E731
    print(f"{r['rows']:>10.0e} {num(r['client_blocking_save_s'], 10)} {r['trainer_pause_first_s']:>9.3f} "
          f"{r['trainer_pause_second_s']:>9.3f} {r['trainer_pause_prepared_s']:>9.3f} "
          f"{r['background_done_prepared_s']:>9.3f} {num(r['trainer_pause_fraction'], 17)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
