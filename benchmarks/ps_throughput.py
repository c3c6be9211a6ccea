"""PS throughput over the network: shard processes + client processes on 127.0.0.1.

    python benchmarks/ps_throughput.py [--json] [--batch 100000] [--pool 400000] [--repeats 9] [--native on|off]
                                       [--ids uniform|zipf|both] [--threads T] [--shared-memory on|off|both]
                                       [--late-grads on|off]

For 1 and 2 shard processes and 1 and 2 client processes (all started with the spawn context,
OMP_NUM_THREADS=1 each), every client pulls and then pushes batches of --batch unique ids (drawn
from --pool ids already in the table, row-wise Adagrad) at dim 16 and 64, as --wire, with
client-side dedup off unless --dedup (the ids are unique, as the sparse arch sends them); all clients start each
phase together. Per client the median time of one request gives its rows/s; a configuration's
rows/s is the sum over its clients. `pull_push` combines a pull and a push of the same rows
(1 / (1/pull + 1/push)), and `per_shard` divides that by the shard processes.

--ids: the id stream. `uniform`: unique ids drawn uniformly from the pool (the keys above);
`zipf`: --batch ids drawn Zipf(1.05) over the pool's ranks (hot ids repeat inside a request, the
client sends them as they are and the shard merges their gradients; keys `*_zipf_*`; with --dedup
the client sends each id once, sums their gradients itself and expands the rows: the in-process
bound does not dedup, so its ratio is not the same op mix's); `both`
(default) runs the two. --threads: ps.threads of the shards (default 0: the config's default).
--shared-memory: ps.shared_memory of shards and clients (rows through /dev/shm, embedding_ps.wire.shm);
`both` (default) runs each configuration over the socket and again with it (keys `*_shm*`).

The in-process bound of the same op mix, in the same run (`inprocess_*`): a ShardState with the
same config (ps.threads, dtype, dims, row-wise Adagrad) prefilled like the shards, called with the
same id batches and gradients as client 0 (`pull(..., out=)` as the server calls it, then `push`),
no sockets, timed and combined the same way. `ratio_vs_inprocess` (uniform ids, 1 shard, 1
client, dim 64) and `ratio_vs_inprocess_zipf` divide the shard's pull+push rows/s by that bound:
what the process boundary and the server cost over the socket (ps.shared_memory = false; with
shared memory, since session 21 the default for loopback shards: `ratio_vs_inprocess_shm`,
`ratio_vs_inprocess_zipf_shm`).

--late-grads off: shared-memory clients send a push only once its grads are in the segment and
wait for the reply (PSClient.late_grads = notify = False, the order before session 22).

--weight-decay WD [--weight-decay-mode l2|decoupled] gives the tables sparse weight decay (its cost
is the ratio of rows_per_s to a run without it).

--native off runs every process (shards and the in-process parts) without the C fast path of
embedding_ps/native.py (EMBEDDING_PS_NATIVE=0, inherited by the spawned processes).

In the same run: the in-process baseline (`index_select` + `index_add_` on a [pool, D] tensor),
the in-process ShardState, the id->slot map's lookups+inserts per second and RSS bytes per row
against the raw fp32 row (the last three from benchmarks/ps_table.py).

--json prints one line with `rows_per_s` (pull+push per shard process, dim 64, 1 shard and 1
client), `baseline_rows_per_s` (index_select + index_add_, dim 64), `map_ids_per_s`,
`bytes_per_row_ratio`, `ratio_vs_inprocess`, `ratio_vs_inprocess_zipf` (the ids measured; a
ratio whose measurements were not run is an error), `transport_of` (each ratio key -> "socket" or
"shared_memory": `ratio_vs_inprocess` and `ratio_vs_inprocess_zipf` are the socket's, the `_shm`
keys shared memory's), `default_local_transport` (what a client uses with a loopback shard under
the default ps.shared_memory: "shared_memory" since session 21), and every measurement under `detail`.
Note: this machine may have 2 cores for all processes; with 2 shards and 2 clients, 4 processes
share them, so the larger configurations measure contention as much as scaling.
"""

from __future__ import annotations

import argparse
import dataclasses
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ps_table import bench_map, bench_rss, median_s  # noqa: E402

