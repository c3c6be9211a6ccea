"""Every sparse optimizer: hand-computed values, the one-row reference, and fbgemm == torch."""

import dataclasses
import math

import pytest
import torch

from embedding_ps import native
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.init import init_rows
from tests.optim_reference import ReferenceTable
from embedding_ps.shard.state import ShardState

OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"]


def one_table_state(**kw) -> ShardState:
    return ShardState(PSConfig(tables=(TableConfig(name="t", **kw),)), 0)


def rows_of(state: ShardState, ids: list[int]) -> torch.Tensor:
    return state.pull(0, torch.tensor(ids, dtype=torch.int64))


# ids [3, 3, 5]: id 3 gets [1, 2] + [3, -2] = [4, 0], id 5 gets [0.5, 0.5]; rows start at zero.
IDS = torch.tensor([3, 3, 5])
GRADS = torch.tensor([[1.0, 2.0], [3.0, -2.0], [0.5, 0.5]])
HAND = {
    # w -= 0.1 * g
    ("sgd", 1): [[-0.4, 0.0], [-0.05, -0.05]],
    # h = g*g = [16, 0] / [.25, .25];  w = -0.1 * g / sqrt(h)  (0 / (0 + eps) = 0)
    ("adagrad", 1): [[-0.1, 0.0], [-0.1, -0.1]],
    # h = mean(g*g) = 8 / 0.25;  w = -0.1 * g / sqrt(h)
    ("rowwise_adagrad", 1): [[-0.4 / math.sqrt(8.0), 0.0], [-0.1, -0.1]],
    # bias-corrected m_hat = g, v_hat = g*g at t=1 and again at t=2: each step moves -0.1 * sign(g)
    ("adam", 1): [[-0.1, 0.0], [-0.1, -0.1]],
    ("adam", 2): [[-0.2, 0.0], [-0.2, -0.2]],
    # n = g*g, z = g, w = -z / ((beta + |g|) / alpha) = -0.1 g / (1 + |g|)
    ("ftrl", 1): [[-0.4 / 5.0, 0.0], [-0.05 / 1.5, -0.05 / 1.5]],
}


HAND_CASES = [(n, p, "torch") for n, p in sorted(HAND)] + [
    (n, p, "fbgemm") for n, p in sorted(HAND) if n in ("sgd", "adagrad", "rowwise_adagrad")
]


@pytest.mark.parametrize("name,pushes,kernel", HAND_CASES)
def test_hand_computed_values_with_duplicate_ids(name: str, pushes: int, kernel: str) -> None:
    state = one_table_state(dim=2, init="zeros", optimizer=name, lr=0.1, kernel=kernel)
    for step in range(pushes):
        state.push(0, IDS, GRADS, step=step)
    torch.testing.assert_close(rows_of(state, [3, 5]), torch.tensor(HAND[(name, pushes)]), atol=1e-6, rtol=1e-5)


def test_ftrl_l1_zeroes_small_z_and_l2_shrinks() -> None:
    state = one_table_state(dim=2, init="zeros", optimizer="ftrl", lr=0.1, ftrl_l1=1.0, ftrl_l2=2.0)
    state.push(0, IDS, GRADS, step=0)
    # id 3: z = [4, 0] -> w0 = -(4 - 1) / ((1 + 4) / 0.1 + 2) = -3 / 52, w1 = 0 (|z| <= l1); id 5: |z| = 0.5 <= 1
    torch.testing.assert_close(rows_of(state, [3, 5]), torch.tensor([[-3.0 / 52.0, 0.0], [0.0, 0.0]]))


def test_rowwise_adagrad_state_is_mean_square_plus_initial_accumulator() -> None:
    state = one_table_state(dim=2, init="zeros", optimizer="rowwise_adagrad", lr=0.1, initial_accumulator=1.0)
    state.push(0, IDS, GRADS, step=0)
    keys, rows, st = state.dump_table(0)
    assert keys.tolist() == [3, 5]
    torch.testing.assert_close(st["sum_sq"], torch.tensor([9.0, 1.25]))
    torch.testing.assert_close(rows[0], torch.tensor([-0.4 / 3.0, 0.0]))


