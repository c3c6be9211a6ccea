"""The scale run (issue #15 item 6): 1e8 rows at D = 16 over 4 shard processes, on one machine.

    python benchmarks/scale.py [--json] [--rows 1e8] [--dim 16] [--shards 4] [--reshard-to 2]
                               [--points 1e6,1e7] [--steps 30] [--batch 4096] [--features 26]
                               [--zipf 1.05] [--fill-batch 65536] [--no-hint] [--row-counters]
                               [--save background|blocking] [--workdir DIR] [--out FILE]

Not in CI or `make bench` (1e8 rows need ~9 GB of RAM, up to ~19 GB during the background save,
and 8 GB of disk; ~6 minutes on the shared 2-core machine, BENCHMARKS.md, "benchmarks/scale.py");
`--rows 1e6 --points ''` is a quick check. One table `ids` of `--rows` rows, row-wise Adagrad
(the sparse optimizer state is 4 bytes a row), `capacity = --rows` (the per-table hint: each shard
reserves its share up front; `--no-hint` grows as without it) and `row_counters = false` (no TTL, LFU
or delta export reads them here; `--row-counters` keeps them). Phases, each timed on the same shards:

1. empty: one shard process of the same table without the hint, started as below: its resident
   memory (RSS) is what a shard holds before any row (interpreter, torch, zmq, buffers).
2. fill: `--shards` shard processes started as `recsys train` starts them (`recsys ps --config
   ... --shard i`, `recsys.training.launch.spawn_shards`), filled through a PSClient by pushing ids
   0..rows-1 once (zero gradients, `--fill-batch` ids a push, one push + barrier a step, as a sync
   trainer does: every row is admitted with its init
   row and an untouched Adagrad accumulator), then a SWEEP (no TTL: it only returns freed heap to the
   OS, as a shard does after every sweep). `bytes_per_row` = (summed RSS of the shard processes -
   shards x the empty shard's RSS) / rows, against raw fp32 (4 x dim bytes): `bytes_per_row_ratio`.
   Everything the shards hold is in it: rows, Adagrad state, id map, slot bookkeeping, heap slack.
   `bytes_per_row_untrimmed` is the same before the sweep.
3. train: `--steps` timed steps (after 3 warm-up steps) of what a trainer does for a DLRM-like batch
   of `--batch` examples x `--features` one-id features drawn Zipf(`--zipf`) over the rows (rank r ->
   id r - 1; draws past the table are redrawn): unique ids, PULL, PUSH of random gradients [U, D],
   BARRIER (sync mode). No dense model: `steps_per_s` is the PS side of a step (pull + push + barrier).
4. save: `client.save(dir, background=True)` (the pause: until every shard copied its state), then
   `wait_saved`: `save_s` from request to every file written and fsynced (`--save blocking`: the
   blocking save). `save_peak_rss_bytes`: the shards' summed RSS at its highest during the save.
5. restore: `--shards` new shard processes started with `--restore DIR` (each loads and checks its
   saved shard): `restore_s` from start to all ready, minus nothing (process start is in it;
   `start_s`, phase 2's start of empty shards, is the part that is not restore).
6. reshard: `--reshard-to` new shard processes started with `--restore DIR` of the `--shards`-shard
   save: each reads every old shard and keeps its ids (`recsys.training.reshard.restore_shard`, the
   path a resume with another ps.num_shards takes): `reshard_s`, and its peak summed RSS.
A sample of 200k ids pulled before the save must come back identical after restore and reshard
(the script exits 1 otherwise). The machine is shared: a background save without MemAvailable for a
copy of the shards becomes a blocking one, and restore / reshard without room for their new tables
are skipped (null figures); `notes` in the JSON says which.

`--points 1e6,1e7`: phases 1-2 alone at each of these sizes first (fresh shards each), so memory per
row can be plotted against rows (`points` in the JSON; `benchmarks/plots.py --scale FILE`).
`--json` prints one line with every figure (keys `rows`, `bytes_per_row_ratio`, ...); `--out FILE`
also writes it to FILE. Timings on a shared machine are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from embedding_ps.client.client import PSClient
from recsys.config import JobConfig, load_config
from recsys.rundir import wait_for_shards
from recsys.training import launch
from recsys.training.jobauth import job_auth

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.toml"
SAMPLE = 200_000
WARMUP_STEPS = 3


def rss(pid: int) -> int:
    """Resident bytes of process `pid` (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"pid {pid}: no VmRSS")