from embedding_ps import native  # noqa: E402
from embedding_ps.client.client import PSClient  # noqa: E402
from embedding_ps.wire.config import PSConfig, TableConfig  # noqa: E402
from embedding_ps.shard.loop import serve  # noqa: E402
from embedding_ps.shard.state import ShardState  # noqa: E402
from embedding_ps.wire.shm import client_uses  # noqa: E402

DIMS = (16, 64)
READY_TIMEOUT_S = 120.0
ZIPF_S = 1.05
NUM_BATCHES = 4


def make_config(num_shards: int, num_workers: int, wire: str = "fp32", weight_decay: float = 0.0,
                weight_decay_mode: str = "l2", threads: int = 0, shared_memory: bool = False) -> PSConfig:
    tables = tuple(TableConfig(name=f"d{d}", dim=d, optimizer="rowwise_adagrad", weight_decay=weight_decay,
                               weight_decay_mode=weight_decay_mode) for d in DIMS)
    return PSConfig(num_shards=num_shards, mode="async", num_workers=num_workers, timeout_s=120.0,
                    retries=0, wire_dtype=wire, tables=tables, threads=threads, shared_memory=shared_memory)


def pool_ids(pool: int) -> torch.Tensor:
    """int64 [pool]: the ids present in the table (prefilled)."""
    return torch.arange(pool, dtype=torch.int64) * 7919 + 13


def id_batches(kind: str, pool: int, batch: int, gen: torch.Generator) -> list[torch.Tensor]:
    """NUM_BATCHES int64 [batch] id batches of the pool: `uniform` unique ids, or `zipf` draws (dups)."""
    ids = pool_ids(pool)
    if kind == "uniform":
        return [ids[torch.randperm(pool, generator=gen)[:batch]] for _ in range(NUM_BATCHES)]
    # Zipf(ZIPF_S) over ranks 1..pool by the inverse CDF; a fixed permutation spreads the hot ranks
    cdf = torch.cumsum(torch.arange(1, pool + 1, dtype=torch.float64).pow(-ZIPF_S), 0)
    cdf /= cdf[-1].clone()
    rank_to_id = ids[torch.randperm(pool, generator=torch.Generator().manual_seed(1234))]
    out = []
    for _ in range(NUM_BATCHES):
        u = torch.rand(batch, dtype=torch.float64, generator=gen)
        out.append(rank_to_id[torch.searchsorted(cdf, u).clamp_(max=pool - 1)])
    return out


def shard_main(config: PSConfig, index: int, ready_file: str) -> None:
    from recsys.runtime import apply_environment

    torch.set_num_threads(1)
    apply_environment()        # EMBEDDING_PS_NATIVE -> native.set_enabled (embedding_ps reads no env vars)
    serve(config, index, ready_file=ready_file)


def workload(kind: str, worker: int, args: dict) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """Per dim: (id batches, grads float32 [batch, D]) of client `worker` (the in-process bound uses worker 0's)."""
    gen = torch.Generator().manual_seed(worker + (1000 if kind == "zipf" else 0))
    out = []
    for dim in DIMS:
        batches = id_batches(kind, args["pool"], args["batch"], gen)
        out.append((batches, torch.randn(args["batch"], dim, generator=gen) * 1e-3))
    return out


