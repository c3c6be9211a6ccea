"""The native fast path (embedding_ps/csrc via native.py) against the numpy/torch paths it replaces.

Every test runs the same operations twice, once with the native library and once with
`native.set_enabled(False)`, and compares. Also: the fallback when no compiler is found.
"""

import contextlib
import os
import subprocess
import sys
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from embedding_ps import native, native_build, reference
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.idmap import BoundedCounter, IdMap
from embedding_ps.reference import home as _home
from embedding_ps.shard.state import ShardState
from tests.init_reference import init_row_reference

needs_native = pytest.mark.skipif(not native.available(), reason="native library off or unavailable (no C compiler?)")


@contextlib.contextmanager
def pure():
    prev = native.set_enabled(False)
    try:
        yield
    finally:
        native.set_enabled(prev)


def colliding_keys(n: int, bits: int = 12) -> np.ndarray:
    cand = np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 1 << 22, dtype=np.int64)
    keys = cand[_home(cand, 1 << bits) == (1 << bits) - 1]
    return keys[:n]


# ---------------------------------------------------------------------------- IdMap
@needs_native
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


@needs_native
def test_reserved_high_load_map_native_vs_numpy() -> None:
    """A map reserved to a non-power-of-two size at load 0.9: the C probes (wrap at the last bucket,
    tombstones) agree with numpy's, both ways."""
    rng = np.random.default_rng(8)
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, 9000))[:9000]
    maps = {True: IdMap(max_load=0.9), False: IdMap(max_load=0.9)}
    for nat, m in maps.items():
        m.reserve(9000)
        assert m.num_buckets == 10_048
        with contextlib.nullcontext() if nat else pure():
            m.insert(keys[:8000], np.arange(8000, dtype=np.int32))
            m.delete(keys[:3000:3])
            m.insert(keys[8000:], np.arange(8000, 9000, dtype=np.int32))
    probe = np.concatenate([keys, rng.integers(-(2**63), 2**63 - 1, 500)])
    expect = np.concatenate([np.arange(9000), np.full(500, -1)]).astype(np.int32)
    expect[:3000:3] = -1
    for m in maps.values():
        assert m.num_buckets == 10_048
        np.testing.assert_array_equal(m.lookup(probe), expect)
        with pure():
            np.testing.assert_array_equal(m.lookup(probe), expect)


@needs_native
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


@needs_native
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
    monkeypatch.setattr(native_build, "_cache_dirs", lambda: [tmp_path])
    monkeypatch.setattr(native_build, "_compiler", lambda: None)
    monkeypatch.setitem(native._state, "enabled", True)
    monkeypatch.setitem(native._state, "loaded", False)
    monkeypatch.setitem(native._state, "lib", None)
    with caplog.at_level(logging.WARNING, logger="embedding_ps.native"):
        assert native.lib() is None
        assert native.lib() is None  # one warning, not one per call
    assert sum("native library unavailable" in r.message for r in caplog.records) == 1
    m = IdMap()
    m.insert(np.array([5, -5], dtype=np.int64), np.array([1, 2], dtype=np.int32))
    assert m.lookup(np.array([-5, 5, 6])).tolist() == [2, 1, -1]
    state = ShardState(PSConfig(tables=(TableConfig(name="t", dim=4, init="zeros"),)), 0)
    state.push(0, torch.tensor([1, 1, 2]), torch.ones(3, 4), step=0)
    assert state.pull(0, torch.tensor([1, 2])).shape == (2, 4)


@pytest.mark.skipif(native_build._compiler() is None, reason="no C compiler")
def test_compile_into_fresh_cache_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(native_build, "_cache_dirs", lambda: [tmp_path / "sub"])
    monkeypatch.setitem(native._state, "enabled", True)
    monkeypatch.setitem(native._state, "loaded", False)
    monkeypatch.setitem(native._state, "lib", None)
    lib = native.lib()
    assert lib is not None and lib.ps_abi_version() == native_build.ABI
    built = list((tmp_path / "sub").iterdir())
    assert len(built) == 1 and built[0].name.startswith("_native-") and built[0].suffix == ".so"  # no temp left


def test_env_var_disables(monkeypatch) -> None:
    prev = native.set_enabled(False)
    try:
        assert native.lib() is None
    finally:
        native.set_enabled(prev)


