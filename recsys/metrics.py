"""CTR metrics (AUC, logloss, NE, calibration), their streaming accumulator, and the metric logger.

The functions take labels {0, 1} and scores (predicted probabilities in [0, 1]) as 1-D torch tensors
or numpy arrays of equal length, and compute in float64 on the CPU. Undefined values are NaN, not
errors, so one degenerate eval shard does not crash a job (AUC with only one label present, NE when
the base rate is 0 or 1, calibration without positives); empty inputs, labels other than 0/1 and
length mismatches raise ValueError.

With per-row weights w (`data.example_weight_column`) every metric is weighted: AUC counts a
(positive, negative) pair as w_pos * w_neg, logloss = sum w l / sum w, the base rate of NE is
sum w y / sum w, calibration = sum w p / sum w y; the count stays a row count.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from recsys.dist import all_gather_parts, all_reduce, is_distributed

logger = logging.getLogger(__name__)

EPS = 1e-12
"""Scores are clamped to [EPS, 1 - EPS] inside the log, so a confident miss costs ~27.6, not inf."""

ArrayLike = torch.Tensor | np.ndarray


# ---------------------------------------------------------------------------------------------
# Exact metrics


def _pair(labels: ArrayLike, scores: ArrayLike, weights: ArrayLike | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """labels, scores (, weights) -> float64 CPU tensors [N] (weights None stays None), checked: same
    length, N > 0, labels in {0, 1}, weights finite and >= 0."""
    y, s, w = (None if x is None else torch.as_tensor(x).detach().to("cpu", torch.float64).reshape(-1)
               for x in (labels, scores, weights))                                # [N] each
    if y.numel() != s.numel():
        raise ValueError(f"labels and scores differ in length: {y.numel()} vs {s.numel()}")
    if y.numel() == 0:
        raise ValueError("no examples: labels and scores are empty")
    if not bool(((y == 0) | (y == 1)).all()):
        bad = y[(y != 0) & (y != 1)][:5].tolist()
        raise ValueError(f"labels must be 0 or 1, got values such as {bad}")
    if w is not None and w.numel() != y.numel():
        raise ValueError(f"weights and labels differ in length: {w.numel()} vs {y.numel()}")
    if w is not None and not bool((torch.isfinite(w) & (w >= 0)).all()):
        bad = w[~torch.isfinite(w) | (w < 0)][:5].tolist()
        raise ValueError(f"weights must be finite and >= 0, got values such as {bad}")
    return y, s, w


def auc(labels: ArrayLike, scores: ArrayLike, weights: ArrayLike | None = None) -> float:
    """Exact ROC AUC: P(score of a positive > score of a negative), ties counted as 1/2 (weighted: the
    module docstring). Per distinct score (one sort, O(N log N)) the positive and negative weight; a
    positive wins the negative weight below its score and half of its own score's. Scores need not be
    probabilities, only finite. NaN (with a warning) when every label is the same."""
    y, s, w = _pair(labels, scores, weights)
    w = torch.ones_like(y) if w is None else w
    _, inverse = torch.unique(s, sorted=True, return_inverse=True)
    pos, neg = torch.bincount(inverse, w * y), torch.bincount(inverse, w * (1 - y))   # [G] per distinct score
    value = _auc_of_groups(pos, neg)
    if math.isnan(value):
        logger.warning("auc is undefined without positive and negative examples (weight %g, %g); returning nan",
                       float(pos.sum()), float(neg.sum()))
    return value


def _auc_of_groups(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """AUC of positive and negative weights [G] per score group (groups in score order, a group's
    pairs tied); NaN when either side is empty."""
    num_pos, num_neg = float(pos.sum()), float(neg.sum())
    if num_pos == 0 or num_neg == 0:
        return math.nan
    wins = (pos * (torch.cumsum(neg, 0) - 0.5 * neg)).sum()             # negatives below, half the tied ones
    return float(wins) / (num_pos * num_neg)


def _sums(y: torch.Tensor, s: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [loss, labels, scores, weight, count] sums of checked y, s [N] (`_pair`), each term times
    w [N] when given (the weight sum is then sum w, else the count); loss as in `logloss`."""
    p = s.clamp(EPS, 1 - EPS)
    loss = -(y * torch.log(p) + (1 - y) * torch.log1p(-p))           # [N]
    w = torch.ones_like(y) if w is None else w                         # x 1.0: the same sums
    return torch.stack([(w * loss).sum(), (w * y).sum(), (w * s).sum(), w.sum(),
                        torch.tensor(float(y.numel()), dtype=torch.float64)])