def time_phases(pull, push, batches: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """Median seconds of pull(ids) then push(ids) over `repeats` requests after one warm-up each."""
    out = {}
    for phase, fn in (("pull", pull), ("push", push)):
        times = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            fn(batches[r % len(batches)])
            times.append(time.perf_counter() - t0)
        out[phase] = float(np.median(times[1:]))      # the first is a warm-up
    return out


def client_main(config: PSConfig, addresses: list[str], worker: int, args: dict, barrier, out_file: str) -> None:
    """One client process: per id stream and dim, a pull phase then a push phase; writes median seconds as JSON."""
    torch.set_num_threads(1)
    out = {}
    with PSClient(config, addresses, worker_id=worker, dedup=args["dedup"], late_grads=args["late_grads"],
                  notify=args["late_grads"]) as client:
        for kind in args["kinds"]:
            for t, (dim, (batches, grads)) in enumerate(zip(DIMS, workload(kind, worker, args))):
                barrier.wait(timeout=READY_TIMEOUT_S)       # all clients start each stream and dim together
                got = time_phases(lambda ids: client.pull(t, ids), lambda ids: client.push(t, ids, grads),
                                  batches, args["repeats"])
                for phase, s in got.items():
                    out[f"{kind}_{phase}_d{dim}"] = s
    Path(out_file).write_text(json.dumps(out))


def prefill(config: PSConfig, addresses: list[str], pool: int) -> None:
    ids = pool_ids(pool)
    with PSClient(config, addresses) as client:
        for t, dim in enumerate(DIMS):
            for chunk in torch.split(ids, 200_000):
                client.push(t, chunk, torch.zeros(chunk.numel(), dim))


def inprocess(args: dict) -> dict[str, float]:
    """The in-process bound: the shards' op mix on a ShardState (same config) in this process, no sockets."""
    config = make_config(1, 1, args["wire"], args["weight_decay"], args["weight_decay_mode"], args["threads"])
    res: dict[str, float] = {}
    for kind in args["kinds"]:
        state = ShardState(config, 0)
        for t, dim in enumerate(DIMS):                       # prefilled as `prefill` does
            for chunk in torch.split(pool_ids(args["pool"]), 200_000):
                state.push(t, chunk, torch.zeros(chunk.numel(), dim), step=0)
        res["inprocess_threads"] = float(state.threads)
        for t, (dim, (batches, grads)) in enumerate(zip(DIMS, workload(kind, 0, args))):
            out = torch.empty(args["batch"], dim)            # the server's reply buffer
            got = time_phases(lambda ids: state.pull(t, ids, 1, out=out),
                              lambda ids: state.push(t, ids, grads, step=1), batches, args["repeats"])
            sfx = "" if kind == "uniform" else "_zipf"
            pull, push = args["batch"] / got["pull"], args["batch"] / got["push"]
            res[f"inprocess{sfx}_pull_d{dim}_rows_per_s"] = pull
            res[f"inprocess{sfx}_push_d{dim}_rows_per_s"] = push
            res[f"inprocess{sfx}_pull_push_d{dim}_rows_per_s"] = 1.0 / (1.0 / pull + 1.0 / push)
        state = None                                         # the shard's memory, before the next kind
    return res


def run_config(ctx, num_shards: int, num_clients: int, args: dict, workdir: str) -> dict[str, float]:
    config = make_config(num_shards, max(num_clients, 1), args["wire"], args["weight_decay"],
                         args["weight_decay_mode"], args["threads"], args["shared_memory"])
    if args["auth"] == "token":                  # what `recsys train` runs with: the handshake checks a token
        token = os.path.join(workdir, "token")
        with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(os.urandom(32).hex())
        config = dataclasses.replace(config, auth="token", token_file=token)
    shards, clients = [], []
    try:
        run = f"s{num_shards}c{num_clients}" + ("shm" if args["shared_memory"] else "")   # files of this run
        ready = [os.path.join(workdir, f"{run}-{i}.ready") for i in range(num_shards)]
        for i in range(num_shards):
            shards.append(ctx.Process(target=shard_main, args=(config, i, ready[i]), daemon=True))
            shards[-1].start()
        addresses = [wait_ready(path, proc) for path, proc in zip(ready, shards)]
        prefill(config, addresses, args["pool"])
        barrier = ctx.Barrier(num_clients)
        outs = [os.path.join(workdir, f"{run}-client{w}.json") for w in range(num_clients)]
        for w in range(num_clients):
            clients.append(ctx.Process(target=client_main, args=(config, addresses, w, args, barrier, outs[w])))
            clients[-1].start()
        for proc in clients:
            proc.join(timeout=1200)
            if proc.exitcode != 0:
                raise RuntimeError(f"client process exited with {proc.exitcode}")
        results = [json.loads(Path(o).read_text()) for o in outs]
        with PSClient(config, addresses) as client:
            client.shutdown()
        for proc in shards:
            proc.join(timeout=30)
    finally:
        for proc in shards + clients:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    res: dict[str, float] = {}
    for kind in args["kinds"]:
        tag = (f"s{num_shards}_c{num_clients}" + ("_shm" if args["shared_memory"] else "")
               + ("" if kind == "uniform" else "_zipf"))
        for dim in DIMS:
            pull = sum(args["batch"] / r[f"{kind}_pull_d{dim}"] for r in results)
            push = sum(args["batch"] / r[f"{kind}_push_d{dim}"] for r in results)
            res[f"{tag}_pull_d{dim}_rows_per_s"] = pull
            res[f"{tag}_push_d{dim}_rows_per_s"] = push
            res[f"{tag}_pull_push_d{dim}_rows_per_s"] = 1.0 / (1.0 / pull + 1.0 / push)
            res[f"{tag}_pull_push_d{dim}_per_shard_rows_per_s"] = (res[f"{tag}_pull_push_d{dim}_rows_per_s"]
                                                                   / num_shards)
    return res


def wait_ready(path: str, proc) -> str:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not os.path.exists(path):
        if not proc.is_alive():
            raise RuntimeError(f"shard process exited with {proc.exitcode} before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"shard not ready after {READY_TIMEOUT_S} s ({path})")
        time.sleep(0.05)
    return Path(path).read_text().strip()


@contextlib.contextmanager
def shard_and_client(config: PSConfig, pool: int, prefix: str) -> Iterator[PSClient]:
    """Shard 0 of `config` in a spawned process on 127.0.0.1, prefilled with `pool` ids (`prefill`),
    and a PSClient of it in this process (dedup off: the benchmarks send unique ids or mean their
    duplicates); on the way out the shard is shut down and joined, killed if it does not exit."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        ready = os.path.join(workdir, "shard.ready")
        shard = ctx.Process(target=shard_main, args=(config, 0, ready), daemon=True)
        shard.start()
        try:
            address = wait_ready(ready, shard)
            prefill(config, [address], pool)
            with PSClient(config, [address], dedup=False) as client:
                yield client
                client.shutdown()
            shard.join(timeout=30)
        finally:
            if shard.is_alive():
                shard.kill()
                shard.join(timeout=10)


def baseline(pool: int, batch: int, repeats: int) -> dict[str, float]:
    """In-process index_select + index_add_ of `batch` unique rows of a [pool, D] tensor."""
    out = {}
    g = torch.Generator().manual_seed(0)
    for dim in DIMS:
        weights = torch.randn(pool, dim, generator=g)
        idx = torch.randperm(pool, generator=g)[:batch]
        grads = torch.randn(batch, dim, generator=g)
        sel = batch / median_s(lambda: weights.index_select(0, idx), repeats)
        add = batch / median_s(lambda: weights.index_add_(0, idx, grads), repeats)
        out[f"baseline_index_select_d{dim}_rows_per_s"] = sel
        out[f"baseline_index_add_d{dim}_rows_per_s"] = add
        out[f"baseline_pull_push_d{dim}_rows_per_s"] = 1.0 / (1.0 / sel + 1.0 / add)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--batch", type=int, default=100_000, help="unique ids per request")
    p.add_argument("--pool", type=int, default=400_000, help="rows in each table")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2])
    p.add_argument("--wire", choices=["fp32", "fp16", "bf16"], default="fp32", help="ps.wire_dtype")
    p.add_argument("--dedup", action="store_true",
                   help="let the client deduplicate (PSClient's default: one hash pass per request, "
                        "client.plan.dedup_ids; uniform ids are unique already, Zipf ids repeat)")
    p.add_argument("--skip-core", action="store_true", help="skip the map and RSS measurements")
    p.add_argument("--native", choices=("on", "off"), default="on",
                   help="the shard's C fast path (embedding_ps/native.py); off = EMBEDDING_PS_NATIVE=0 everywhere")
    p.add_argument("--weight-decay", type=float, default=0.0, help="ps.tables[*].weight_decay of the tables")
    p.add_argument("--weight-decay-mode", choices=("l2", "decoupled"), default="l2")
    p.add_argument("--ids", choices=("uniform", "zipf", "both"), default="both",
                   help="id stream: unique uniform ids, Zipf(1.05) draws with duplicates, or both")
    p.add_argument("--threads", type=int, default=0, help="ps.threads of the shards and the in-process bound")
    p.add_argument("--shared-memory", choices=("on", "off", "both"), default="both",
                   help="ps.shared_memory: rows of a co-located shard through /dev/shm instead of the socket")
    p.add_argument("--late-grads", choices=("on", "off"), default="on",
                   help="shared-memory clients: PSClient.late_grads and .notify (off: the request order before them)")
    p.add_argument("--map-rows", type=int, default=2_000_000)
    p.add_argument("--rss-rows", type=int, default=1_000_000)
    p.add_argument("--auth", choices=("none", "token"), default="none",
                   help="ps.auth of the shards and clients (token: as `recsys train` runs them)")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"           # inherited by the spawned processes
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ["EMBEDDING_PS_NATIVE"] = "1" if args.native == "on" else "0"  # inherited too
    native.set_enabled(args.native == "on")
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    knobs = {"batch": args.batch, "pool": args.pool, "repeats": args.repeats, "wire": args.wire,
             "dedup": args.dedup, "weight_decay": args.weight_decay, "weight_decay_mode": args.weight_decay_mode,
             "threads": args.threads, "shared_memory": False, "auth": args.auth, "late_grads": args.late_grads == "on",
             "kinds": ("uniform", "zipf") if args.ids == "both" else (args.ids,)}
    res: dict[str, float] = {"batch": float(args.batch), "pool": float(args.pool), "cpus": float(os.cpu_count() or 0),
                             "native": float(native.available())}
    with tempfile.TemporaryDirectory(prefix="ps-throughput-") as workdir:
        for s in args.shards:
            for c in args.clients:
                for shm in {"off": (False,), "on": (True,), "both": (False, True)}[args.shared_memory]:
                    res.update(run_config(ctx, s, c, {**knobs, "shared_memory": shm}, workdir))
    res.update(baseline(args.pool, args.batch, args.repeats))
    res.update(inprocess(knobs))
    if not args.skip_core:
        res.update(bench_map(args.map_rows, args.batch, args.repeats))
        res.update(bench_rss(args.rss_rows, 64, args.batch))
    first = f"s{args.shards[0]}_c{args.clients[0]}" + ("_shm" if args.shared_memory == "on" else "")
    first_kind = "" if "uniform" in knobs["kinds"] else "_zipf"
    summary = {
        "rows_per_s": res[f"{first}{first_kind}_pull_push_d64_per_shard_rows_per_s"],
        "baseline_rows_per_s": res["baseline_pull_push_d64_rows_per_s"],
        "map_ids_per_s": res.get("map_lookup_insert_10pct_new_ids_per_s", float("nan")),
        "bytes_per_row_ratio": res.get("rss_ratio_d64", float("nan")),
    }
    transports: dict[str, str] = {}
    for shm, kind in [(m, k) for m in {"off": ("",), "on": ("_shm",), "both": ("", "_shm")}[args.shared_memory]
                      for k in knobs["kinds"]]:
        sfx = "" if kind == "uniform" else "_zipf"
        key = f"ratio_vs_inprocess{sfx}{shm}"
        shard_key = f"s1_c1{shm}{sfx}_pull_push_d64_rows_per_s"
        if shard_key not in res:
            raise SystemExit(f"error: {key} needs the 1 shard / 1 client run (--shards 1 ... --clients 1 ...)")
        summary[key] = res[shard_key] / res[f"inprocess{sfx}_pull_push_d64_rows_per_s"]
        transports[key] = "shared_memory" if shm else "socket"
    summary["transport_of"] = transports          # which transport each ratio key measured
    summary["default_local_transport"] = ("shared_memory" if client_uses(PSConfig().shared_memory, "tcp://127.0.0.1:1")
                                          else "socket")
    if args.json:
        print(json.dumps({**summary, "detail": res}))
        return
    for k, v in {**res, **summary}.items():
        if not isinstance(v, float):           # transport_of, default_local_transport
            print(f"{k:48s} {v}")
            continue
        shown = f"{v / 1e6:10.2f} M" if v >= 1e5 else f"{v:12.3f}"
        print(f"{k:48s} {shown}")


if __name__ == "__main__":
    main()