# ---------------------------------------------------------------------------- push / pull
def run_table(cfg: TableConfig, use_native: bool, steps: int = 12):
    """A fixed sequence of pushes (duplicates, new ids -> growth, evictions) and pulls; returns what it saw."""
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(7)
    pulls = []
    with contextlib.nullcontext() if use_native else pure():
        state = ShardState(PSConfig(tables=(cfg,)), 0)
        for step in range(steps):
            ids = torch.from_numpy(rng.integers(-400, 400, 700).astype(np.int64))  # many duplicates
            if step % 4 == 3:
                ids = torch.unique(ids)  # and pushes without any
            grads = torch.randn(ids.shape[0], cfg.dim, generator=gen) * (10.0 if step % 5 == 0 else 0.1)
            state.push(0, ids, grads, step=step)
            if step % 6 == 5:
                state.sweep(step)
            pulls.append(state.pull(0, torch.from_numpy(rng.integers(-500, 500, 300).astype(np.int64))))
        return pulls, state.dump_table(0), state.stats()


NATIVE_OPTS = ["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"]


@needs_native
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("optimizer", NATIVE_OPTS)
@pytest.mark.parametrize("extra", [{}, {"max_rows": 300, "ttl_steps": 4}, {"min_count": 2, "unadmitted": "zeros"}])
def test_push_pull_native_vs_torch(optimizer: str, dtype: str, extra: dict) -> None:
    cfg = TableConfig(name="t", dim=20, optimizer=optimizer, dtype=dtype, lr=0.05, init_scale=0.5, kernel="native",
                      **extra)  # kernel pinned: without the C library, "auto" may pick fbgemm
    a, b = run_table(cfg, True), run_table(cfg, False)
    # sgd follows torch op by op: bit-exact. adagrad: torch's vectorized addcmul_ may be contracted to
    # an FMA (its AVX2/AVX512 kernels), ours is not (no -march): ~1 ulp. rowwise_adagrad's mean(g*g) is
    # reduced in another order: ~1 ulp.
    tol = dict(atol=1e-6, rtol=1e-6) if optimizer in ("adagrad", "rowwise_adagrad") else dict(atol=0.0, rtol=0.0)
    if dtype == "fp16" and optimizer in ("adagrad", "rowwise_adagrad"):
        tol = dict(atol=1e-3, rtol=1e-3)  # a ~1 ulp fp32 difference can flip one fp16 rounding
    for x, y in zip(a[0], b[0]):
        torch.testing.assert_close(x, y, **tol)
    ka, ra, sa = a[1]
    kb, rb, sb = b[1]
    torch.testing.assert_close(ka, kb, atol=0, rtol=0)
    torch.testing.assert_close(ra, rb, **tol)
    assert sa.keys() == sb.keys()
    for name in sa:
        t = tol if sa[name].is_floating_point() else dict(atol=0, rtol=0)
        torch.testing.assert_close(sa[name], sb[name], **t)
    assert a[2] == b[2]


