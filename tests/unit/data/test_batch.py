"""KeyedJagged / Batch: offsets, per-key views, device moves, validate_batch, torchrec bridge."""

import dataclasses
import sys

import numpy as np
import pytest
import torch

from data.batch import Batch, Jagged, KeyedJagged, validate_batch


def kj_example() -> KeyedJagged:
    """The docstring example: F = 2 (C1, M1), B = 3; C1 = [7] [] [9], M1 = [1, 2] [3] []."""
    return KeyedJagged(("C1", "M1"), torch.tensor([7, 9, 1, 2, 3]),
                       torch.tensor([1, 0, 1, 2, 1, 0], dtype=torch.int32))


def batch_example(**kw) -> Batch:
    base = dict(dense=torch.arange(6, dtype=torch.float32).view(3, 2), sparse=kj_example(),
                labels=torch.tensor([0.0, 1.0, 0.0]), weights=torch.tensor([0.5, 1, 1, 2, 3]),
                extras={"row_id": np.array([10, 11, 12])})
    base.update(kw)
    return Batch(**base)


def test_offsets_stride_and_length_per_key():
    kj = kj_example()
    assert kj.offsets().tolist() == [0, 1, 1, 2, 4, 5, 5]
    assert kj.offsets().dtype == torch.int64
    assert kj.stride == 3
    assert kj.length_per_key().tolist() == [2, 3]


def test_getitem_returns_each_features_ids():
    kj = kj_example()
    c1, m1 = kj["C1"], kj["M1"]
    assert isinstance(c1, Jagged)
    assert c1.values.tolist() == [7, 9] and c1.lengths.tolist() == [1, 0, 1]
    assert m1.values.tolist() == [1, 2, 3] and m1.lengths.tolist() == [2, 1, 0]
    assert m1.offsets().tolist() == [0, 2, 3, 3]
    with pytest.raises(KeyError, match="'X' is not in this KeyedJagged; keys: \\['C1', 'M1'\\]"):
        kj["X"]


def test_getitem_matches_dense_reference():
    """Random lengths: per-key views against a loop over (feature, example)."""
    g = torch.Generator().manual_seed(0)
    F, B = 4, 9
    lengths = torch.randint(0, 4, (F * B,), generator=g, dtype=torch.int32)
    values = torch.randint(0, 100, (int(lengths.sum()),), generator=g)
    kj = KeyedJagged(tuple(f"f{i}" for i in range(F)), values, lengths)
    pos = 0
    for f in range(F):
        j = kj[f"f{f}"]
        off = j.offsets().tolist()
        for b in range(B):
            n = int(lengths[f * B + b])
            assert j.values[off[b]:off[b + 1]].tolist() == values[pos:pos + n].tolist()
            pos += n


def test_frozen_and_slots():
    kj = kj_example()
    with pytest.raises(dataclasses.FrozenInstanceError):
        kj.keys = ("x",)
    assert not hasattr(kj, "__dict__")
    assert not hasattr(batch_example(), "__dict__")


def test_to_moves_every_tensor_and_keeps_extras():
    b = batch_example()
    moved = b.to("meta")
    for t in (moved.dense, moved.labels, moved.weights, moved.sparse.values, moved.sparse.lengths):
        assert t.device.type == "meta"
    assert moved.extras is b.extras
    assert moved.sparse.keys == b.sparse.keys
    back = b.to(torch.device("cpu"))
    assert torch.equal(back.sparse.values, b.sparse.values)
    assert b.batch_size == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory needs CUDA")
def test_pin_memory():
    pinned = batch_example().pin_memory()
    assert pinned.dense.is_pinned() and pinned.sparse.values.is_pinned()


def test_validate_batch_accepts_a_good_batch():
    validate_batch(batch_example())
    validate_batch(batch_example(weights=None, extras={}))


