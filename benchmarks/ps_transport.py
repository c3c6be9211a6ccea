"""Socket vs shared memory for a co-located shard, with requests alternated so load drift cancels.

    python benchmarks/ps_transport.py [--json] [--batch 100000] [--pool 400000] [--rounds 25] [--threads 0]

Two shard processes on 127.0.0.1, one with ps.shared_memory off and one with it on (same tables as
benchmarks/ps_throughput.py, row-wise Adagrad, ps.threads from --threads), each prefilled with
--pool ids; one client per shard in this process. Each round pulls then pushes --batch unique ids
(uniform, client 0's stream of ps_throughput.py) at d64 through the socket shard and then through
the shared-memory shard, so both see the same moment of a shared machine. Prints per transport and
phase the median and the minimum of one request's seconds (the first round is a warm-up), and the
socket / shared-memory ratio of the pull+push time (> 1: shared memory is faster).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ps_throughput as T  # noqa: E402

from embedding_ps.client.client import PSClient  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--pool", type=int, default=400_000)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--threads", type=int, default=0, help="ps.threads of both shards")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    names = {False: "socket", True: "shm"}
    configs = {s: T.make_config(1, 1, threads=args.threads, shared_memory=s) for s in names}
    procs, clients = [], {}
    times = {(names[s], ph): [] for s in names for ph in ("pull", "push")}
    with tempfile.TemporaryDirectory(prefix="ps-transport-") as workdir:
        try:
            for s, cfg in configs.items():
                ready = os.path.join(workdir, f"{names[s]}.ready")
                procs.append(ctx.Process(target=T.shard_main, args=(cfg, 0, ready), daemon=True))
                procs[-1].start()
                address = T.wait_ready(ready, procs[-1])
                T.prefill(cfg, [address], args.pool)
                clients[s] = PSClient(cfg, [address], dedup=False)
            batches, grads = T.workload("uniform", 0, {"pool": args.pool, "batch": args.batch})[T.DIMS.index(64)]
            for r in range(args.rounds + 1):
                ids = batches[r % len(batches)]
                for s, client in clients.items():
                    t0 = time.perf_counter()
                    client.pull(1, ids)
                    t1 = time.perf_counter()
                    client.push(1, ids, grads)
                    t2 = time.perf_counter()
                    if r:                                   # round 0 is a warm-up
                        times[(names[s], "pull")].append(t1 - t0)
                        times[(names[s], "push")].append(t2 - t1)
            for client in clients.values():
                client.shutdown()
        finally:
            for client in clients.values():
                client.close()
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=10)
    res: dict[str, float] = {"batch": float(args.batch), "threads": float(args.threads)}
    for (name, phase), ts in times.items():
        res[f"{name}_{phase}_median_ms"] = 1e3 * float(np.median(ts))
        res[f"{name}_{phase}_min_ms"] = 1e3 * float(np.min(ts))
    both = {name: [a + b for a, b in zip(times[(name, "pull")], times[(name, "push")])] for name in names.values()}
    res["ratio_socket_over_shm_median"] = float(np.median(both["socket"]) / np.median(both["shm"]))
    res["ratio_socket_over_shm_min"] = float(np.min(both["socket"]) / np.min(both["shm"]))
    if args.json:
        print(json.dumps(res))
        return
    for k, v in res.items():
        print(f"{k:32s} {v:10.3f}")


if __name__ == "__main__":
    main()