def _of_sums(sums: torch.Tensor) -> dict[str, float]:
    """{"logloss", "ne", "calibration", "count"} of `_sums` (added up over batches and ranks)."""
    loss_sum, label_sum, score_sum, weight_sum, count = sums.tolist()
    ll = loss_sum / weight_sum if weight_sum > 0 else math.nan        # every weight 0: undefined
    p = label_sum / weight_sum if weight_sum > 0 else 0.0
    h = -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p)) if 0.0 < p < 1.0 else 0.0   # H(base rate), nats
    return {"logloss": ll, "ne": ll / h if h > 0 else math.nan,
            "calibration": score_sum / label_sum if label_sum > 0 else math.nan, "count": count}


def logloss(labels: ArrayLike, scores: ArrayLike) -> float:
    """Mean binary cross-entropy -(y log p + (1 - y) log(1 - p)) in nats, p clamped to [EPS, 1 - EPS]."""
    return _of_sums(_sums(*_pair(labels, scores)))["logloss"]


def normalized_entropy(labels: ArrayLike, scores: ArrayLike) -> float:
    """NE = logloss / H(p), p = mean label, H(p) = -(p log p + (1 - p) log(1 - p)).

    The logloss of always predicting the base rate is H(p), so NE < 1 means the model beats it
    (He et al., 2014). NaN when every label is the same (H(p) = 0).
    """
    return _of_sums(_sums(*_pair(labels, scores)))["ne"]


def calibration(labels: ArrayLike, scores: ArrayLike) -> float:
    """Mean score / mean label: 1 when the model predicts as many clicks as there are. NaN without positives."""
    return _of_sums(_sums(*_pair(labels, scores)))["calibration"]


# ---------------------------------------------------------------------------------------------
# Streaming accumulators


