"""ps.threads: the threaded native data path gives the rows, optimizer state, counters and evictions
of one thread (bit for bit) and of the plain numpy/torch reference (within the tolerances of
test_native.py).

Requests here have 20k-30k rows, so the C side really splits them (it keeps a request under
2 x 4096 rows on one thread); the ids repeat (duplicates are merged before the update), and
admission, TTL and LFU eviction run between pushes.
"""

import contextlib

import numpy as np
import pytest
import torch

from embedding_ps import native
from embedding_ps.wire.config import MAX_THREADS, PSConfig, TableConfig, shard_threads
from embedding_ps.idmap import IdMap
from embedding_ps.shard.state import ShardState

needs_native = pytest.mark.skipif(not native.available(), reason="native library off or unavailable (no C compiler?)")
THREADS = 3


@contextlib.contextmanager
def pure():
    prev = native.set_enabled(False)
    try:
        yield
    finally:
        native.set_enabled(prev)


def run_table(cfg: TableConfig, threads: int, use_native: bool = True, steps: int = 6):
    """A fixed sequence of large pushes (duplicates, new ids, evictions) and pulls; returns what it saw."""
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(3)
    pulls = []
    with contextlib.nullcontext() if use_native else pure():
        state = ShardState(PSConfig(threads=threads, tables=(cfg,)), 0)
        assert state.threads == threads and state.tables[0].threads == threads
        for step in range(steps):
            ids = torch.from_numpy(rng.integers(-15_000, 15_000, 24_000).astype(np.int64))  # many duplicates
            if step % 3 == 2:
                ids = torch.unique(ids)  # and pushes without any
            grads = torch.randn(ids.shape[0], cfg.dim, generator=gen) * (3.0 if step % 4 == 0 else 0.1)
            state.push(0, ids, grads, step=step)
            if step % 3 == 1:
                state.sweep(step)
            probe = torch.from_numpy(rng.integers(-20_000, 20_000, 30_000).astype(np.int64))  # some absent
            pulls.append(state.pull(0, probe))
            out = torch.empty(probe.shape[0], cfg.dim)
            pulls.append(state.pull(0, probe, out=out))  # the server's path: into a reply buffer
        return pulls, state.dump_table(0), state.stats(), state.eviction_log(0)


def assert_same(a, b, tol: dict) -> None:
    for x, y in zip(a[0], b[0], strict=True):
        torch.testing.assert_close(x, y, **tol)
    (ka, ra, sa), (kb, rb, sb) = a[1], b[1]
    torch.testing.assert_close(ka, kb, atol=0, rtol=0)
    torch.testing.assert_close(ra, rb, **tol)
    assert sa.keys() == sb.keys()
    for name in sa:
        t = tol if sa[name].is_floating_point() else dict(atol=0, rtol=0)
        torch.testing.assert_close(sa[name], sb[name], **t)
    assert a[2] == b[2]
    for x, y in zip(a[3], b[3], strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


EXTRAS = [
    {},
    {"weight_decay": 0.01, "weight_decay_mode": "l2"},
    {"weight_decay": 0.5, "weight_decay_mode": "decoupled"},
    {"max_rows": 9_000, "ttl_steps": 2},
    {"min_count": 2, "unadmitted": "zeros"},
]


@needs_native
@pytest.mark.parametrize("extra", EXTRAS, ids=["plain", "wd_l2", "wd_decoupled", "evict", "admission"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("optimizer", sorted(native.OPTIMIZERS))
def test_threads_match_one_thread_and_torch(optimizer: str, dtype: str, extra: dict) -> None:
    # kernel "torch": the shard's own (C) update, the path ps.threads splits (not fbgemm's)
    cfg = TableConfig(name="t", dim=8, optimizer=optimizer, dtype=dtype, lr=0.05, init_scale=0.5, kernel="torch",
                      **extra)
    threaded, single = run_table(cfg, THREADS), run_table(cfg, 1)
    assert_same(threaded, single, dict(atol=0, rtol=0))  # each row's math does not depend on its thread
    assert threaded[2]["rows"] > 0 and threaded[1][0].shape[0] > 8_192  # the chunks really were split
    if extra.get("max_rows"):
        assert threaded[2]["t/evicted_lfu"] > 0 and threaded[2]["t/evicted_ttl"] > 0
    # against the torch reference: the tolerances of test_native.py (FMA / reduction order, ~1 ulp)
    reference = run_table(cfg, THREADS, use_native=False)
    tol = dict(atol=1e-6, rtol=1e-6) if optimizer in ("adagrad", "rowwise_adagrad") else dict(atol=0.0, rtol=0.0)
    if "weight_decay" in extra:
        tol = dict(atol=1e-6, rtol=1e-6)  # torch's decay ops may contract to an FMA as well
    if dtype == "fp16" and tol["atol"]:
        tol = dict(atol=1e-3, rtol=1e-3)  # a ~1 ulp fp32 difference can flip one fp16 rounding
    assert_same(threaded, reference, tol)


@needs_native
def test_threaded_lookup_and_gather_match_one_thread() -> None:
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, 60_000, dtype=np.int64))
    m1, m4 = IdMap(threads=1), IdMap(threads=4)
    for m in (m1, m4):
        m.insert(keys, np.arange(keys.shape[0], dtype=np.int32))
    probe = np.concatenate([rng.choice(keys, 40_000), rng.integers(-(2**63), 2**63 - 1, 10_000, dtype=np.int64)])
    slots = m4.lookup(probe)
    np.testing.assert_array_equal(slots, m1.lookup(probe))
    with pure():
        np.testing.assert_array_equal(slots, m1.lookup(probe))
    for dtype in (torch.float32, torch.float16):
        w = torch.randn(keys.shape[0], 24).to(dtype)
        outs = []
        for threads in (1, 4):
            out = torch.full((probe.shape[0], 24), 7.0)
            missing = native.gather(w, slots, out, threads)
            assert missing == int(np.count_nonzero(slots < 0))
            outs.append(out)
        torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
        hit = torch.from_numpy(slots >= 0)
        torch.testing.assert_close(outs[1][hit], w[torch.from_numpy(slots[slots >= 0]).long()].float(), atol=0, rtol=0)
        assert bool((outs[1][~hit] == 7.0).all())  # rows without a slot are left as they were


def test_threads_config() -> None:
    assert PSConfig().threads == 0
    assert 1 <= shard_threads(0) <= 4
    assert shard_threads(3) == 3
    for bad in (-1, MAX_THREADS + 1):
        with pytest.raises(ValueError, match=rf"ps.threads must be in \[0, {MAX_THREADS}\].*got {bad}"):
            PSConfig(threads=bad)
