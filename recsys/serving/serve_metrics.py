"""`recsys serve`'s /metrics: counters and histograms in the Prometheus text format (version 0.0.4);
the series: docs/serving.md, the `GET /metrics` row.

Written here rather than with prometheus_client: a few counters, updated only from the event
loop's thread, need no locks or registry, and no further dependency.
"""

from __future__ import annotations

import bisect
import collections

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)


class Histogram:
    """Cumulative buckets as Prometheus renders them (`_bucket{le=...}`, `_sum`, `_count`)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {total}')
        braces = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{braces} {self.sum!r}", f"{name}_count{braces} {total}"]
        return out


class Metrics:
    def __init__(self) -> None:
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.latency: dict[str, Histogram] = {}
        self.rows = 0
        self.batch_rows = Histogram(BATCH_BUCKETS)
        self.batch_seconds = Histogram(LATENCY_BUCKETS)

    def request(self, endpoint: str, code: int, seconds: float) -> None:
        self.requests[(endpoint, code)] += 1
        self.latency.setdefault(endpoint, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def batch(self, rows: int, seconds: float) -> None:
        self.rows += rows
        self.batch_rows.observe(rows)
        self.batch_seconds.observe(seconds)

    def render(self, generation: int, step: int, queued: int) -> str:
        p = "recsys_serve"
        lines = [f"# HELP {p}_requests_total HTTP requests answered, by endpoint and status code",
                 f"# TYPE {p}_requests_total counter"]
        lines += [f'{p}_requests_total{{endpoint="{e}",code="{c}"}} {n}' for (e, c), n in sorted(self.requests.items())]
        lines += [f"# HELP {p}_request_seconds time from a request's arrival to its answer, by endpoint",
                  f"# TYPE {p}_request_seconds histogram"]
        for e, h in sorted(self.latency.items()):
            lines += h.lines(f"{p}_request_seconds", f'endpoint="{e}"')
        lines += [f"# HELP {p}_rows_total rows scored (predict and topk)", f"# TYPE {p}_rows_total counter",
                  f"{p}_rows_total {self.rows}",
                  f"# HELP {p}_batch_rows rows per micro-batch", f"# TYPE {p}_batch_rows histogram",
                  *self.batch_rows.lines(f"{p}_batch_rows"),
                  f"# HELP {p}_batch_seconds time of one micro-batch's Predictor call",
                  f"# TYPE {p}_batch_seconds histogram", *self.batch_seconds.lines(f"{p}_batch_seconds")]
        for name, value, what in (("model_generation", generation, "reloads since start"),
                                  ("model_step", step, "training step of the served model"),
                                  ("queued_requests", queued, "requests waiting for a batch")):
            lines += [f"# HELP {p}_{name} {what}", f"# TYPE {p}_{name} gauge", f"{p}_{name} {value}"]
        return "\n".join(lines) + "\n"


__all__ = ["Histogram", "Metrics"]