class StreamingAUC:
    """ROC AUC from per-label histograms of scores in [0, 1], in O(num_buckets) memory.

    Scores in one bucket count as tied, so the result differs from the exact AUC by at most
    `error_bound()` = 0.5 * sum_b pos_b * neg_b / (P * N): only the pairs sharing a bucket can be
    misjudged, and each is off by 1/2 at most. For scores spread over the buckets that is about
    0.5 / num_buckets; it is 0 when no bucket holds two distinct scores.

    The state is one float64 tensor `hist` [2, num_buckets] (row 0 negatives, row 1 positives),
    so ranks merge by adding, and a reduction is one `all_reduce`.

    Example::

        m = StreamingAUC(num_buckets=1000)
        m.update(torch.tensor([0, 1, 1]), torch.tensor([0.2, 0.9, 0.4]))
        m.compute()   # 1.0
    """

    def __init__(self, num_buckets: int = 10_000) -> None:
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        self.num_buckets = num_buckets
        self.hist = torch.zeros(2, num_buckets, dtype=torch.float64)      # [2, K]

    def update(self, labels: ArrayLike, scores: ArrayLike, weights: ArrayLike | None = None) -> None:
        """Add a batch: labels {0, 1} [N], scores in [0, 1] [N] (ValueError outside: pass sigmoid(logits)),
        optional weights [N] >= 0 (each example counts that much instead of 1)."""
        self._add(*_pair(labels, scores, weights))

    def _add(self, y: torch.Tensor, s: torch.Tensor, w: torch.Tensor | None) -> None:
        """`update` of inputs `_pair` has checked."""
        lo, hi = float(s.min()), float(s.max())
        if not (0.0 <= lo and hi <= 1.0):   # also catches NaN
            raise ValueError(f"StreamingAUC needs scores in [0, 1], got min {lo} max {hi}; pass probabilities")
        K = self.num_buckets
        bucket = (s * K).long().clamp_(max=K - 1)                        # [N], a score of 1.0 -> K-1
        flat = y.long() * K + bucket                                      # [N] index into hist.view(-1)
        self.hist += torch.bincount(flat, weights=w, minlength=2 * K).view(2, K).to(torch.float64)

    def merge(self, other: StreamingAUC) -> StreamingAUC:
        """Add `other`'s counts into this one (same num_buckets); returns self."""
        if other.num_buckets != self.num_buckets:
            raise ValueError(f"cannot merge StreamingAUC with {other.num_buckets} buckets into {self.num_buckets}")
        self.hist += other.hist
        return self

    def compute(self) -> float:
        """AUC with same-bucket pairs counted as ties; NaN when one label is absent."""
        return _auc_of_groups(self.hist[1], self.hist[0])

    def error_bound(self) -> float:
        """Largest possible |compute() - exact AUC| given these histograms (see the class docstring)."""
        neg, pos = self.hist[0], self.hist[1]
        pairs = float(pos.sum()) * float(neg.sum())
        return 0.5 * float((pos * neg).sum()) / pairs if pairs > 0 else math.nan


class CTRMetrics:
    """Accumulates auc / logloss / ne / calibration / count over batches and ranks.

    Keeps sums [loss, labels, scores, weight, count] and a `StreamingAUC`; with `exact_auc=True` it
    also keeps every (label, score) pair (16 bytes per example, 24 weighted) to compute the exact
    AUC. `weighted=True`: every update gives per-example weights [N] and the sums are weighted
    (see the module docstring); without, the weight sum is the count. Use: `eval_metrics`.
    """

    def __init__(self, num_buckets: int = 10_000, exact_auc: bool = False, weighted: bool = False) -> None:
        self.sums = torch.zeros(5, dtype=torch.float64)                   # [loss, labels, scores, weight, count]
        self.streaming_auc = StreamingAUC(num_buckets)
        self.exact_auc = exact_auc
        self.weighted = weighted
        self._kept: list[tuple[torch.Tensor, ...]] = []    # exact_auc: per update (labels, scores(, weights)) [N]

    def update(self, labels: ArrayLike, scores: ArrayLike, weights: ArrayLike | None = None) -> None:
        """Add a batch: labels {0, 1} [N], scores (probabilities) [N], weights [N] (>= 0) when weighted."""
        if (weights is not None) != self.weighted:
            raise ValueError(f"CTRMetrics(weighted={self.weighted}).update needs weights "
                             f"{'[N]' if self.weighted else 'None'}")
        y, s, w = _pair(labels, scores, weights)
        self.streaming_auc._add(y, s, w)                                  # also checks 0 <= s <= 1
        self.sums += _sums(y, s, w)
        if self.exact_auc:
            self._kept.append((y, s) if w is None else (y, s, w))

    def merge(self, other: CTRMetrics) -> CTRMetrics:
        """Add `other`'s state into this one; returns self."""
        if other.exact_auc != self.exact_auc or other.weighted != self.weighted:
            raise ValueError("cannot merge CTRMetrics with and without exact_auc / weighted")
        self.sums += other.sums
        self.streaming_auc.merge(other.streaming_auc)
        self._kept += other._kept
        return self

    def reduced(self) -> CTRMetrics:
        """A copy holding the state of every rank (collective; a plain copy when not distributed).

        The sums and the histogram travel in one all_reduce; with `exact_auc` the labels and
        scores are all-gathered too.
        """
        out = copy.deepcopy(self)
        if not is_distributed():
            return out
        S = self.sums.numel()
        total = all_reduce(torch.cat([self.sums, self.streaming_auc.hist.view(-1)]))   # [S + 2K]
        out.sums, out.streaming_auc.hist = total[:S].clone(), total[S:].view(2, -1).clone()
        if self.exact_auc:
            k = 3 if self.weighted else 2
            mine = (torch.stack([torch.cat(c) for c in zip(*self._kept)]) if self._kept     # [k, N]
                    else torch.zeros(k, 0, dtype=torch.float64))
            out._kept = [tuple(torch.cat([p.view(k, -1) for p in all_gather_parts(mine.reshape(-1))], dim=1))]
        return out

    def compute(self) -> dict[str, float]:
        """{"auc", "logloss", "ne", "calibration", "count"} of what was added here (see `reduced`)."""
        if self.sums[4] == 0:
            raise ValueError("CTRMetrics.compute: no examples were added")
        auc_value = auc(*map(torch.cat, zip(*self._kept))) if self.exact_auc else self.streaming_auc.compute()
        return {"auc": auc_value, **_of_sums(self.sums)}

    def reset(self) -> None:
        self.sums.zero_()
        self.streaming_auc.hist.zero_()
        self._kept.clear()


