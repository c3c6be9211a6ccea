"""The native fast path (embedding_ps/_native.c via native.py) against the numpy/torch paths it replaces.

Every test runs the same operations twice, once with the native library and once with
`native.set_enabled(False)`, and compares. Also: the fallback when no compiler is found.
"""

import contextlib
import dataclasses
import logging

import numpy as np
import pytest
import torch

from embedding_ps import native
from embedding_ps.config import PSConfig, TableConfig
from embedding_ps.idmap import BoundedCounter, IdMap, _home
from embedding_ps.shard import ShardState

pytestmark = pytest.mark.skipif(not native.available(), reason="native library unavailable (no C compiler?)")


@contextlib.contextmanager
def pure():
    prev = native.set_enabled(False)
    try:
        yield
    finally:
        native.set_enabled(prev)


def colliding_keys(n: int, bits: int = 12) -> np.ndarray:
    cand = np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 1 << 22, dtype=np.int64)
    keys = cand[_home(cand, bits) == (1 << bits) - 1]
    return keys[:n]


# ---------------------------------------------------------------------------- IdMap
def test_map_ops_native_vs_numpy() -> None:
    """Inserts (with growth), lookups (dups, absent), deletes (dups, tombstones, in-place rehash)."""
    rng = np.random.default_rng(0)
    extremes = np.array([0, -1, 1, -(2**63), 2**63 - 1, -(2**63) + 1], dtype=np.int64)
    pool = np.concatenate([extremes, colliding_keys(40), rng.integers(-(2**63), 2**63 - 1, 3000)])
    maps = {True: IdMap(), False: IdMap()}
    for it in range(150):
        batch = np.unique(rng.choice(pool, 200))
        probe = np.concatenate([batch, batch[:7], rng.integers(-(2**63), 2**63 - 1, 20)])
        dels = rng.choice(pool, 80)
        got = {}
        for nat, m in maps.items():
            with contextlib.nullcontext() if nat else pure():
                got[nat] = m.lookup(probe)
                absent = batch[m.lookup(batch) < 0]
                m.insert(absent, (absent & 0x7FFFFFFF).astype(np.int32))
                if it % 3 == 0:
                    got[(nat, "del")] = m.delete(np.concatenate([dels, dels[:4]]))
        np.testing.assert_array_equal(got[True], got[False])
        if (True, "del") in got:
            np.testing.assert_array_equal(got[(True, "del")], got[(False, "del")])
        a, b = maps[True], maps[False]
        assert len(a) == len(b)
        for m in (a, b):  # layouts may differ (which free bucket an insert takes); bookkeeping must not
            assert m._tombs == int(np.count_nonzero(m._vals == -2)) and len(m) == int(np.count_nonzero(m._vals >= 0))
        assert dict(zip(*[x.tolist() for x in a.items()])) == dict(zip(*[x.tolist() for x in b.items()]))


def test_map_built_natively_reads_with_numpy_and_back() -> None:
    """Same layout: a map filled by one path is consistent for the other (save/load, mixed use)."""
    rng = np.random.default_rng(5)
    keys = np.unique(np.concatenate([colliding_keys(60), rng.integers(-(2**63), 2**63 - 1, 5000)]))
    vals = np.arange(keys.shape[0], dtype=np.int32)
    m = IdMap()
    m.insert(keys[:3000], vals[:3000])  # native
    with pure():
        np.testing.assert_array_equal(m.lookup(keys), np.where(np.arange(keys.shape[0]) < 3000, vals, -1))
        m.delete(keys[:100])
        m.insert(keys[3000:], vals[3000:])  # numpy, reusing tombstones
    expect = vals.copy()
    expect[:100] = -1
    np.testing.assert_array_equal(m.lookup(keys), expect)
    m.insert(keys[:100], vals[:100])
    with pure():
        np.testing.assert_array_equal(m.lookup(keys), vals)


def test_bounded_counter_native_vs_numpy() -> None:
    rng = np.random.default_rng(2)
    out = {}
    for nat in (True, False):
        with contextlib.nullcontext() if nat else pure():
            c = BoundedCounter(500)
            res = []
            for step in range(40):
                keys = np.unique(rng.integers(0, 2000, 120))
                res.append(c.add(keys, step))
                if step % 7 == 0:
                    c.remove(keys[:10])
            st = c.state()
            order = np.argsort(st["keys"])
            out[nat] = (res, {k: v[order] for k, v in st.items()}, c.dropped)
        rng = np.random.default_rng(2)
    for a, b in zip(out[True][0], out[False][0]):
        np.testing.assert_array_equal(a, b)
    for k in out[True][1]:
        np.testing.assert_array_equal(out[True][1][k], out[False][1][k])
    assert out[True][2] == out[False][2]


# ---------------------------------------------------------------------------- fallback
def test_fallback_without_compiler(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setattr(native, "_cache_dirs", lambda: [tmp_path])
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setitem(native._state, "loaded", False)
    monkeypatch.setitem(native._state, "lib", None)
    with caplog.at_level(logging.WARNING, logger="embedding_ps.native"):
        assert native.lib() is None
        assert native.lib() is None  # one warning, not one per call
    assert sum("native fast path unavailable" in r.message for r in caplog.records) == 1
    m = IdMap()
    m.insert(np.array([5, -5], dtype=np.int64), np.array([1, 2], dtype=np.int32))
    assert m.lookup(np.array([-5, 5, 6])).tolist() == [2, 1, -1]
    state = ShardState(PSConfig(tables=(TableConfig(name="t", dim=4, init="zeros"),)), 0)
    state.push(0, torch.tensor([1, 1, 2]), torch.ones(3, 4), step=0)
    assert state.pull(0, torch.tensor([1, 2])).shape == (2, 4)


def test_compile_into_fresh_cache_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(native, "_cache_dirs", lambda: [tmp_path / "sub"])
    monkeypatch.setitem(native._state, "loaded", False)
    monkeypatch.setitem(native._state, "lib", None)
    lib = native.lib()
    assert lib is not None and lib.ps_abi_version() == 1
    built = list((tmp_path / "sub").iterdir())
    assert len(built) == 1 and built[0].name.startswith("_native-") and built[0].suffix == ".so"  # no temp left


def test_env_var_disables(monkeypatch) -> None:
    prev = native.set_enabled(False)
    try:
        assert native.lib() is None
    finally:
        native.set_enabled(prev)