def random_pushes(num_pushes: int, dim: int, seed: int = 0, id_range: int = 60, n: int = 50):
    g = torch.Generator().manual_seed(seed)
    for step in range(num_pushes):
        ids = torch.randint(-id_range, id_range, (n,), generator=g)  # many duplicates per push
        yield step, ids, torch.randn(n, dim, generator=g)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_fast_path_matches_one_row_reference(name: str, dtype: str) -> None:
    cfg = TableConfig(name="t", dim=5, optimizer=name, lr=0.05, dtype=dtype, init="normal", init_scale=0.1,
                      initial_accumulator=0.1, ftrl_l1=0.01, ftrl_l2=0.1, seed=7)
    state = ShardState(PSConfig(tables=(cfg,)), 0)
    ref = ReferenceTable(cfg, lambda k: init_rows(torch.tensor([k]), cfg.dim, cfg.seed, cfg.init, cfg.init_scale)[0]
                         .to(torch.float16 if dtype == "fp16" else torch.float32).float())
    for step, ids, grads in random_pushes(8, cfg.dim):
        state.push(0, ids, grads, step)
        ref.push(ids, grads)
    keys, rows, st = state.dump_table(0)
    assert sorted(ref.rows) == keys.tolist()
    expect = torch.stack([ref.rows[k][0] for k in keys.tolist()])
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == "fp16" else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rows, expect, **tol)
    for sname, values in st.items():
        if sname in ("count", "last_seen", "last_update"):
            continue
        expect_state = torch.stack([ref.rows[k][1][sname] for k in keys.tolist()])
        torch.testing.assert_close(values, expect_state, **tol)


PATHS = ("fbgemm", "native", "torch")  # fbgemm's fused op / the C ps_update / vectorized torch (C library off)
DECAYS = {"none": {}, "l2": dict(weight_decay=0.3, weight_decay_mode="l2"),
          "decoupled": dict(weight_decay=0.3, weight_decay_mode="decoupled")}


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("decay", sorted(DECAYS))
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_every_update_path_matches_one_row_reference(name: str, decay: str, dtype: str) -> None:
    """fbgemm, native C and torch give the rows and optimizer state of the plain-torch one-row reference."""
    if not native.available():
        pytest.skip("native library unavailable (no C compiler?)")
    base = TableConfig(name="t", dim=8, optimizer=name, lr=0.05, dtype=dtype, init="normal", init_scale=0.5,
                       initial_accumulator=0.1, seed=5, **DECAYS[decay])
    ref = ReferenceTable(base, lambda k: init_rows(torch.tensor([k]), base.dim, base.seed, base.init,
                                                   base.init_scale)[0].to(base.dtype == "fp16" and torch.float16
                                                                          or torch.float32).float())
    pushes = list(random_pushes(6, base.dim, seed=3))  # ~50 ids of 120 per push: duplicates summed
    for _, ids, grads in pushes:
        ref.push(ids, grads)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == "fp16" else dict(atol=1e-6, rtol=1e-5)
    dumps = {}
    for path in PATHS:
        cfg = dataclasses.replace(base, kernel="fbgemm" if path == "fbgemm" else "native")
        prev = native.set_enabled(path != "torch")
        try:
            state = ShardState(PSConfig(tables=(cfg,)), 0)
            assert state.stats()["t/kernel"] == ("fbgemm" if path == "fbgemm" else "native")
            for step, ids, grads in pushes:
                state.push(0, ids, grads, step)
        finally:
            native.set_enabled(prev)
        keys, rows, st = dumps[path] = state.dump_table(0)
        assert keys.tolist() == sorted(ref.rows)
        torch.testing.assert_close(rows, torch.stack([ref.rows[k][0] for k in keys.tolist()]), **tol, msg=path)
        for sname in ("sum_sq",) if name != "sgd" else ():
            want = torch.stack([ref.rows[k][1][sname] for k in keys.tolist()])
            torch.testing.assert_close(st[sname], want, **tol, msg=f"{path} {sname}")
    if dtype == "fp16":  # the paths round to fp16 at different points (fbgemm's decay: twice): 1 ulp apart
        return
    for path in ("native", "torch"):  # fp32: the paths against each other, tighter than against the reference
        torch.testing.assert_close(dumps[path][1], dumps["fbgemm"][1], atol=1e-6, rtol=1e-6)
        for sname in dumps["fbgemm"][2]:
            torch.testing.assert_close(dumps[path][2][sname], dumps["fbgemm"][2][sname], atol=1e-6, rtol=1e-6)


def test_fbgemm_kernel_rejected_for_adam() -> None:
    with pytest.raises(ValueError, match="kernel='fbgemm' supports optimizer sgd, adagrad, rowwise_adagrad"):
        TableConfig(name="t", dim=4, optimizer="adam", kernel="fbgemm")