@needs_native
def test_rowwise_adagrad_fp32_close_on_large_dims() -> None:
    cfg = TableConfig(name="t", dim=129, optimizer="rowwise_adagrad", lr=0.3, kernel="native")
    a, b = run_table(cfg, True, steps=6), run_table(cfg, False, steps=6)
    torch.testing.assert_close(a[1][1], b[1][1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a[1][2]["sum_sq"], b[1][2]["sum_sq"], atol=1e-6, rtol=1e-6)


@needs_native
def test_native_update_is_used_and_counts_saturate() -> None:
    """The native push really runs (no silent fallback), and the count saturates like the numpy path."""
    cfg = TableConfig(name="t", dim=4, optimizer="sgd", init="zeros", kernel="native")
    for use_native in (True, False):
        with contextlib.nullcontext() if use_native else pure():
            state = ShardState(PSConfig(tables=(cfg,)), 0)
            t = state.tables[0]
            state.push(0, torch.tensor([1, 2]), torch.ones(2, 4), step=0)
            t.meta[0] = ((2**31 - 1) << 32) | 0
            state.push(0, torch.tensor([1, 2, 2]), torch.ones(3, 4), step=5)
            assert (t.meta[0] >> 32).item() == 2**31 - 1 and (t.meta[0] & 0xFFFFFFFF).item() == 5
            assert (t.meta[1] >> 32).item() == 2 and (t.meta[1] & 0xFFFFFFFF).item() == 5
            assert t._dupbits.shape[0] == (t.cap + 7) // 8
            assert not t._dupbits.any()
    w = torch.zeros(3, 4)
    assert native.update("sgd", w, None, np.array([2], dtype=np.int32), torch.ones(1, 4), 0.5, 1e-8, None, 0)
    assert w[2].tolist() == [-0.5] * 4 and w[:2].abs().sum() == 0
    with pytest.raises(TypeError):
        native.update("sgd", w, None, np.array([2], dtype=np.int64), torch.ones(1, 4), 0.5, 1e-8, None, 0)


@needs_native
def test_fp16_conversions_match_torch() -> None:
    lib = native.lib()
    rng = np.random.default_rng(3)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.99, 65520.0, 1e9, 2.0**-24, 2.0**-25,
                        2.0**-25 * 1.0000001, 3 * 2.0**-25, 2.0**-14, 2.0**-14 * 0.99999, 5.96e-8, 1.0 + 2.0**-11,
                        1.0 + 3 * 2.0**-11], dtype=np.float32)
    scaled = (rng.standard_normal(100000) * 10.0 ** rng.integers(-9, 5, 100000)).astype(np.float32)
    raw = rng.integers(0, 2**32, 100000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([special, -special, scaled, raw])
    x = x[~np.isnan(x)]
    h = np.empty(x.shape[0], dtype=np.uint16)
    lib.ps_f2h_array(x.ctypes.data, h.ctypes.data, x.shape[0])
    np.testing.assert_array_equal(h, torch.from_numpy(x).half().numpy().view(np.uint16))
    back = np.empty(x.shape[0], dtype=np.float32)
    lib.ps_h2f_array(h.ctypes.data, back.ctypes.data, h.shape[0])
    np.testing.assert_array_equal(back, torch.from_numpy(h.view(np.float16)).float().numpy())
    allh = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    allh = allh[~np.isnan(allh.view(np.float16))]
    f = np.empty(allh.shape[0], dtype=np.float32)
    lib.ps_h2f_array(allh.ctypes.data, f.ctypes.data, allh.shape[0])
    np.testing.assert_array_equal(f, allh.view(np.float16).astype(np.float32))


@needs_native
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("decay", ["none", "l2", "decoupled"])
def test_sorted_update_matches_arrival_order_and_torch(optimizer: str, dtype: str, decay: str) -> None:
    """ps_update sorts >= 2048 rows by slot before updating: the same bits as arrival order (1 and 2
    threads), and the rows of optim.apply_update (the torch path)."""
    from embedding_ps.shard.optim import apply_update

    cfg = TableConfig(name="t", dim=24, optimizer=optimizer, dtype=dtype, lr=0.05, kernel="native",
                      weight_decay=0.0 if decay == "none" else 0.3,
                      weight_decay_mode="l2" if decay == "none" else decay)
    rows, n = 20_000, 5000
    gen = torch.Generator().manual_seed(3)
    w0 = (torch.randn(rows, cfg.dim, generator=gen) * 0.5).to(torch.float16 if dtype == "fp16" else torch.float32)
    s0 = {"sgd": None, "adagrad": torch.rand(rows, cfg.dim, generator=gen),
          "rowwise_adagrad": torch.rand(rows, generator=gen)}[optimizer]
    slots = torch.randperm(rows, generator=gen)[:n].to(torch.int32).numpy()      # unique, arrival order random
    grads = torch.randn(n, cfg.dim, generator=gen)
    seen = []
    for sort, threads in ((False, 1), (True, 1), (True, 2)):
        w, st, meta = w0.clone(), None if s0 is None else s0.clone(), torch.zeros(rows, dtype=torch.int64)
        assert native.update(optimizer, w, st, slots, grads, cfg.lr, cfg.eps, meta, 7, cfg.weight_decay,
                             cfg.weight_decay_mode, threads=threads, sort=sort)
        seen.append((w, st, meta))
    for w, st, meta in seen[1:]:
        torch.testing.assert_close(w, seen[0][0], atol=0, rtol=0)
        if st is not None:
            torch.testing.assert_close(st, seen[0][1], atol=0, rtol=0)
        torch.testing.assert_close(meta, seen[0][2], atol=0, rtol=0)
    assert int((seen[1][2] != 0).sum()) == n and int(seen[1][2][int(slots[0])]) == (1 << 32) | 7
    w, state = w0.clone(), {} if s0 is None else {"sum_sq": s0.clone()}
    apply_update(cfg, w, state, torch.from_numpy(slots).long(), grads)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == "fp16" else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(seen[1][0].float(), w.float(), **tol)
    if s0 is not None:
        torch.testing.assert_close(seen[1][1], state["sum_sq"], **tol)


# ---------------------------------------------------------------------------- row init
@needs_native
@pytest.mark.parametrize("dim", [1, 3, 8, 16, 17, 64, 136])
@pytest.mark.parametrize("threads", [1, 3])
def test_init_bits_native_equals_numpy_bit_for_bit(dim: int, threads: int) -> None:
    """The C row init (one pass) gives init.py's numpy bits exactly, for every seed and key (incl.
    -1, 0, int64 min / max) and any thread count; init_rows (uniform, normal) follows it."""
    from embedding_ps import init

    rng = np.random.default_rng(dim)
    keys = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 9000, dtype=np.int64),
                           np.array([-1, 0, 1, -(2**63), 2**63 - 1], dtype=np.int64)])
    for seed in (0, 1, -5, 2**63 + 7, 12345):
        got = native.init_bits(keys, dim, reference.seed_mix(seed), threads)
        want = reference.init_bits(keys, dim, reference.seed_mix(seed))
        assert got.dtype == np.float32 and got.shape == (keys.shape[0], dim)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), seed
        assert float(np.abs(got).max()) < 1.0
    t = torch.from_numpy(keys[:500])
    for kind in ("uniform", "normal"):
        fast = init.init_rows(t, dim, 7, kind, 0.05)
        with pure():
            slow = init.init_rows(t, dim, 7, kind, 0.05)
        assert torch.equal(fast, slow), kind
    row = init.init_rows(t[:1], dim, 7, "uniform", 0.05)[0].tolist()         # the docstring's formula
    assert row == pytest.approx(init_row_reference(int(t[0]), dim, 7, "uniform", 0.05), rel=1e-6)


