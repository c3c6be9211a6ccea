"""Metrics against brute force and hand computation; the streaming accumulators; the metric logger."""

import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from recsys.metrics import (
    EPS,
    CTRMetrics,
    MetricLogger,
    NullMetricLogger,
    StreamingAUC,
    auc,
    calibration,
    logloss,
    normalized_entropy,
)


def brute_force_auc(labels, scores) -> float:
    """Every positive-negative pair: 1 if the positive scores higher, 1/2 on a tie."""
    pos = [s for y, s in zip(labels.tolist(), scores.tolist()) if y == 1]
    neg = [s for y, s in zip(labels.tolist(), scores.tolist()) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def random_data(seed: int, n: int, levels: int | None = 10):
    """Labels {0, 1} and scores in [0, 1]; with `levels`, scores are multiples of 1/levels (many ties)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, generator=g, dtype=torch.float64)
    if levels is not None:
        scores = torch.round(scores * levels) / levels
    labels = (torch.rand(n, generator=g, dtype=torch.float64) < 0.3 + 0.4 * scores).double()
    return labels, scores


# -- exact AUC ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("levels", [3, 10, None])
def test_auc_matches_brute_force_with_ties(seed, levels):
    labels, scores = random_data(seed, 60, levels)
    assert auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores), abs=1e-12)


def test_auc_hand_computed():
    # Positives 0.35, 0.8 against negatives 0.1, 0.4: 0.35 loses to 0.4 only -> 3 of 4 pairs.
    assert auc(torch.tensor([0, 0, 1, 1]), torch.tensor([0.1, 0.4, 0.35, 0.8])) == pytest.approx(0.75)
    # A tie counts half: pairs (0.5 vs 0.5) = 1/2, (0.5 vs 0.2) = 1, (0.9 vs both) = 2 -> 3.5 / 4.
    assert auc(np.array([0, 1, 0, 1]), np.array([0.5, 0.5, 0.2, 0.9])) == pytest.approx(0.875)


def test_auc_does_not_need_probabilities():
    labels, scores = random_data(0, 50, levels=None)
    assert auc(labels, scores * 7 - 3) == pytest.approx(auc(labels, scores), abs=1e-12)


@pytest.mark.parametrize("label", [0.0, 1.0])
def test_auc_with_one_label_is_nan(label):
    labels, scores = torch.full((5,), label), torch.rand(5)
    assert math.isnan(auc(labels, scores))
    m = StreamingAUC(10)
    m.update(labels, scores)
    assert math.isnan(m.compute())


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        auc(torch.tensor([0.0, 0.5]), torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="differ in length: 2 vs 3"):
        logloss(torch.tensor([0.0, 1.0]), torch.tensor([0.1, 0.2, 0.3]))
    with pytest.raises(ValueError, match="no examples"):
        calibration(torch.tensor([]), torch.tensor([]))


# -- streaming AUC --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_streaming_auc_within_its_bucket_bound(seed):
    labels, scores = random_data(seed, 2000, levels=None)
    K = 100
    m = StreamingAUC(K)
    for i in range(0, 2000, 300):                                  # several batches
        m.update(labels[i:i + 300], scores[i:i + 300])
    exact = auc(labels, scores)
    assert abs(m.compute() - exact) <= m.error_bound()
    # Spread scores put ~1/K of the pairs in a shared bucket, each misjudged by 1/2 at most.
    assert m.error_bound() < 1.0 / K


def test_streaming_auc_is_exact_when_buckets_hold_one_distinct_score():
    labels, scores = random_data(1, 500, levels=10)               # 11 distinct values, 100 buckets apart
    m = StreamingAUC(1000)
    m.update(labels, scores)
    assert m.compute() == pytest.approx(auc(labels, scores), abs=1e-12)


def test_streaming_auc_bound_is_attained():
    m = StreamingAUC(1)                                           # one bucket: everything ties
    m.update(torch.tensor([1, 0]), torch.tensor([0.9, 0.1]))
    assert m.compute() == 0.5 and m.error_bound() == 0.5           # the exact AUC is 1


def test_streaming_auc_merge_equals_one_pass_and_checks_inputs():
    labels, scores = random_data(2, 300, levels=None)
    one, a, b = StreamingAUC(50), StreamingAUC(50), StreamingAUC(50)
    one.update(labels, scores)
    a.update(labels[:100], scores[:100])
    b.update(labels[100:], scores[100:])
    torch.testing.assert_close(a.merge(b).hist, one.hist, rtol=0, atol=0)
    with pytest.raises(ValueError, match="10 buckets into 50"):
        a.merge(StreamingAUC(10))
    with pytest.raises(ValueError, match="scores in \\[0, 1\\]"):
        a.update(torch.tensor([1.0]), torch.tensor([1.5]))
    a.update(torch.tensor([1.0]), torch.tensor([1.0]))           # 1.0 lands in the last bucket
    assert a.hist[1, -1] >= 1


# -- logloss, NE, calibration ---------------------------------------------------------------------


def test_logloss_ne_calibration_by_hand():
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    scores = torch.tensor([0.5, 0.25, 0.25, 0.5], dtype=torch.float64)
    ll = -(math.log(0.5) + math.log(0.75) + math.log(0.75) + math.log(0.5)) / 4
    p = 0.25
    h = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert logloss(labels, scores) == pytest.approx(ll, rel=1e-12)
    assert normalized_entropy(labels, scores) == pytest.approx(ll / h, rel=1e-12)
    assert calibration(labels, scores) == pytest.approx(0.375 / 0.25)


def test_predicting_the_base_rate_gives_ne_one():
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0])
    assert normalized_entropy(labels, torch.full((5,), 0.4)) == pytest.approx(1.0)


def test_logloss_clamps_confident_misses_and_ne_calibration_nan_cases():
    assert logloss(torch.tensor([1.0]), torch.tensor([0.0])) == pytest.approx(-math.log(EPS))
    assert math.isnan(normalized_entropy(torch.ones(3), torch.full((3,), 0.9)))
    assert math.isnan(calibration(torch.zeros(3), torch.full((3,), 0.1)))


# -- CTRMetrics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("exact", [True, False])
def test_ctr_metrics_match_the_functions(exact):
    labels, scores = random_data(3, 400, levels=None)
    m = CTRMetrics(num_buckets=1000, exact_auc=exact)
    for i in range(0, 400, 128):
        m.update(labels[i:i + 128], scores[i:i + 128])
    got = m.reduced().compute()                                   # not distributed: a plain copy
    assert set(got) == {"auc", "logloss", "ne", "calibration", "count"}
    assert got["count"] == 400
    assert got["logloss"] == pytest.approx(logloss(labels, scores), rel=1e-12)
    assert got["ne"] == pytest.approx(normalized_entropy(labels, scores), rel=1e-12)
    assert got["calibration"] == pytest.approx(calibration(labels, scores), rel=1e-12)
    tol = 1e-12 if exact else m.streaming_auc.error_bound()
    assert got["auc"] == pytest.approx(auc(labels, scores), abs=tol)


def test_ctr_metrics_merge_and_reset():
    labels, scores = random_data(4, 200, levels=None)
    whole, a, b = CTRMetrics(exact_auc=True), CTRMetrics(exact_auc=True), CTRMetrics(exact_auc=True)
    whole.update(labels, scores)
    a.update(labels[:70], scores[:70])
    b.update(labels[70:], scores[70:])
    assert a.merge(b).compute() == pytest.approx(whole.compute(), rel=1e-12)
    a.reset()
    with pytest.raises(ValueError, match="no examples were added"):
        a.compute()


RANK_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from recsys.metrics import CTRMetrics
    rank, store_path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(250, generator=g, dtype=torch.float64)
    labels = (torch.rand(250, generator=g, dtype=torch.float64) < scores).double()
    part = slice(0, 100) if rank == 0 else slice(100, 250)    # unequal parts: gather must unpad
    result = {}
    for exact in (True, False):
        m = CTRMetrics(num_buckets=64, exact_auc=exact)
        m.update(labels[part], scores[part])
        result[str(exact)] = m.reduced().compute()
    from recsys.dist import all_gather_parts
    from recsys.training.checkpoint import gather_json      # the checkpoint's loader states travel so
    result["json"] = gather_json({"rank": rank, "text": "\u00e9" * (3 + 50 * rank)}, 2)
    result["parts"] = [p.tolist() for p in all_gather_parts(torch.arange(3 * rank, dtype=torch.int64))]
    dist.destroy_process_group()
    json.dump(result, open(out, "w"))
""")