def eval_metrics(labels: torch.Tensor, scores: torch.Tensor, p_true: torch.Tensor | None,
                 exact_auc: bool = True, weights: torch.Tensor | None = None) -> dict[str, float]:
    """auc, logloss, ne, calibration, eval_examples (and oracle_auc when p_true is known) over every rank's
    part of the eval set; exact_auc=False: the bucketed streaming AUC (large evals); `weights` [N]: per row."""
    m = CTRMetrics(exact_auc=exact_auc, weighted=weights is not None)
    m.update(labels, scores, weights)
    out = m.reduced().compute()
    out["eval_examples"] = out.pop("count")
    if p_true is not None:
        oracle = CTRMetrics(exact_auc=exact_auc, weighted=weights is not None)
        oracle.update(labels, p_true, weights)
        out["oracle_auc"] = oracle.reduced().compute()["auc"]
    return out


def retrieval_metrics(top: np.ndarray, relevant: Sequence[np.ndarray], ks: Sequence[int]) -> dict[str, float]:
    """recall@K and ndcg@K, averaged over users, of ranked lists `top` [U, L] (best first; L may be
    below K: a shorter list) against each user's relevant item ids (distinct, non-empty).

    recall@K = |top_K & R| / |R|;  ndcg@K = sum_{i < K, top_i in R} 1 / log2(i + 2) over the same
    sum for an ideal list (min(|R|, K) hits first). Binary relevance.
    """
    if len(relevant) != top.shape[0] or not len(relevant):
        raise ValueError(f"retrieval_metrics: {top.shape[0]} ranked lists for {len(relevant)} users")
    K = max(ks)
    hits = np.zeros((top.shape[0], K), dtype=bool)                         # [U, K]
    for u, rel in enumerate(relevant):
        hits[u, :min(K, top.shape[1])] = np.isin(top[u, :K], rel)
    sizes = np.array([len(r) for r in relevant], dtype=np.float64)         # [U]
    gain = 1.0 / np.log2(np.arange(K) + 2.0)                                # [K]
    ideal = np.cumsum(gain)                                                 # [K]: ideal DCG at each cut
    out: dict[str, float] = {}
    for k in ks:
        found = hits[:, :k]
        out[f"recall@{k}"] = float((found.sum(1) / sizes).mean())
        idcg = ideal[np.minimum(sizes, k).astype(np.int64) - 1]
        out[f"ndcg@{k}"] = float(((found * gain[:k]).sum(1) / idcg).mean())
    return out


# ---------------------------------------------------------------------------------------------
# Metric logging


