"""Two-tower retrieval model: shapes, normalization, the log-Q estimate and correction against hand
values, the in-batch softmax loss against a plain-torch loop, and the config rules of the arch."""

from __future__ import annotations

import math

import pytest
import torch

from recsys.config import ConfigError, ModelConfig, load_config
from recsys.models import build_dense_model, build_sparse_arch
from recsys.models.two_tower import FrequencyEstimator, TwoTower, in_batch_logits, in_batch_loss

CFG = ModelConfig(arch="two_tower", top_mlp=(16,), tower_dim=8, temperature=0.1, num_freq_buckets=64)


def model(**kw) -> TwoTower:
    torch.manual_seed(0)
    # dense [B, 3]: user reads column 0, item columns 1 and 2; pooled [B, 3, 4]: user 0, 1, item 2
    return TwoTower(CFG if not kw else ModelConfig(**{**_fields(CFG), **kw}), user=([0], [0, 1]),
                    item=([1, 2], [2]), embedding_dim=4)


def _fields(cfg: ModelConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def test_shapes_and_unit_vectors() -> None:
    m = model()
    dense, pooled = torch.rand(5, 3), torch.rand(5, 3, 4)
    u, v = m.user_vectors(dense, pooled), m.item_vectors(dense, pooled)
    assert u.shape == v.shape == (5, 8)
    torch.testing.assert_close(u.norm(dim=1), torch.ones(5))
    torch.testing.assert_close(v.norm(dim=1), torch.ones(5))
    scores = m.eval()(dense, pooled)                                  # eval: the row's own pair
    torch.testing.assert_close(scores, (u * v).sum(1) / 0.1)
    logits = m.train()(dense, pooled, item_ids=torch.arange(5))       # train: in-batch softmax
    assert logits.shape == (5, 5)


def test_towers_read_only_their_columns() -> None:
    m = model()
    dense, pooled = torch.rand(4, 3), torch.rand(4, 3, 4)
    d2, p2 = dense.clone(), pooled.clone()
    d2[:, 1:] += 1.0                                                   # item columns only
    p2[:, 2] += 1.0
    torch.testing.assert_close(m.user_vectors(dense, pooled), m.user_vectors(d2, p2))
    assert not torch.allclose(m.item_vectors(dense, pooled), m.item_vectors(d2, p2))


def test_frequency_estimate_by_hand() -> None:
    est = FrequencyEstimator(num_buckets=10)
    est.update(torch.tensor([7, 7, 9, 17]))          # 17 shares 7's bucket (17 mod 10)
    est.update(torch.tensor([9, 3]))
    # bucket 7: 3 ids, bucket 9: 2, bucket 3: 1; total 6; an unseen bucket counts as one
    expected = torch.tensor([math.log(3 / 6), math.log(2 / 6), math.log(1 / 6), math.log(1 / 6)])
    torch.testing.assert_close(est.log_prob(torch.tensor([7, 9, 3, 5])), expected)


def test_logq_corrected_logits_by_hand() -> None:
    u = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    v = torch.tensor([[0.6, 0.8], [1.0, 0.0], [0.0, 1.0]])
    log_q = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    got = in_batch_logits(u, v, log_q, temperature=0.5)
    # <u_i, v_j> / 0.5 - log q_j
    expected = torch.tensor([[1.2 - math.log(0.5), 2.0 - math.log(0.25), 0.0 - math.log(0.25)],
                             [1.6 - math.log(0.5), 0.0 - math.log(0.25), 2.0 - math.log(0.25)]])
    torch.testing.assert_close(got, expected)
    # this rank's block starts at column 1: rolled so that row i's positive is column i
    rolled = in_batch_logits(u, v, log_q, temperature=0.5, first=1)
    torch.testing.assert_close(rolled, expected[:, [1, 2, 0]])


def test_in_batch_loss_equals_a_plain_torch_loop() -> None:
    torch.manual_seed(3)
    m = model()
    dense, pooled, ids = torch.rand(6, 3), torch.rand(6, 3, 4), torch.tensor([1, 2, 2, 5, 9, 1])
    m.train()
    logits = m(dense, pooled, item_ids=ids)
    loss = in_batch_loss(logits)
    u, v = m.user_vectors(dense, pooled), m.item_vectors(dense, pooled)
    counts = {int(i): int((ids == i).sum()) for i in ids}                # the estimator saw this batch
    ref = 0.0
    for i in range(6):
        row = torch.stack([u[i] @ v[j] / 0.1 - math.log(counts[int(ids[j])] / 6) for j in range(6)])
        ref = ref - torch.log_softmax(row, 0)[i] / 6
    torch.testing.assert_close(loss, ref)
    loss.backward()                                                      # gradients reach both towers
    assert all(p.grad is not None for p in m.parameters())


def test_no_logq_is_the_plain_in_batch_softmax() -> None:
    m = model(logq_correction=False)
    dense, pooled = torch.rand(4, 3), torch.rand(4, 3, 4)
    logits = m.train()(dense, pooled, item_ids=torch.tensor([1, 1, 1, 2]))
    u, v = m.user_vectors(dense, pooled), m.item_vectors(dense, pooled)
    torch.testing.assert_close(logits, u @ v.t() / 0.1)


def test_eval_mode_does_not_count() -> None:
    m = model().eval()
    m(torch.rand(3, 3), torch.rand(3, 3, 4), item_ids=torch.arange(3))
    assert float(m.freq.total) == 0.0


SETS = ["model.arch='two_tower'", "data.sparse_columns=['user_id', 'item_id', 'item_cat']",
        "data.dense_columns=['age']", "model.user_features=['user_id', 'age']",
        "model.item_features=['item_id', 'item_cat']", "ps.table_defaults.dim=4"]


def test_built_from_a_job_config() -> None:
    cfg = load_config(None, SETS)
    m = build_dense_model(cfg, build_sparse_arch(cfg))
    assert isinstance(m, TwoTower)
    assert (m.user_dense, m.user_sparse, m.item_dense, m.item_sparse) == ([0], [0], [], [1, 2])


@pytest.mark.parametrize("override, match", [
    ("model.user_features=['user_id', 'nope']", r"model.user_features: 'nope' is not in data"),
    ("model.item_features=['item_id', 'user_id', 'item_cat']", r"share \['user_id'\]"),
    ("model.item_features=['item_id']", r"\['item_cat'\] are in neither"),
    ("model.item_id_feature='item_cat2'", r"model.item_id_feature = 'item_cat2'"),
    ("model.user_id_feature='age'", r"model.user_id_feature = 'age'"),
    ("model.user_features=['age']", r"model.user_features needs at least one sparse column"),
    ("model.tower_dim=0", r"model.tower_dim must be >= 1, got 0"),
    ("model.temperature=0.0", r"model.temperature must be > 0"),
    ("model.num_freq_buckets=0", r"model.num_freq_buckets must be >= 1"),
    ("train.num_trainers=2", r"needs data.drop_last = true"),
    ("data.eval_paths=['x.parquet']", r"set data.item_paths"),
    ("eval.recall_k=[10, 0]", r"eval.recall_k must be a non-empty list of K >= 1"),
])
def test_config_rules_name_the_key(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, [*SETS, override])


def test_tower_features_only_for_two_tower() -> None:
    with pytest.raises(ConfigError, match="model.user_features is only used by model.arch = 'two_tower'"):
        load_config(None, ["model.user_features=['a']"])