@pytest.mark.integration
def test_ctr_metrics_and_gathers_across_two_gloo_ranks(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(tmp_path / "store"),
                               str(tmp_path / f"rank{r}.json")]) for r in range(2)]
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(250, generator=g, dtype=torch.float64)
    labels = (torch.rand(250, generator=g, dtype=torch.float64) < scores).double()
    for r in range(2):
        result = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert result["json"] == [{"rank": 0, "text": "\u00e9" * 3}, {"rank": 1, "text": "\u00e9" * 53}]
        assert result["parts"] == [[], [0, 1, 2]]                # an empty part, unequal lengths
        for exact in (True, False):
            single = CTRMetrics(num_buckets=64, exact_auc=exact)
            single.update(labels, scores)
            assert result[str(exact)] == pytest.approx(single.compute(), rel=1e-12)


# -- MetricLogger ---------------------------------------------------------------------------------


def test_metric_logger_writes_json_lines(tmp_path, caplog):
    path = tmp_path / "run" / "metrics.jsonl"
    with caplog.at_level("INFO", logger="recsys.metrics"), MetricLogger(path) as ml:
        ml.log({"loss/train": 0.5, "ps/pull_ms": torch.tensor(3.0)}, step=10)
        ml.log({"auc/eval": float("nan"), "data/wait_frac": 1}, step=20)
    rows = [json.loads(line) for line in path.read_text().splitlines()]   # strict: NaN is null
    assert [r["step"] for r in rows] == [10, 20]
    assert rows[0]["loss/train"] == 0.5 and rows[0]["ps/pull_ms"] == 3.0
    assert rows[1]["auc/eval"] is None and rows[1]["data/wait_frac"] == 1.0
    assert all(isinstance(r["time"], float) for r in rows)
    assert "step 10 | loss/train=0.5 ps/pull_ms=3" in caplog.text
    assert not (tmp_path / "run" / "tensorboard").exists() or _has_tensorboard()