LINE_KEYS = ("loss/train", "auc/train", "val/auc", "val/logloss", "perf/samples_per_s", "data/wait_frac",
             "ps/pull_ms", "cache/hit_rate")
"""The metrics a step's log line shows (the rest are in metrics.jsonl and TensorBoard; --verbose shows all)."""


def step_line(values: Mapping[str, float], step: int, verbose: bool = False) -> str:
    """`epoch 1/2 step 40/120 eta 0:01:10 | loss/train=0.45 ...`: the progress/* values (the trainer's
    `progress/epoch`, `progress/epochs`, `progress/total_steps`, `progress/eta_s`) as a prefix, then
    the LINE_KEYS present (every key with `verbose`, or when none is: final/*, test/*), NaN ones left out."""
    total = values.get("progress/total_steps")
    head = f"step {step}" if total is None else f"step {step}/{int(total)}"
    if "progress/epoch" in values:
        head = f"epoch {int(values['progress/epoch'])}/{int(values.get('progress/epochs', 0))} {head}"
    eta = values.get("progress/eta_s")
    if eta is not None and math.isfinite(eta):
        head += f" eta {datetime.timedelta(seconds=round(eta))}"
    verbose = verbose or not any(k in LINE_KEYS for k in values)     # final/*, test/*: a line of their own
    shown = [(k, v) for k, v in values.items() if (verbose or k in LINE_KEYS) and not k.startswith("progress/")
             and math.isfinite(v)]
    return f"{head} | " + " ".join(f"{k}={v:.4g}" for k, v in shown)


class MetricSink:
    """Where training metrics go (`MetricLogger`, `MemoryMetricLogger`); this base, as `NullMetricLogger`
    (ranks other than 0, or metrics turned off), drops them. A context manager that closes on exit."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> MetricSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


NullMetricLogger = MetricSink


class MetricLogger(MetricSink):
    """Writes each `log(metrics, step)` call as one JSON line, one log line and TensorBoard scalars.

    Keys must carry a namespace, `section/name` (`loss/train`, `ps/pull_ms`, `data/wait_frac`);
    each JSON line is `{"step": int, "time": unix seconds, key: value, ...}` with NaN and inf
    written as null, so every line is strict JSON. The file is flushed after each line, so a
    crashed run keeps what it logged. `path`: the `metrics.jsonl` file, its folder created (truncated,
    or continued with `append`); `tensorboard`: scalars also to `<path's folder>/tensorboard` if
    tensorboard is installed.
    """

    def __init__(self, path: str | Path, *, tensorboard: bool = True, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:   # tensorboard is an optional extra: no scalars, and no noise about it
                logger.debug("tensorboard is not installed; metrics go to %s only", self.path.parent)
            else:
                self._tb = SummaryWriter(log_dir=str(self.path.parent / "tensorboard"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        values: dict[str, float] = {}
        for key, value in metrics.items():
            if "/" not in key:
                raise ValueError(f"metric key {key!r} needs a namespace, e.g. 'loss/{key}'")
            try:
                values[key] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"metric {key!r} must be a number, got {value!r}") from None
        record = {"step": int(step), "time": round(time.time(), 3),
                  **{k: v if math.isfinite(v) else None for k, v in values.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        logger.info("%s", step_line(values, step, verbose=logger.isEnabledFor(logging.DEBUG)))
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        """Flush and close the file (and the TensorBoard writer); calling it again does nothing."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class MemoryMetricLogger(MetricSink):
    """A MetricSink that keeps every line in memory, `{"step": step, **metrics}` in call order
    (in-process runs of benchmarks and tests read them back)."""

    def __init__(self) -> None:
        self.lines: list[dict] = []

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.lines.append({"step": step, **metrics})


__all__ = ["retrieval_metrics", "auc", "logloss", "normalized_entropy", "calibration", "StreamingAUC", "CTRMetrics",
           "eval_metrics", "MetricSink", "MetricLogger", "NullMetricLogger", "MemoryMetricLogger", "EPS"]