def mem_available() -> int:
    """MemAvailable of this machine, bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def room_for(need: int, what: str, notes: list[str]) -> bool:
    """Whether `need` more bytes fit in MemAvailable (the machine is shared); says so in `notes` if not."""
    have = mem_available()
    if have >= need:
        return True
    notes.append(f"{what}: skipped, needs ~{need / 2**30:.1f} GiB, MemAvailable {have / 2**30:.1f} GiB")
    log(notes[-1])
    return False


def total_rss(procs: list[subprocess.Popen]) -> int:
    return sum(rss(p.pid) for p in procs)


def children_rss() -> int:
    """Summed RSS of this process's children (the shard processes while they start)."""
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(x) for x in f.read().split()]
        except FileNotFoundError:         # a thread of this process ended meanwhile
            pass
    total = 0
    for pid in pids:
        try:
            total += rss(pid)
        except (OSError, RuntimeError):   # gone meanwhile
            pass
    return total


class PeakRss(threading.Thread):
    """Samples the summed RSS of this process's children every 50 ms until stopped; `.peak` is the
    highest seen (the shards are this script's only children)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self._done = 0, threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self._done.is_set():
                self.peak = max(self.peak, children_rss())
                self._done.wait(0.05)
            self.peak = max(self.peak, children_rss())
        except BaseException as e:        # a dead sampler must not pass for a low peak
            self.error = e

    def __enter__(self) -> "PeakRss":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join(timeout=5)
        if self.error is not None:
            raise RuntimeError(f"the RSS sampler failed, its peak is not valid: {self.error!r}") from self.error


def job_config(a: argparse.Namespace, rows: int, shards: int, run_dir: Path, hint: bool) -> JobConfig:
    """configs/quickstart.toml with one table `ids` of `rows` rows and `shards` sync shards."""
    table = (f'{{name = "ids", dim = {a.dim}, optimizer = "rowwise_adagrad", lr = 0.01, '
             f'capacity = {rows if hint else 0}, row_counters = {"true" if a.row_counters else "false"}}}')
    overrides = [f"ps.tables = [{table}]", f"ps.num_shards = {shards}", 'ps.mode = "sync"', "ps.num_workers = 1",
                 "ps.timeout_s = 600", f"train.run_dir = {json.dumps(str(run_dir))}"]
    return load_config(QUICKSTART, overrides)


class Shards:
    """`shards` shard processes as `recsys train` starts them (optionally restoring `restore`)."""

    def __init__(self, a: argparse.Namespace, rows: int, shards: int, run_dir: Path, *, hint: bool = True,
                 restore: Path | None = None) -> None:
        self.cfg = job_config(a, rows, shards, run_dir, hint)
        path = launch.write_run_dir(self.cfg, run_dir)
        self._auth = job_auth(self.cfg.ps, run_dir)         # the job's token, as `recsys train` makes it
        auth = self._auth.__enter__()
        self.client_ps = load_config(path, auth).ps
        t0 = time.perf_counter()
        with PeakRss() as peak:
            self.procs, ready = launch.spawn_shards(self.cfg, path, run_dir, restore=restore, overrides=auth)
            self.addresses = wait_for_shards(ready, a.ready_timeout)   # restoring 1e8 rows takes a while
        self.start_s, self.start_peak = time.perf_counter() - t0, peak.peak

    def client(self) -> PSClient:
        return PSClient(self.client_ps, self.addresses)

    def stop(self) -> None:
        launch.stop(self.procs, timeout_s=30)
        self._auth.__exit__(None, None, None)


def fill(client: PSClient, rows: int, dim: int, batch: int) -> tuple[float, int]:
    """Push ids 0..rows-1 once with zero gradients, one step (push + barrier) per `batch` ids, as a
    trainer would (sync mode holds a step's pushes until its barrier); returns (seconds, steps)."""
    zeros = torch.zeros(batch, dim)
    t0 = time.perf_counter()
    step = 0
    for step, lo in enumerate(range(0, rows, batch)):
        ids = torch.arange(lo, min(lo + batch, rows), dtype=torch.int64)
        client.push(0, ids, zeros[: ids.shape[0]], step=step)
        client.barrier(step)
    return time.perf_counter() - t0, step + 1


def zipf_batches(a: argparse.Namespace, rows: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    """n batches of unique ids (int64 [U]) of `--batch` x `--features` Zipf(`--zipf`) draws over [0, rows)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        need, got = a.batch * a.features, []
        while need > 0:
            r = rng.zipf(a.zipf, 2 * need)
            r = r[r <= rows][:need]
            got.append(r - 1)
            need -= r.shape[0]
        out.append(torch.from_numpy(np.unique(np.concatenate(got))))
    return out


def memory_point(a: argparse.Namespace, rows: int, work: Path, empty_rss: int) -> tuple[dict, Shards]:
    """Phase 2 at `rows`: fill fresh shards; returns the figures and the (running) shards."""
    sh = Shards(a, rows, a.shards, work / f"run-{rows}", hint=not a.no_hint)
    try:
        client = sh.client()
        start_rss = total_rss(sh.procs)
        with PeakRss() as peak:
            fill_s, steps = fill(client, rows, a.dim, a.fill_batch)
            untrimmed = total_rss(sh.procs)
            client.sweep(steps)
            filled = total_rss(sh.procs)
        stats = client.stats()
        stored = sum(s["state"]["rows"] for s in stats)
        accounted = sum(s["state"]["bytes"] for s in stats)
        if stored != rows:
            raise RuntimeError(f"filled {rows} ids but the shards hold {stored} rows")
    except BaseException:
        sh.stop()
        raise
    base = a.shards * empty_rss
    point = {"rows": rows, "shards": a.shards, "dim": a.dim, "start_s": sh.start_s, "fill_s": fill_s,
             "fill_rows_per_s": rows / fill_s, "rss_bytes": filled, "rss_empty_shard_bytes": empty_rss,
             "rss_at_start_bytes": start_rss, "fill_peak_rss_bytes": peak.peak,
             "bytes_per_row": (filled - base) / rows, "bytes_per_row_untrimmed": (untrimmed - base) / rows,
             "bytes_per_row_ratio": (filled - base) / rows / (4 * a.dim), "fill_steps": steps,
             "accounted_bytes_per_row": accounted / rows}
    return point, sh


def train_steps(a: argparse.Namespace, client: PSClient, rows: int, first: int) -> dict:
    batches = zipf_batches(a, rows, WARMUP_STEPS + a.steps)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(b.shape[0], a.dim, generator=g) * 0.01 for b in batches]
    times = []
    for step, (ids, grad) in enumerate(zip(batches, grads), start=first):
        t0 = time.perf_counter()
        client.pull(0, ids, step=step)
        client.push(0, ids, grad, step=step)
        client.barrier(step)
        times.append(time.perf_counter() - t0)
    timed = np.array(times[WARMUP_STEPS:])
    uniq = float(np.mean([b.shape[0] for b in batches[WARMUP_STEPS:]]))
    return {"steps": a.steps, "step_ms_median": float(np.median(timed)) * 1e3,
            "steps_per_s": 1.0 / float(np.median(timed)), "unique_ids_per_step": uniq,
            "rows_per_s": 2 * uniq / float(np.median(timed)), "last_step": first + len(batches) - 1}


def save(a: argparse.Namespace, client: PSClient, directory: Path, step: int, table_bytes: int,
         notes: list[str]) -> dict:
    """A background save needs room for a copy of the shards' state; without it the save is blocking."""
    mode = a.save
    if mode == "background" and not room_for(int(1.2 * table_bytes), "background save", notes):
        mode = "blocking"
    t0 = time.perf_counter()
    with PeakRss() as peak:
        replies = client.save(str(directory), step=step + 1, background=mode == "background")
        pause = time.perf_counter() - t0
        if mode == "background":
            client.wait_saved(str(directory), timeout_s=3600)
    return {"save_mode": mode, "save_s": time.perf_counter() - t0, "save_pause_s": pause,
            "save_peak_rss_bytes": peak.peak, "save_bytes_on_disk": _du(directory),
            "save_snapshot_s_max": max((r.get("snapshot_s", 0.0) for r in replies), default=0.0)}


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def reopen(a: argparse.Namespace, rows: int, shards: int, run_dir: Path, saved: Path,
           sample: torch.Tensor, want: torch.Tensor, key: str) -> dict:
    """Start `shards` shards restoring `saved`, time it, check the sample's rows, stop them."""
    sh = Shards(a, rows, shards, run_dir, hint=not a.no_hint, restore=saved)
    try:
        rss_now = total_rss(sh.procs)
        got = sh.client().pull(0, sample)
        if not torch.equal(got, want):
            raise RuntimeError(f"{key}: {int((got != want).any(1).sum())} of {sample.shape[0]} sampled rows differ")
        stored = sum(s["state"]["rows"] for s in sh.client().stats())
        if stored != rows:
            raise RuntimeError(f"{key}: {stored} rows after it, {rows} before")
    finally:
        sh.stop()
    return {f"{key}_s": sh.start_s, f"{key}_peak_rss_bytes": sh.start_peak, f"{key}_rss_bytes": rss_now,
            f"{key}_shards": shards}


def empty_shard_rss(a: argparse.Namespace, work: Path) -> int:
    sh = Shards(a, 1, 1, work / "run-empty", hint=False)
    try:
        time.sleep(1.0)
        return rss(sh.procs[0].pid)
    finally:
        sh.stop()


def run(a: argparse.Namespace, work: Path) -> dict:
    empty = empty_shard_rss(a, work)
    points = []
    for rows in a.points:
        point, sh = memory_point(a, rows, work, empty)
        sh.stop()
        points.append(point)
        log(f"point {rows:.0e}: {point['bytes_per_row']:.1f} B/row ({point['bytes_per_row_ratio']:.3f}x)")
    out, sh = memory_point(a, a.rows, work, empty)
    points.append(dict(out))
    notes: list[str] = []
    table_bytes = int(out["accounted_bytes_per_row"] * a.rows)
    log(f"filled {a.rows:.0e} rows in {out['fill_s']:.0f} s: {out['bytes_per_row']:.1f} B/row "
        f"({out['bytes_per_row_ratio']:.3f}x)")
    saved = work / f"run-{a.rows}" / "save"
    try:
        client = sh.client()
        out.update(train_steps(a, client, a.rows, out["fill_steps"]))
        log(f"train: {out['steps_per_s']:.2f} steps/s")
        sample = torch.from_numpy(np.random.default_rng(2).integers(0, a.rows, min(SAMPLE, a.rows)))
        want = client.pull(0, sample)
        out.update(save(a, client, saved, out.pop("last_step"), table_bytes, notes))
        log(f"save: {out['save_s']:.1f} s")
    finally:
        sh.stop()
    # room asked for: the new shards' tables plus what they read at once (anonymous memory; the saved
    # files are mapped read-only, page cache that MemAvailable counts as free)
    for key, shards, factor in (("restore", a.shards, 1.3), ("reshard", a.reshard_to, 1.8)):
        out.update({f"{key}_s": None, f"{key}_shards": shards})
        if room_for(int(factor * table_bytes) + shards * empty, key, notes):
            out.update(reopen(a, a.rows, shards, work / f"run-{key}", saved, sample, want, key))
            log(f"{key} -> {shards} shards: {out[f'{key}_s']:.1f} s")
    out.update({"points": points, "notes": notes, "hint": not a.no_hint, "row_counters": a.row_counters,
                "zipf": a.zipf, "batch": a.batch, "features": a.features,
                "step_kind": "PS side of a trainer step: unique ids, pull, push, barrier (sync); no dense model"})
    return out


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one line of JSON")
    p.add_argument("--rows", type=float, default=1e8)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--reshard-to", type=int, default=2)
    p.add_argument("--points", default="1e6,1e7", help="comma-separated extra sizes for phases 1-2 ('' for none)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--fill-batch", type=int, default=1 << 16)
    p.add_argument("--no-hint", action="store_true", help="no capacity hint: tables grow by doubling")
    p.add_argument("--row-counters", action="store_true", help="keep per-row count / last-seen (8 B a row)")
    p.add_argument("--save", choices=("background", "blocking"), default="background")
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a (restoring) shard may take to start")
    p.add_argument("--workdir", default=None, help="where saves go (default: a temp dir, deleted)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    a.rows = int(a.rows)
    a.points = [int(float(x)) for x in a.points.split(",") if x.strip() and int(float(x)) != a.rows]
    work = Path(tempfile.mkdtemp(prefix="scale-", dir=a.workdir))
    try:
        out = run(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    line = json.dumps(out)
    if a.out:
        Path(a.out).write_text(line + "\n")
    if a.json:
        print(line)
    else:
        for k, v in out.items():
            if k != "points":
                print(f"{k:>28}: {v:.4g}" if isinstance(v, float) else f"{k:>28}: {v}")
        for pt in out["points"]:
            print(f"rows {pt['rows']:>12,}: {pt['bytes_per_row']:.1f} B/row ({pt['bytes_per_row_ratio']:.3f}x raw fp32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
