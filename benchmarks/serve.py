"""`recsys serve` under a closed-loop load on loopback, against the same Predictor called in-process.

    python benchmarks/serve.py [--json] [--clients 1,8,64] [--duration S] [--warmup S] [--repeats R]
                               [--rows N] [--steps N] [--max-batch B] [--max-wait-ms W] [--workers K]

Builds the quickstart model in-process (configs/quickstart.toml: DLRM, 13 dense + 26 one-id + 2
multi-hot features, D = 16), trains it `--steps` steps on `--rows` criteo-like rows, exports it
(fp32), and starts `recsys serve --export DIR --port 0` as its own process with the given batching
settings. Requests: batch-1, one eval row each (1,000 distinct rows, as JSON objects of all 41
feature columns, cycled), pre-encoded.

Load: C clients, closed loop (each sends its next request when its answer came), each on its own
keep-alive connection, from one separate client process (asyncio, HTTP/1.1 written by hand so that
the client costs little CPU: it shares the cores with the server). Per C in `--clients`: `--warmup`
seconds unmeasured, then `--duration` seconds counted: requests answered in the window / window
= `predictions_per_s_C` (one row per request), and the latency (send -> whole answer read) p50 /
p99 of those: `p50_ms_C`, `p99_ms_C`. `errors_C`: answers other than 200 (any makes the run fail).
The first answer of every client is checked against the in-process Predictor.

In-process, same run, same rows, before the server starts: the server's own work for one batch-1
request, `Predictor.predict([row])` (the row as a dict of JSON values), in a closed loop: `inprocess_p50_ms`,
`inprocess_predictions_per_s`. `ratio_p50_http_vs_inprocess` = p50_ms_1 / inprocess_p50_ms (what
HTTP, JSON and the queue add to one request) and `ratio_rate_64_vs_inprocess` =
predictions_per_s_64 / inprocess_predictions_per_s (above 1 when micro-batching wins back more
than HTTP costs). `--repeats R`: the whole sweep R times (levels in order), medians reported, every
repeat under `repeats`. Targets (#31): p99_ms_8 <= 5 ms; predictions_per_s_64 >= 2,000.
Figures: BENCHMARKS.md, "benchmarks/serve.py".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# -- the load generator (its own process: `serve.py --client URL ...`) ---------------------------

async def _client(host: str, port: int, requests: list[bytes], first: int, window: tuple[float, float],
                  out: dict) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    i = first
    try:
        while True:
            t0 = time.perf_counter()
            if t0 >= window[1]:
                break
            writer.write(requests[i % len(requests)])
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            body = await reader.readexactly(length)
            t1 = time.perf_counter()
            if not head.startswith(b"HTTP/1.1 200"):
                out["errors"] += 1
            elif i == first:
                out["first"].append((i % len(requests), json.loads(body)["probabilities"][0]))
            if window[0] <= t1 < window[1]:
                out["latencies"].append(t1 - t0)
            i += 1
    finally:
        writer.close()


def run_client(url: str, clients: int, duration: float, warmup: float, bodies_file: str) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    bodies = json.loads(Path(bodies_file).read_text())
    requests = [(f"POST /v1/predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(b.encode())}\r\n\r\n{b}").encode() for b in bodies]
    out: dict = {"errors": 0, "latencies": [], "first": []}
    start = time.perf_counter()
    window = (start + warmup, start + warmup + duration)

    async def main() -> None:
        await asyncio.gather(*(_client(host, int(port), requests, c * 97, window, out) for c in range(clients)))

    asyncio.run(main())
    return out


# -- the model, the server, the in-process reference ----------------------------------------------

def make_export(tmp: Path, rows: int, steps: int) -> tuple[Path, Path]:
    import torch

    from data.synthetic import generate
    from embedding_ps.local import LocalStore
    from recsys.config import load_config, to_toml
    from recsys.serving.export import export_model
    from recsys.serving.source import resolve_source
    from recsys.training.trainer import Trainer
    from recsys.training.worker import save_model

    data = tmp / "data"
    generate(preset="criteo-like", rows=rows, num_files=2, out_dir=str(data), seed=0)
    cfg = load_config(ROOT / "configs" / "quickstart.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", f"data.eval_paths=['{data}/part-00001.parquet']",
        f"train.run_dir='{tmp / 'run'}'", f"train.max_steps={steps}", "ps.mode='sync'"])
    torch.manual_seed(0)
    store = LocalStore.create(cfg.ps)
    trainer = Trainer(cfg, store)
    trainer.train()
    run = tmp / "run"
    save_model(trainer, store, run / "model")
    trainer.close()
    (run / "config.toml").write_text(to_toml(cfg))
    (run / "metrics.json").write_text(json.dumps({"steps": trainer.step}))
    export_model(resolve_source(run=run), tmp / "export")
    return tmp / "export", data / "part-00001.parquet"


def request_rows(eval_file: Path, n: int, columns) -> list[dict]:
    import pyarrow.parquet as pq

    names = [*columns.dense, *columns.sparse, *columns.weights]
    return json.loads(json.dumps(pq.read_table(eval_file, columns=names).slice(0, n).to_pylist()))


def inprocess(export: Path, rows: list[dict], seconds: float) -> tuple[dict, np.ndarray]:
    """Closed-loop batch-1 `Predictor.predict([row])` on one thread (the server's work)."""
    import torch

    from recsys.serving import Predictor
    torch.set_num_threads(1)
    p = Predictor(export)
    want = p.predict(rows)
    for r in rows[:200]:                                    # warm up
        p.predict([r])
    lat, i, end = [], 0, time.perf_counter() + seconds
    while (t0 := time.perf_counter()) < end:
        p.predict([rows[i % len(rows)]])
        lat.append(time.perf_counter() - t0)
        i += 1
    return {"inprocess_p50_ms": 1e3 * float(np.percentile(lat, 50)),
            "inprocess_p99_ms": 1e3 * float(np.percentile(lat, 99)),
            "inprocess_predictions_per_s": len(lat) / sum(lat)}, want


def start_server(export: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen([sys.executable, "-m", "recsys.cli", "serve", "--export", str(export), "--port", "0",
                             "--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms),
                             "--workers", str(args.workers)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"serve.py: recsys serve did not start (exit {proc.wait()})")
    return proc, json.loads(line)["url"]


def load(url: str, clients: int, args: argparse.Namespace, bodies_file: str, want: np.ndarray) -> dict:
    r = subprocess.run([sys.executable, __file__, "--client", url, "--clients", str(clients), "--duration",
                        str(args.duration), "--warmup", str(args.warmup), "--bodies", bodies_file],
                       capture_output=True, text=True, timeout=args.duration + args.warmup + 120, check=True)
    out = json.loads(r.stdout)
    for i, p in out["first"]:                      # the server answers what Predictor does
        if abs(p - float(want[i])) > 1e-6:
            raise SystemExit(f"serve.py: row {i}: the server answered {p}, the Predictor {want[i]}")
    lat = np.array(out["latencies"]) * 1e3
    return {f"p50_ms_{clients}": float(np.percentile(lat, 50)), f"p99_ms_{clients}": float(np.percentile(lat, 99)),
            f"predictions_per_s_{clients}": lat.size / args.duration, f"errors_{clients}": out["errors"]}


def sweep(export: Path, args: argparse.Namespace, bodies_file: str, want: np.ndarray) -> dict:
    proc, url = start_server(export, args)
    try:
        result: dict = {}
        for c in args.clients:
            result.update(load(url, c, args, bodies_file, want))
        return result
    finally:
        proc.terminate()
        proc.wait(30)


def summarize(repeats: list[dict], base: dict, args: argparse.Namespace) -> dict:
    keys = [k for k in repeats[0] if not k.startswith("errors_")]
    out = {k: round(statistics.median(r[k] for r in repeats), 3) for k in keys}
    out.update({k: sum(r[k] for r in repeats) for k in repeats[0] if k.startswith("errors_")})
    out.update({k: round(v, 4) for k, v in base.items()})
    if 1 in args.clients:
        out["ratio_p50_http_vs_inprocess"] = round(out["p50_ms_1"] / base["inprocess_p50_ms"], 3)
    if 64 in args.clients:
        out["ratio_rate_64_vs_inprocess"] = round(out["predictions_per_s_64"] / base["inprocess_predictions_per_s"], 3)
    if 8 in args.clients and 64 in args.clients:
        out["meets_target"] = out["p99_ms_8"] <= 5.0 and out["predictions_per_s_64"] >= 2000
    out["settings"] = {"max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms, "workers": args.workers,
                       "duration_s": args.duration, "repeats": args.repeats, "steps": args.steps,
                       "cpus": os.cpu_count(), "load_avg": os.getloadavg()[0]}
    out["repeats"] = repeats
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    ap.add_argument("--duration", type=float, default=5.0, help="measured seconds per client count")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--rows", type=int, default=20000, help="synthetic rows to train on (and eval rows)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--max-wait-ms", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)       # the load generator's process
    ap.add_argument("--bodies", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        sys.stdout.write(json.dumps(run_client(args.client, args.clients[0], args.duration, args.warmup,
                                               args.bodies)))
        return 0
    from recsys.serving import Predictor
    from recsys.serving.rows import Columns

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        export, eval_file = make_export(Path(tmp), args.rows, args.steps)
        rows = request_rows(eval_file, 1000, Columns.of(Predictor(export).config.data))
        bodies_file = str(Path(tmp) / "bodies.json")
        Path(bodies_file).write_text(json.dumps([json.dumps({"rows": [r]}) for r in rows]))
        base, want = inprocess(export, rows, args.duration)
        repeats = [sweep(export, args, bodies_file, want) for _ in range(args.repeats)]
    result = summarize(repeats, base, args)
    if args.json:
        print(json.dumps(result))
    else:
        for c in args.clients:
            print(f"{c:3d} clients: p50 {result[f'p50_ms_{c}']:.3f} ms  p99 {result[f'p99_ms_{c}']:.3f} ms  "
                  f"{result[f'predictions_per_s_{c}']:,.0f} predictions/s  errors {result[f'errors_{c}']}")
        print(f"in-process batch-1: p50 {base['inprocess_p50_ms']:.3f} ms, "
              f"{base['inprocess_predictions_per_s']:,.0f} predictions/s; "
              f"ratios {({k: v for k, v in result.items() if k.startswith('ratio')})}")
    return 1 if any(result[f"errors_{c}"] for c in args.clients) else 0


if __name__ == "__main__":
    sys.exit(main())
