"""PNG plots from the benchmarks' --json outputs (for BENCHMARKS.md).

    python benchmarks/plots.py --train-distributed td.json [--serving serving.json]
                               [--ps-table pt_1e6.json pt_5e6.json ...] [--checkpoint ckpt.json]
                               [--scale scale.json] [--out benchmarks/figures]

Each input is a file holding what a benchmark printed with --json (a whole file of JSON, or a
log whose last line starting with "{" is the JSON). Plots made, each only from the inputs given:

- `train_distributed.png`: samples/s of ours per (trainers, shards) layout, sync and async bars,
  against TorchRec DMP on 2 processes (table-wise and the planner's choice) as horizontal lines
  (from benchmarks/train_distributed.py --json).
- `serving_latency.png`: a histogram of batch-1 latencies (the slowest 0.5% of calls off the axis),
  one series per list of per-call latencies in the input (any list of numbers under a key containing
  "latenc" and "ms": what `benchmarks/serving.py --latencies FILE` writes); without such a list the
  plot is skipped and the script says so.
- `memory_per_row.png`: bytes per row against rows, from benchmarks/ps_table.py --json
  (`rss_rows` and `rss_bytes_per_row_d{D}`: a shard's resident memory, one point per file) and
  benchmarks/checkpoint.py --json (`sizes[*].rows` / `.bytes`: the saved shard's bytes), with raw
  fp32 (4 * D bytes) as the reference line; and/or from benchmarks/scale.py --json (`points[*]`:
  `rows` / `bytes_per_row`, the summed resident memory of its shard processes per row).

The figures are small (5 x 3.2 in at 80 dpi). A plot whose input lacks the figures it needs is an
error (exit 1), not an empty picture.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

LAYOUTS = ((1, 2), (2, 1), (2, 2))    # (trainers, shards), the x axis of train_distributed.png
FIGSIZE, DPI = (5.0, 3.2), 80


def read_json(path: str) -> dict:
    """A benchmark's --json output: the whole file, or its last line that starts with '{'."""
    text = Path(path).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        lines = [s for s in text.splitlines() if s.startswith("{")]
        if not lines:
            raise ValueError(f"{path}: no JSON object found") from None
        return json.loads(lines[-1])


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    """Lay the figure out, write it to `path` as PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_train_distributed(r: dict, out: Path) -> Path:
    """Grouped bars (sync, async) per layout; DMP's rates as horizontal lines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    width = 0.38
    drawn = 0
    for k, mode in enumerate(("sync", "async")):
        xs, ys = [], []
        for i, (t, s) in enumerate(LAYOUTS):
            v = r.get(f"ours_{mode}_{t}t{s}s")
            if v:
                xs.append(i + (k - 0.5) * width)
                ys.append(v)
        if xs:
            bars = ax.bar(xs, ys, width, label=f"ours {mode}")
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
            drawn += len(xs)
    for key, style, label in (("torchrec_dmp_tw", "--", "TorchRec DMP, table-wise"),
                              ("torchrec_dmp_planner", ":", "TorchRec DMP, planner's choice")):
        if r.get(key):
            ax.axhline(r[key], color="black", linestyle=style, linewidth=1, label=f"{label} (2 processes)")
    if not drawn:
        raise ValueError("train_distributed JSON has no ours_* rates")
    ax.set_xticks(range(len(LAYOUTS)), [f"{t} trainer{'s' * (t > 1)}\n{s} shard{'s' * (s > 1)}"
                                        for t, s in LAYOUTS], fontsize=8)
    ax.set_ylabel("samples/s (global)", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ratio = r.get("ratio_vs_torchrec_dmp")
    ax.set_title(f"DLRM D={r.get('dim')}, global batch {r.get('global_batch')}, {r.get('cpus')} CPUs "
                 f"({r.get('date', '')[:10]})\nsync 2t2s / DMP table-wise = {ratio}", fontsize=8)
    top = max([v for k, v in r.items() if k.startswith(("ours_", "torchrec_dmp_")) and isinstance(v, (int, float))])
    ax.set_ylim(0, 1.45 * top)                        # room for the legend above the bars
    ax.legend(fontsize=6, loc="upper left", ncol=2)
    return _save(plt, fig, out / "train_distributed.png")


def _latency_lists(obj, prefix: str = "") -> dict[str, list[float]]:
    """Every list of numbers in `obj` under a key naming a latency in ms, by its dotted key."""
    found: dict[str, list[float]] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            name = f"{prefix}{k}"
            low = k.lower()
            if (isinstance(v, list) and len(v) > 1 and all(isinstance(x, (int, float)) for x in v)
                    and "latenc" in low and "ms" in low):
                found[name] = [float(x) for x in v]
            else:
                found.update(_latency_lists(v, name + "."))
    return found


def plot_serving(r: dict, out: Path) -> Path | None:
    """Histogram of batch-1 latencies, one series per latency list found; None when there is none."""
    series = _latency_lists(r)
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    every = sorted(x for xs in series.values() for x in xs)
    hi = every[min(len(every) - 1, int(0.995 * len(every)))]       # the slowest 0.5% off the axis
    for name, xs in series.items():
        ax.hist([x for x in xs if x <= hi], bins=60, range=(0, hi), histtype="step", label=name)
    ax.set_xlabel("batch-1 latency (ms)", fontsize=8)
    ax.set_ylabel("calls", fontsize=8)
    ax.set_title(f"serving, batch 1: p50 {r.get('p50_ms_b1')} ms, p99 {r.get('p99_ms_b1')} ms", fontsize=8)
    ax.legend(fontsize=6)
    return _save(plt, fig, out / "serving_latency.png")


def plot_memory(ps_tables: list[dict], checkpoint: dict | None, out: Path, scale: dict | None = None) -> Path:
    """Bytes per row against rows (log x): a shard's resident memory and its saved bytes, raw fp32 line."""
    resident, dims = [], set()
    for r in ps_tables:
        keys = [k for k in r if k.startswith("rss_bytes_per_row_d")]
        if "rss_rows" not in r or not keys:
            raise ValueError("ps_table JSON lacks rss_rows / rss_bytes_per_row_d* (run without --skip-rss)")
        dim = int(keys[0].removeprefix("rss_bytes_per_row_d"))
        resident.append((r["rss_rows"], r[keys[0]]))
        dims.add(dim)
    saved = []
    for s in (checkpoint or {}).get("sizes", []):
        saved.append((s["rows"], s["bytes"] / s["rows"]))
        dims.add(s["dim"])
    shards = []
    if scale is not None:
        if not scale.get("points"):
            raise ValueError("scale JSON lacks points (rows / bytes_per_row per size)")
        for pt in scale["points"]:
            shards.append((pt["rows"], pt["bytes_per_row"]))
            dims.add(pt["dim"])
    if not resident and not saved and not shards:
        raise ValueError("no memory figures: give --ps-table, --checkpoint and/or --scale JSON")
    if len(dims) != 1:
        raise ValueError(f"the inputs mix embedding dims {sorted(dims)}; plot one dim at a time")
    dim = dims.pop()
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for pts, marker, label in ((resident, "o-", "shard resident memory (ps_table.py)"),
                               (saved, "s-", "saved shard bytes (checkpoint.py)"),
                               (shards, "^-", "shard processes' resident memory (scale.py)")):
        if pts:
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, label=label)
    ax.axhline(4 * dim, color="black", linestyle="--", linewidth=1, label=f"raw fp32 ({4 * dim} B)")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.2 * max([4 * dim] + [p[1] for p in resident + saved + shards]))
    ax.set_xlabel("rows", fontsize=8)
    ax.set_ylabel("bytes per row", fontsize=8)
    ax.set_title(f"memory per row, D={dim}", fontsize=8)
    ax.legend(fontsize=6)
    return _save(plt, fig, out / "memory_per_row.png")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-distributed", help="benchmarks/train_distributed.py --json output")
    p.add_argument("--serving", help="benchmarks/serving.py --json output")
    p.add_argument("--ps-table", nargs="*", default=[], help="benchmarks/ps_table.py --json outputs")
    p.add_argument("--checkpoint", help="benchmarks/checkpoint.py --json output")
    p.add_argument("--scale", help="benchmarks/scale.py --json output")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "figures"))
    a = p.parse_args()
    if not (a.train_distributed or a.serving or a.ps_table or a.checkpoint or a.scale):
        p.error("give at least one benchmark's JSON")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        if a.train_distributed:
            print(plot_train_distributed(read_json(a.train_distributed), out))
        if a.serving:
            made = plot_serving(read_json(a.serving), out)
            print(made if made else f"{a.serving}: no list of batch-1 latencies; serving_latency.png not made")
        if a.ps_table or a.checkpoint or a.scale:
            print(plot_memory([read_json(x) for x in a.ps_table],
                              read_json(a.checkpoint) if a.checkpoint else None, out,
                              read_json(a.scale) if a.scale else None))
    except (ValueError, KeyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
