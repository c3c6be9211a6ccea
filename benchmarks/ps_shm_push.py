"""Shared-memory pull+push of one shard: the older request order against late grads + notify, and the
in-process bound, alternated request by request so that load drift hits all three alike.

    python benchmarks/ps_shm_push.py [--json] [--ids uniform|zipf] [--batch 100000] [--pool 400000] [--rounds 40]

One shard process on 127.0.0.1 (ps.shared_memory true, the tables of benchmarks/ps_throughput.py,
row-wise Adagrad), prefilled with --pool ids, and one client in this process. Each round pulls then
pushes --batch ids of client 0's stream (d64) three ways, in turn:

    copy_first   PSClient.late_grads = notify = False: the grads are copied into the segment (a
                 torch copy), then the request is sent; the shard sums the grads (finite check);
                 the caller waits for the reply (the order before these options)
    late_notify  the defaults: the request is sent first and the grads copied (+ checked) while it
                 travels, the shard looks the ids up meanwhile, and wakes the caller through the
                 segment when done (protocol.FLAG_GRADS_LATE, FLAG_NOTIFY)
    inprocess    the same ShardState op mix in this process (ps_throughput.py's in-process bound)

Prints the median ms of each phase (the first two rounds are a warm-up) and, per client order, the
ratio of the in-process pull+push time to its pull+push time (ps_throughput's ratio_vs_inprocess_shm,
measured here alternated instead of one after the other), and late_notify's speed-up over copy_first.
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

from embedding_ps.client.client import PSClient  # noqa: E402
from embedding_ps.shard.state import ShardState  # noqa: E402

ORDERS = {"copy_first": (False, False), "late_notify": (True, True)}
TABLE = 1        # the d64 table of ps_throughput.make_config
WARMUP = 2


def measure(client: PSClient, state: ShardState, batches: list[torch.Tensor], grads: torch.Tensor,
            rounds: int) -> dict[str, list[float]]:
    """Seconds of each (way, phase) per round, the three ways alternated within a round."""
    out: dict[str, list[float]] = {}
    rows = torch.empty(grads.shape)                  # the in-process pull's reply buffer
    for r in range(rounds + WARMUP):
        ids = batches[r % len(batches)]
        for way in (*ORDERS, "inprocess"):
            if way == "inprocess":
                pull, push = (lambda: state.pull(TABLE, ids, 1, out=rows)), (lambda: state.push(TABLE, ids, grads, 1))
            else:
                client.late_grads, client.notify = ORDERS[way]
                pull, push = (lambda: client.pull(TABLE, ids)), (lambda: client.push(TABLE, ids, grads))
            t0 = time.perf_counter()
            pull()
            t1 = time.perf_counter()
            push()
            t2 = time.perf_counter()
            if r >= WARMUP:
                out.setdefault(f"{way}_pull", []).append(t1 - t0)
                out.setdefault(f"{way}_push", []).append(t2 - t1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--ids", choices=("uniform", "zipf"), default="uniform")
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--pool", type=int, default=400_000)
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(1)
    config = T.make_config(1, 1, shared_memory=True)
    knobs = {"pool": args.pool, "batch": args.batch}
    batches, grads = T.workload(args.ids, 0, knobs)[TABLE]
    state = ShardState(config, 0)                    # prefilled as the shard
    for chunk in torch.split(T.pool_ids(args.pool), 200_000):
        state.push(TABLE, chunk, torch.zeros(chunk.numel(), grads.shape[1]), step=0)
    with T.shard_and_client(config, args.pool, "ps-shm-push-") as client:
        times = measure(client, state, batches, grads, args.rounds)
    ms = {f"{k}_ms": 1e3 * float(np.median(v)) for k, v in times.items()}
    res: dict[str, float | str] = {"ids": args.ids, "batch": float(args.batch), "rounds": float(args.rounds), **ms}
    bound = ms["inprocess_pull_ms"] + ms["inprocess_push_ms"]
    for way in ORDERS:
        res[f"ratio_vs_inprocess_{way}"] = bound / (ms[f"{way}_pull_ms"] + ms[f"{way}_push_ms"])
    res["speedup_late_notify_vs_copy_first"] = ((ms["copy_first_pull_ms"] + ms["copy_first_push_ms"])
                                                / (ms["late_notify_pull_ms"] + ms["late_notify_push_ms"]))
    if args.json:
        print(json.dumps(res))
        return
    for k, v in res.items():
        print(f"{k:40s} {v if isinstance(v, str) else f'{v:10.3f}'}")


if __name__ == "__main__":
    main()
