"""What the graceful-stop check costs a step: one all_reduce(MAX) of a 1-element int64 over the ranks.

    python benchmarks/stop_check.py [--ranks 2] [--iters 3000] [--json]

Two (or --ranks) gloo processes on 127.0.0.1, one thread each. The baseline, measured in the same
run, is the collective every multi-rank step already makes: DDP's allreduce of the dense gradients
of configs/tiny.toml's model (1,497 float32 parameters; larger models make the ratio smaller).
A step here is some compute (COMPUTE_MATMULS 192x192 matmuls) and that allreduce; measured: the
step alone, and the step + the blocking `stop_agreed`. (An overlapped variant - the flags reduced
with async_op while the next step computes - measured no better here, 2 busy cores; the trainer
uses it all the same since 2026-11-27 (`stopping.StopAgreement`): it removes a sync point of the
ranks at every step boundary, which this two-rank loop of equal steps does not show.)
Figures: median microseconds per call over 5 blocks of --iters calls, and ratios to the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASELINE_PARAMS = 1497
COMPUTE_MATMULS = 8          # about 1-2 ms of one-thread compute per step, like the tiny model's step


def _rank(rank: int, world: int, port: int, iters: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from recsys.training import stopping

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    grads = torch.zeros(BASELINE_PARAMS)

    def block(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e6

    a = torch.randn(192, 192)

    def step() -> None:                   # a small step: some compute, then DDP's allreduce
        for _ in range(COMPUTE_MATMULS):
            a.mm(a)
        dist.all_reduce(grads)

    def step_blocking() -> None:
        step()
        stopping.stop_agreed(world)

    results: dict[str, list[float]] = {"step_us": [], "step_blocking_check_us": []}
    for _ in range(5):       # alternated, so that load on the machine hits both alike
        results["step_us"].append(block(step))
        results["step_blocking_check_us"].append(block(step_blocking))
    if rank == 0:
        Path(out).write_text(json.dumps({k: statistics.median(v) for k, v in results.items()}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    import tempfile

    import torch.multiprocessing as mp

    from recsys.training.launch import free_port

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_rank, args=(args.ranks, free_port(), args.iters, out), nprocs=args.ranks,
                           start_method="spawn", join=True)
        result = json.loads(Path(out).read_text())
    if not result.get("step_us"):
        raise SystemExit("error: no baseline measured")
    base = result["step_us"]
    for kind in ("blocking",):
        result[f"{kind}_added_us"] = result[f"step_{kind}_check_us"] - base
        result[f"{kind}_over_baseline"] = result[f"step_{kind}_check_us"] / base
    result["ranks"] = args.ranks
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.ranks} ranks, gloo, median us per step: baseline step {base:.0f}; with a blocking stop check "
              f"{result['step_blocking_check_us']:.0f} (x{result['blocking_over_baseline']:.3f}, "
              f"{result['blocking_added_us']:+.0f} us)")

if __name__ == "__main__":
    main()