def _has_tensorboard() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def test_metric_logger_rejects_bad_keys_and_values(tmp_path):
    with MetricLogger(tmp_path / "m.jsonl", tensorboard=False) as ml:
        with pytest.raises(ValueError, match="needs a namespace"):
            ml.log({"loss": 1.0}, step=0)
        with pytest.raises(TypeError, match="must be a number"):
            ml.log({"loss/train": "high"}, step=0)
    assert (tmp_path / "m.jsonl").read_text() == ""


def test_null_metric_logger_does_nothing(tmp_path):
    with NullMetricLogger() as ml:
        ml.log({"loss/train": 1.0}, step=0)
    assert list(tmp_path.iterdir()) == []


def test_eval_metrics_exact_and_streaming() -> None:
    from recsys.metrics import eval_metrics

    g = torch.Generator().manual_seed(0)
    p = torch.rand(5000, generator=g)
    labels = (torch.rand(5000, generator=g) < p).float()
    scores = (p + 0.3 * torch.rand(5000, generator=g)).clamp(0, 1)
    exact = eval_metrics(labels, scores, p)
    assert exact["auc"] == pytest.approx(auc(labels, scores), abs=1e-12)
    assert exact["oracle_auc"] == pytest.approx(auc(labels, p), abs=1e-12)
    assert exact["eval_examples"] == 5000 and exact["logloss"] == pytest.approx(logloss(labels, scores))
    streaming = eval_metrics(labels, scores, p, exact_auc=False)
    assert streaming["auc"] == pytest.approx(exact["auc"], abs=1e-3)
    assert streaming["oracle_auc"] == pytest.approx(exact["oracle_auc"], abs=1e-3)


def test_the_step_line_shows_progress_and_at_most_the_line_keys(caplog) -> None:
    """#30 item 4: `epoch e/E step s/S eta H:MM:SS | ` then at most the 8 LINE_KEYS (no NaN ones);
    --verbose (DEBUG) shows every metric; metrics.jsonl keeps them all."""
    from recsys.metrics import LINE_KEYS, step_line

    values = {"progress/epoch": 1.0, "progress/epochs": 2.0, "progress/total_steps": 120.0, "progress/eta_s": 70.4,
              "loss/train": 0.4512, "auc/train": float("nan"), "perf/samples_per_s": 41234.0, "ps/push_ms": 3.0,
              "time/ps_wait_ms": 0.5, "data/wait_frac": 0.01}
    line = step_line(values, 40)
    assert line == "epoch 1/2 step 40/120 eta 0:01:10 | loss/train=0.4512 perf/samples_per_s=4.123e+04 data/wait_frac=0.01"
    assert len(LINE_KEYS) <= 8
    assert "ps/push_ms=3" in step_line(values, 40, verbose=True) and "nan" not in step_line(values, 40, verbose=True)
    assert step_line({"loss/train": 1.0}, 3) == "step 3 | loss/train=1"
    assert step_line({"final/steps": 7.0, "final/auc": 0.5}, 7) == "step 7 | final/steps=7 final/auc=0.5"
