"""Back-to-back shared-memory requests: one segment reused (the client waits for the last request's
segment to settle) against two alternated (it does not), in one run.

    python benchmarks/shm_segments.py [--json] [--ids uniform|zipf|both] [--batch 100000] [--pool 400000]
                                      [--blocks 6] [--block 20]

One shard process on 127.0.0.1 (ps.shared_memory true, the tables of benchmarks/ps_throughput.py,
row-wise Adagrad, prefilled with --pool ids) and one client in this process. The client makes
--block pulls back to back (d64, client 0's id batches of ps_throughput.py), then --block pushes,
with its segment settle on (`embedding_ps.client.segments.ClientSegments.settle_s` = shm.SETTLE_S, the default) and off (0), the
two alternated --blocks times each so that load drift hits both alike. A pull's caller drops its rows
at once and the next request follows at once: the shape of ps_throughput.py's phases, and of a
client that does not hold on to what it pulled.

With settle on, a request that finds no idle segment waits (at most SETTLE_S) for the one whose
last request already gave its caller the result (FLAG_NOTIFY) and whose reply the client's I/O
thread is still handling; off, it takes a second segment, and back-to-back requests alternate between
two. Prints per way and phase the median ms of one request (the first two of each block, which make
the way's segments, are not counted) and the segments the client holds at the end of its blocks; `speedup_*` = off / on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ps_throughput as T  # noqa: E402

from embedding_ps.wire import shm  # noqa: E402
from embedding_ps.client.client import PSClient  # noqa: E402

TABLE = 1        # the d64 table of ps_throughput.make_config
WAYS = {"settle": shm.SETTLE_S, "no_settle": 0.0}
SKIP = 2


def measure(client: PSClient, batches: list[torch.Tensor], grads: torch.Tensor, blocks: int,
            block: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Seconds per request of each (way, phase), and the segments held after each way's blocks."""
    times: dict[str, list[float]] = {}
    held: dict[str, int] = {}
    for _ in range(blocks):
        for way, settle_s in WAYS.items():
            client._shm.settle_s = settle_s
            for phase in ("pull", "push"):
                for r in range(block + SKIP):
                    ids = batches[r % len(batches)]
                    t0 = time.perf_counter()
                    if phase == "pull":
                        client.pull(TABLE, ids)
                    else:
                        client.push(TABLE, ids, grads)
                    if r >= SKIP:          # the first two of a block make the way's segments (page faults)
                        times.setdefault(f"{way}_{phase}", []).append(time.perf_counter() - t0)
            held[way] = len(client._shm.pool.segs)
            client._shm.pool.close()                       # the next way starts with no segment
    return times, held


def run(ids: str, args: argparse.Namespace) -> dict[str, float]:
    config = T.make_config(1, 1, shared_memory=True)
    batches, grads = T.workload(ids, 0, {"pool": args.pool, "batch": args.batch})[TABLE]
    with T.shard_and_client(config, args.pool, "shm-segments-") as client:
        if client._shm.pool is None:
            raise SystemExit("shared memory is not available here (/dev/shm)")
        times, held = measure(client, batches, grads, args.blocks, args.block)
    res: dict[str, float] = {f"{ids}_{k}_ms": 1e3 * float(np.median(v)) for k, v in times.items()}
    for way, n in held.items():
        res[f"{ids}_{way}_segments"] = float(n)
    for phase in ("pull", "push"):
        res[f"{ids}_speedup_{phase}"] = res[f"{ids}_no_settle_{phase}_ms"] / res[f"{ids}_settle_{phase}_ms"]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--ids", choices=("uniform", "zipf", "both"), default="both")
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--pool", type=int, default=400_000)
    p.add_argument("--blocks", type=int, default=6, help="blocks of each way, alternated")
    p.add_argument("--block", type=int, default=20, help="requests per block and phase (+2 not counted)")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    res: dict[str, float] = {"batch": float(args.batch), "blocks": float(args.blocks), "block": float(args.block)}
    for ids in (("uniform", "zipf") if args.ids == "both" else (args.ids,)):
        res.update(run(ids, args))
    if args.json:
        print(json.dumps(res))
        return
    for k, v in res.items():
        print(f"{k:32s} {v:10.3f}")


if __name__ == "__main__":
    main()