@needs_native
@pytest.mark.parametrize("dim", [1, 7, 16, 64, 136])
def test_merge_rows_equals_index_add_in_arrival_order(dim: int) -> None:
    """The C merge of duplicate slots gives the reference's sums (index_add_ in arrival order) bit for
    bit (signed zeros too), its unique slots in order of first arrival; no duplicates and one row are
    fine too."""

    rng = np.random.default_rng(dim)
    for n, high in ((5000, 700), (3000, 1 << 30), (1, 10), (64, 3)):
        slots = rng.integers(0, high, n, dtype=np.int32)
        scale = 10 ** rng.uniform(-8, 3, (n, 1)).astype(np.float32)                # rows of very different sizes
        grads = torch.from_numpy(rng.standard_normal((n, dim), dtype=np.float32) * scale)
        grads[rng.random(n) < 0.05] = -0.0
        got_slots, got = native.merge_rows(slots, grads)
        want_slots, want = reference.merge_rows(slots, grads)
        first = {}
        for i, s in enumerate(slots.tolist()):
            first.setdefault(s, i)
        assert got_slots.tolist() == sorted(first, key=first.get)               # first-arrival order
        assert np.array_equal(got_slots, want_slots)
        assert np.array_equal(got.numpy().view(np.uint32), want.numpy().view(np.uint32))


@needs_native
@pytest.mark.parametrize("ids", [
    [], [7], [5, 5, 5], [3, -1, 3, 2**63 - 1, -(2**63), -1, 0, 2**63 - 1],
    list(range(1000, 0, -1)) + list(range(0, 2000, 3)),
])
def test_unique_matches_torch_unique_up_to_order(ids) -> None:
    x = torch.tensor(ids, dtype=torch.int64)
    uniq, inverse, counts = native.unique(x, counts=True)
    assert torch.equal(uniq[inverse], x)                            # inverse maps back
    first = {}
    for i, v in enumerate(ids):
        first.setdefault(v, i)
    assert uniq.tolist() == sorted(first, key=first.get)            # each id once, by first appearance
    tu, tc = torch.unique(x, return_counts=True)
    order = torch.argsort(uniq)
    assert torch.equal(uniq[order], tu) and torch.equal(counts[order], tc)
    u2, inv2, c2 = native.unique(x)                    # without counts
    assert torch.equal(u2, uniq) and torch.equal(inv2, inverse) and c2 is None


@needs_native
def test_unique_of_random_ids_with_collisions() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5000, (20000,), generator=g) * 4096     # ids sharing low bits
    uniq, inverse, counts = native.unique(x, counts=True)
    assert torch.equal(uniq[inverse], x) and int(counts.sum()) == x.numel()
    assert torch.equal(torch.sort(uniq).values, torch.unique(x))


_OOM_UPDATE = """
import resource, sys
import numpy as np, torch
from embedding_ps import native
d = 1 << 22                                   # one 16 MB row: the l2 scratch row is a 16 MB malloc
w, g, slots = torch.zeros(1, d), torch.ones(1, d), np.zeros(1, dtype=np.int32)
args = ("sgd", w, None, slots, g, 0.1, 1e-8, None, 0)
native.update(*args, weight_decay=0.01, weight_decay_mode="l2")
vm = int([x for x in open("/proc/self/status") if x.startswith("VmSize")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))
try:
    native.update(*args, weight_decay=0.01, weight_decay_mode="l2")
except MemoryError as e:
    sys.exit("out of memory (some rows were not updated)" not in str(e))
sys.exit(3)
"""


@pytest.mark.skipif(not native.available() or not Path("/proc/self/status").exists(), reason="C library, Linux")
def test_update_out_of_memory_raises() -> None:
    """An l2 update whose scratch row cannot be allocated raises MemoryError (it updated nothing silently)."""
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", _OOM_UPDATE], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
