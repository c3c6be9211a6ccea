"""One SplitMix64 finalizer per package that needs it, pinned to the same known values.

data/ and embedding_ps/ may not import each other, so each keeps one Python copy
(`data.hashing.splitmix64_finalize`: the string-id hash and the synthetic ids;
`embedding_ps.wire.sharding.splitmix64_np`: shards, hashed rows, row init, admission, the id map), and
`embedding_ps/csrc/ps.c` has the C one (the id map's probe start). All three must agree.
"""

from __future__ import annotations

import numpy as np
import pytest

from data.hashing import GOLDEN as DATA_GOLDEN
from data.hashing import splitmix64_finalize
from data.synthetic import splitmix64 as splitmix64_next
from embedding_ps import native
from embedding_ps.idmap import EMPTY
from embedding_ps.reference import home as _home
from embedding_ps.wire.sharding import GOLDEN, splitmix64_np
from tests.init_reference import splitmix64_reference

# SplitMix64 seeded with 0 outputs finalizer(k * GOLDEN): e220a8397b1dcdaf, 6e789e6aa1b965f4, ...
PUBLISHED = {GOLDEN: 0xE220A8397B1DCDAF, 2 * GOLDEN % (1 << 64): 0x6E789E6AA1B965F4}
EXTREMES = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF, 12345678901234567]


def test_both_python_copies_give_the_published_values() -> None:
    assert DATA_GOLDEN == GOLDEN
    x = np.array(list(PUBLISHED), dtype=np.uint64)
    want = list(PUBLISHED.values())
    assert splitmix64_finalize(x).tolist() == want
    assert splitmix64_np(x).tolist() == want
    assert [splitmix64_reference(int(v)) for v in x] == want
    assert splitmix64_next(np.array([0, GOLDEN], dtype=np.uint64)).tolist() == want   # the generator's steps


def test_both_python_copies_agree_everywhere() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([np.array(EXTREMES, dtype=np.uint64), rng.integers(0, 2**63, 1000, dtype=np.uint64) * 2 + 1])
    assert np.array_equal(splitmix64_finalize(x), splitmix64_np(x))
    assert splitmix64_np(x).tolist() == [splitmix64_reference(int(v)) for v in x]


@pytest.mark.skipif(not native.available(), reason="native library off or unavailable (no C compiler?)")
@pytest.mark.parametrize("key", [0, 1, -3, 2**63 - 1, -(2**63), 0x0123456789ABCDEF])   # -1, -2: EMPTY, TOMBSTONE
def test_the_c_copy_agrees(key: int) -> None:
    """`csrc/ps.c` ps_home(key) = splitmix64(key + GOLDEN) >> (64 - bits) for 2**bits buckets: one
    key placed into an empty map lands in its home bucket."""
    bits = 16
    kv = np.full(1 << bits, EMPTY, dtype=np.int64)
    vv = np.full(1 << bits, -1, dtype=np.int32)
    keys = np.array([key], dtype=np.int64)
    native.map_place(kv, vv, keys, np.array([0], dtype=np.int32))
    (pos,) = np.flatnonzero(kv == key)
    with np.errstate(over="ignore"):
        want = int(splitmix64_np(np.array([key], dtype=np.int64).view(np.uint64) + np.uint64(GOLDEN))[0] >> (64 - bits))
    assert pos == want == int(_home(keys, 1 << bits)[0])