@pytest.mark.parametrize("change, message", [
    (dict(labels=torch.tensor([0.0, 1.0])), "dense has 3 rows, labels has B = 2"),
    (dict(labels=torch.tensor([0, 1, 0])), "labels must be torch.float32, got torch.int64"),
    (dict(dense=torch.zeros(3, 2, dtype=torch.float64)), "dense must be torch.float32"),
    (dict(dense=torch.zeros(6)), "dense must have 2 dims, got shape \\[6\\]"),
    (dict(dense=torch.tensor([[0.0, 1], [float("nan"), 0], [0, 0]])), "dense\\[1, 0\\] = nan is not finite"),
    (dict(labels=torch.tensor([0.0, float("inf"), 0])), "labels\\[1\\] = inf is not finite"),
    (dict(weights=torch.ones(4)), "weights has 4 entries, sparse.values has 5"),
    (dict(weights=torch.ones(5, dtype=torch.float64)), "weights must be torch.float32"),
    (dict(extras={"row_id": np.arange(2)}), "extras\\['row_id'\\] has 2 rows, labels has B = 3"),
    (dict(sparse=KeyedJagged(("C1", "M1"), torch.tensor([7, 9, 1, 2]),
                             torch.tensor([1, 0, 1, 2, 1, 0], dtype=torch.int32))),
     "sum\\(sparse.lengths\\) = 5 != sparse.values.numel\\(\\) = 4"),
    (dict(sparse=KeyedJagged(("C1", "M1"), torch.tensor([7, 9, 1, 2, 3]),
                             torch.tensor([1, 0, 1, 2, 1], dtype=torch.int32))),
     "sparse.lengths has 5 entries, not a multiple of F = 2"),
    (dict(sparse=KeyedJagged(("C1", "M1"), torch.tensor([7, 9, 1, 2, 3, 4, 5, 6]),
                             torch.tensor([1, 0, 1, 2, 1, 0, 1, 2], dtype=torch.int32))),
     "sparse.lengths has 8 entries, expected F \\* B = 2 \\* 3"),
    (dict(sparse=KeyedJagged(("C1", "M1"), torch.tensor([7, 9, 1, 2, 3]),
                             torch.tensor([1, 0, 1, 2, 1, 0]))), "sparse.lengths must be torch.int32"),
    (dict(sparse=KeyedJagged(("C1", "M1"), torch.tensor([7, 9, 1, -2, 3]),
                             torch.tensor([1, 0, 1, 2, 1, 0], dtype=torch.int32))),
     "sparse.values\\[3\\] = -2 is a negative id"),
    (dict(sparse=KeyedJagged(("C1", "M1"), torch.tensor([7, 9, 1, 2, 3]),
                             torch.tensor([1, 0, 1, 3, -1, 0], dtype=torch.int32))),
     "sparse.lengths\\[4\\] = -1 is negative \\(feature 'M1'\\)"),
    (dict(sparse=KeyedJagged(("C1", "C1"), torch.tensor([7, 9, 1, 2, 3]),
                             torch.tensor([1, 0, 1, 2, 1, 0], dtype=torch.int32))), "duplicates"),
])
def test_validate_batch_errors_carry_the_numbers(change, message):
    with pytest.raises(ValueError, match=message):
        validate_batch(batch_example(**change))


def test_torchrec_bridge_says_what_is_missing(monkeypatch):
    """Without torchrec (simulated: a None entry in sys.modules makes the import fail)."""
    for name in ("torchrec", "torchrec.sparse", "torchrec.sparse.jagged_tensor"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="need torchrec, which is not installed"):
        kj_example().to_torchrec()
    with pytest.raises(ImportError, match="need torchrec"):
        KeyedJagged.from_torchrec(object())


def test_torchrec_round_trip():
    pytest.importorskip("torchrec")
    kj = kj_example()
    kjt = kj.to_torchrec()
    assert kjt.keys() == ["C1", "M1"]
    assert kjt["M1"].values().tolist() == [1, 2, 3]
    assert torch.equal(kjt.offsets(), kj.offsets())
    back = KeyedJagged.from_torchrec(kjt)
    assert back.keys == kj.keys and torch.equal(back.values, kj.values) and torch.equal(back.lengths, kj.lengths)
    weighted = kj.to_torchrec(weights=torch.tensor([0.5, 1, 1, 2, 3]))
    assert weighted.weights().tolist() == [0.5, 1, 1, 2, 3]
