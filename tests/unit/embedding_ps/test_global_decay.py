"""Global weight decay (`weight_decay_mode = "global"`, `embedding_ps.shard.decay`) against an eager table.

The reference (`Eager`) holds every row that exists densely and, at each step s, scales EVERY row by
(1 - lr * wd), then applies the optimizer without decay (`tests/optim_reference.reference_update`) to the rows the step
touches, with their summed gradient (a row first pushed at step s enters with its init value before
step s's decay). The shard decays lazily: rows untouched for k steps are scaled by (1 - lr * wd)^k when
pulled, pushed, saved or dumped. Every case must equal the reference <= 1e-5, on each update path:
the vectorized torch one, the C library's (sgd, adagrad, rowwise_adagrad) and fbgemm's fused op.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np
import pytest
import torch

from embedding_ps import native, reference
from embedding_ps.wire import protocol as P
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.decay import GlobalDecay
from embedding_ps.shard.gates import make_gate
from embedding_ps.local import LocalStore
from embedding_ps.shard.optim import fill_value, state_specs
from tests.optim_reference import reference_update
from embedding_ps.shard.server import ShardServer
from embedding_ps.shard.state import ShardState
from embedding_ps.wire.sharding import shard_of
from embedding_ps.shard.snapshot import SavedShard, shard_dir

LR, WD, D, V = 0.05, 0.4, 8, 60          # factor 0.98 a step
ATOL = 1e-5
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
CASES = [(opt, path) for opt in OPTIMIZERS for path in ("torch", "native", "fbgemm")
         if opt != "adam" or path == "torch"]
VOCAB = torch.arange(1000, 1000 + V)


def table(optimizer: str = "sgd", path: str = "native", **kw) -> TableConfig:
    return TableConfig(name="g", dim=D, optimizer=optimizer, lr=LR, weight_decay=WD, weight_decay_mode="global",
                       init="normal", init_scale=0.5, kernel="fbgemm" if path == "fbgemm" else "torch", **kw)


class _Native:
    """native.set_enabled(on) for the block (the torch path: off), restored after."""

    def __init__(self, path: str) -> None:
        self.on = path != "torch"

    def __enter__(self) -> None:
        if self.on and not native.available():
            pytest.skip("native library unavailable (no C compiler?)")
        self.prev = native.set_enabled(self.on)

    def __exit__(self, *exc: object) -> None:
        native.set_enabled(self.prev)


class Eager:
    """Every existing row decayed every step, then the touched rows updated without decay."""

    def __init__(self, cfg: TableConfig, init: torch.Tensor) -> None:
        self.cfg = cfg
        self.ucfg = dataclasses.replace(cfg, weight_decay=0.0)
        self.f = 1.0 - cfg.lr * cfg.weight_decay
        self.init = init.clone()                                  # [V, D] init rows of VOCAB
        self.w = init.clone()                                     # [V, D]
        self.exists = torch.zeros(V, dtype=torch.bool)
        self.state = [{s.name: torch.full((D,) if s.per_coordinate else (), fill_value(cfg, s), dtype=s.dtype)
                       for s in state_specs(cfg)} for _ in range(V)]

    def step(self, ids: torch.Tensor, grads: torch.Tensor, decay: bool = True) -> None:
        """One step's pushes (decay=False: a further push of a step whose decay is applied already)."""
        summed: dict[int, torch.Tensor] = {}
        for k, g in zip(ids.tolist(), grads):
            summed[k] = summed[k] + g if k in summed else g.clone()
        new = [k - 1000 for k in summed if not self.exists[k - 1000]]
        self.exists[[k - 1000 for k in summed]] = True
        if decay:
            self.w[self.exists] *= self.f                         # every row, every step
        elif new:
            self.w[new] *= self.f                                 # new rows enter before the step's decay
        for k, g in summed.items():
            reference_update(self.ucfg, self.w[k - 1000], self.state[k - 1000], g)

    def idle(self, steps: int = 1) -> None:
        """Steps that touch no row of the table: the decay alone."""
        for _ in range(steps):
            self.w[self.exists] *= self.f

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w[ids - 1000]


def batch(g: torch.Generator, n: int = 25, dups: int = 4, lo: int = 0, hi: int = V
          ) -> tuple[torch.Tensor, torch.Tensor]:
    pick = (torch.randperm(hi - lo, generator=g)[:n] + lo + 1000)
    ids = torch.cat([pick, pick[:dups]])                          # duplicates are summed
    return ids, torch.randn(ids.numel(), D, generator=g)


def fresh(cfg: TableConfig, num_shards: int = 1, shard: int = 0) -> ShardState:
    return ShardState(PSConfig(num_shards=num_shards, tables=(cfg,)), shard)


# ---------------------------------------------------------------------------------------------- one trainer
@pytest.mark.parametrize("optimizer,path", CASES)
def test_equals_eager_every_step_every_path(optimizer: str, path: str) -> None:
    cfg = table(optimizer, path)
    g = torch.Generator().manual_seed(len(optimizer) + len(path))
    with _Native(path):
        state = fresh(cfg)
        ref = Eager(cfg, state.pull(0, VOCAB, 0))
        for step in range(30):
            # rows of the lower half are touched at most every few steps: long untouched stretches
            ids, grads = batch(g, lo=0 if step % 5 == 0 else V // 2)
            got = state.pull(0, VOCAB, step)                      # before step's push: through step - 1
            torch.testing.assert_close(got, ref.rows(VOCAB), rtol=0, atol=ATOL)
            state.push(0, ids, grads, step)
            ref.step(ids, grads)
        torch.testing.assert_close(state.pull(0, VOCAB, 30), ref.rows(VOCAB), rtol=0, atol=ATOL)
        keys, rows, extra = state.dump_table(0)
        torch.testing.assert_close(rows, ref.rows(keys), rtol=0, atol=ATOL)
        assert (extra["decay_step"] == 29).all()


def test_without_the_catch_up_the_eager_check_fails(monkeypatch) -> None:
    """The check above sees the catch-up: with it turned off (torch path), untouched rows stay behind."""
    cfg = table("sgd", "torch")
    g = torch.Generator().manual_seed(3)
    monkeypatch.setattr(reference, "decay_scales", lambda decay, k: torch.ones(len(k)))    # the pull's catch-up
    monkeypatch.setattr(GlobalDecay, "touch", lambda self, *a: None)
    with _Native("torch"):
        state = fresh(cfg)
        ref = Eager(cfg, state.pull(0, VOCAB, 0))
        for step in range(20):
            ids, grads = batch(g)
            state.push(0, ids, grads, step)
            ref.step(ids, grads)
        assert (state.pull(0, VOCAB, 20) - ref.rows(VOCAB)).abs().max() > 1e-2


def test_a_row_untouched_for_many_steps_is_caught_up_on_pull_push_and_dump() -> None:
    cfg = table("rowwise_adagrad")
    state = fresh(cfg)
    ref = Eager(cfg, state.pull(0, VOCAB, 0))
    a, b = VOCAB[:1], VOCAB[1:2]
    g = torch.ones(1, D)
    state.push(0, a, g, 0)
    ref.step(a, g)
    for step in range(1, 301):                    # only b: a is untouched for 300 steps
        state.push(0, b, g, step)
        ref.step(b, g)
    stored = state.tables[0].weights[state.tables[0].map.lookup(a.numpy())].clone()
    first = state.pull(0, a, 301)
    torch.testing.assert_close(first, ref.rows(a), rtol=0, atol=ATOL)
    assert first.abs().max() < 0.01 * stored.abs().max()       # 0.98^300 = 0.0023
    torch.testing.assert_close(state.pull(0, a, 301), first, rtol=0, atol=0)   # a pull writes nothing
    _, rows, _ = state.dump_table(0)
    torch.testing.assert_close(rows[:2], ref.rows(VOCAB[:2]), rtol=0, atol=ATOL)
    state.push(0, a, g, 301)                      # catch up through 301, then the update
    ref.step(a, g)
    torch.testing.assert_close(state.pull(0, VOCAB[:2], 302), ref.rows(VOCAB[:2]), rtol=0, atol=ATOL)


def test_one_step_equals_decoupled_and_fp16_rows_follow() -> None:
    g = torch.Generator().manual_seed(5)
    ids, grads = batch(g)
    got = {}
    for mode in ("decoupled", "global"):
        state = fresh(dataclasses.replace(table("adagrad"), weight_decay_mode=mode))
        state.push(0, ids, grads, 0)
        got[mode] = state.pull(0, VOCAB, 1)
    torch.testing.assert_close(got["global"], got["decoupled"], rtol=0, atol=1e-7)
    cfg = table("sgd", dtype="fp16")
    state = fresh(cfg)
    ref = Eager(cfg, state.pull(0, VOCAB, 0))
    for step in range(10):
        ids, grads = batch(g)
        state.push(0, ids, grads, step)
        ref.step(ids, grads)
    torch.testing.assert_close(state.pull(0, VOCAB, 10), ref.rows(VOCAB), rtol=0, atol=3e-3)


# ---------------------------------------------------------------------------------------------- sync / async
@pytest.mark.parametrize("optimizer,path,threads", [("adagrad", "native", 2), ("sgd", "native", 1),
                                                    ("adam", "torch", 1), ("rowwise_adagrad", "fbgemm", 1)])
def test_sync_three_workers_equal_eager(optimizer: str, path: str, threads: int) -> None:
    """A step's pushes of all workers are summed and applied once; pulls of step s see steps < s.
    Step 7 touches no row of the table: its decay is still owed, and paid. threads = 2: the C
    gathers and updates split over two threads."""
    cfg = table(optimizer, path)
    config = PSConfig(mode="sync", num_workers=3, threads=threads, tables=(cfg,))
    g = torch.Generator().manual_seed(11)
    with _Native(path):
        state = ShardState(config, 0)
        gate = make_gate(config, state)
        ref = Eager(cfg, state.pull(0, VOCAB, 0))
        for step in range(12):
            torch.testing.assert_close(state.pull(0, VOCAB, step), ref.rows(VOCAB), rtol=0, atol=ATOL)
            parts = [batch(g, n=10, dups=2) for _ in range(3)] if step != 7 else []
            for w, (ids, grads) in enumerate(parts):
                gate.push(w, step, [(0, ids, grads)])
            for w in range(3):
                gate.barrier(w, step)
            if parts:
                ref.step(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
            else:
                ref.idle()
        torch.testing.assert_close(state.pull(0, VOCAB, 12), ref.rows(VOCAB), rtol=0, atol=ATOL)


def test_async_workers_in_step_order_equal_eager() -> None:
    """Async, two workers one step apart, pushes arriving in step order: the eager table."""
    cfg = table("adagrad")
    config = PSConfig(mode="async", num_workers=2, max_staleness=1, tables=(cfg,))
    g = torch.Generator().manual_seed(13)
    state = ShardState(config, 0)
    gate = make_gate(config, state)
    ref = Eager(cfg, state.pull(0, VOCAB, 0))
    for step in range(15):
        for w in (1, 0):                          # worker 1 pushes step s, then worker 0 step s
            ids, grads = batch(g, n=8, dups=1)
            gate.push(w, step, [(0, ids, grads)])
            ref.step(ids, grads, decay=w == 1)    # the second push of a step: its decay is applied
            gate.barrier(w, step)
        torch.testing.assert_close(state.pull(0, VOCAB, step + 1), ref.rows(VOCAB), rtol=0, atol=ATOL)


def test_async_stale_push_never_decays_backwards() -> None:
    """A push carries its worker's step: rows are caught up to max(their step, the push's step)."""
    cfg = table("sgd")
    state = fresh(dataclasses.replace(cfg, init="zeros"))
    f, one = 1.0 - LR * WD, torch.ones(1, D)
    a, b = VOCAB[:1], VOCAB[1:2]
    state.push(0, torch.cat([a, b]), torch.cat([one, one]), 0)     # both -lr at step 0
    state.push(0, a, one, 5)                  # fast worker: a through 5
    state.push(0, a, one, 3)                  # slow worker, step 3: a is past it: its update only
    state.push(0, b, one, 3)                  # b through 3, then its update
    want_a = ((-LR) * f**5 - LR) - LR         # f(-lr) at 0 ... through 5, update; step 3: update only
    want_b = (-LR) * f**3 - LR                # through 3 (k = 3), update
    got = state.pull(0, torch.cat([a, b]), 4)                       # a slow pull (target 3)
    torch.testing.assert_close(got[:, 0], torch.tensor([want_a * 1.0, want_b]), rtol=0, atol=1e-6)
    got = state.pull(0, torch.cat([a, b]), 7)                       # target 6
    torch.testing.assert_close(got[:, 0], torch.tensor([want_a * f, want_b * f**3]), rtol=0, atol=1e-6)
    # a save is caught up to the latest step seen (the pull of step 7: 6)
    _, rows, extra = state.dump_table(0)
    torch.testing.assert_close(rows[:, 0], torch.tensor([want_a * f, want_b * f**3]), rtol=0, atol=1e-6)
    assert extra["decay_step"].tolist() == [6, 6]


# ---------------------------------------------------------------------------------------------- save / load
def drive(state: ShardState, ref: Eager, steps: range, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for step in steps:
        ids, grads = batch(g, n=12, lo=0 if step % 4 == 0 else V // 2)
        state.push(0, ids, grads, step)
        ref.step(ids, grads)


@pytest.mark.parametrize("background", [False, True])
def test_save_load_round_trip_equals_eager(tmp_path, background: bool) -> None:
    cfg = table("adagrad")
    state = fresh(cfg)
    ref = Eager(cfg, state.pull(0, VOCAB, 0))
    drive(state, ref, range(0, 10), seed=1)
    at_save = ref.rows(VOCAB).clone()
    path = str(tmp_path / "s")
    if background:                            # copy-on-write: pushes after the snapshot are not in the save
        snap = state.snapshot(step=10)
        writer = threading.Thread(target=snap.write, args=(path,))
        writer.start()
        drive(state, Eager(cfg, ref.init), range(10, 14), seed=2)
        writer.join(20.0)
    else:
        state.save(path, step=10)
    saved = SavedShard(path)
    keys, rows, extra = saved.dump_table(0)
    torch.testing.assert_close(rows, at_save[keys - 1000], rtol=0, atol=ATOL)       # the files: eager at 10
    assert (extra["decay_step"] == 9).all() and saved.meta(0)["decay_clock"] == 9
    again = fresh(cfg)
    again.load(path)
    torch.testing.assert_close(again.pull(0, VOCAB, 10), at_save, rtol=0, atol=ATOL)
    drive(again, ref, range(10, 25), seed=3)
    torch.testing.assert_close(again.pull(0, VOCAB, 25), ref.rows(VOCAB), rtol=0, atol=ATOL)


def test_after_a_load_the_steps_nobody_pushed_still_decay(tmp_path) -> None:
    """Steps stay absolute across a save: a resumed shard whose first push comes 5 steps after the
    resume (its table untouched meanwhile) owes its rows those 5 steps."""
    cfg = table("sgd")
    state = fresh(cfg)
    ref = Eager(cfg, state.pull(0, VOCAB, 0))
    drive(state, ref, range(0, 8), seed=4)
    state.save(str(tmp_path / "s"), step=8)
    again = fresh(cfg)
    again.load(str(tmp_path / "s"))
    ref.idle(5)                                   # steps 8-12 touch nothing of this shard
    torch.testing.assert_close(again.pull(0, VOCAB, 13), ref.rows(VOCAB), rtol=0, atol=ATOL)
    drive(again, ref, range(13, 18), seed=5)
    torch.testing.assert_close(again.pull(0, VOCAB, 18), ref.rows(VOCAB), rtol=0, atol=ATOL)


def test_a_save_without_decay_steps_loads_caught_up_at_the_resumed_step(tmp_path) -> None:
    """A shard saved by a table without global decay (an older save) has no decay_step array."""
    cfg = table("rowwise_adagrad")
    old = fresh(dataclasses.replace(cfg, weight_decay_mode="decoupled"))
    g = torch.Generator().manual_seed(6)
    for step in range(6):
        ids, grads = batch(g)
        old.push(0, ids, grads, step)
    old.save(str(tmp_path / "old"), step=6)
    assert "decay_step" not in SavedShard(str(tmp_path / "old")).array_names(0)
    state = fresh(cfg)
    state.load(str(tmp_path / "old"))
    loaded = state.pull(0, VOCAB, 6)
    torch.testing.assert_close(loaded, old.pull(0, VOCAB, 6), rtol=0, atol=0)
    ref = Eager(cfg, loaded)
    ref.exists[:] = torch.from_numpy(state.tables[0].map.lookup(VOCAB.numpy()) >= 0)
    ref.state = [{"sum_sq": s} for s in _sum_sq(state, VOCAB)]
    drive(state, ref, range(6, 16), seed=7)
    torch.testing.assert_close(state.pull(0, VOCAB, 16), ref.rows(VOCAB), rtol=0, atol=ATOL)


def _sum_sq(state: ShardState, ids: torch.Tensor) -> list[torch.Tensor]:
    t = state.tables[0]
    slots = t.map.lookup(ids.numpy())
    return [t.state["sum_sq"][s].clone() if s >= 0 else torch.tensor(0.0) for s in slots]


def test_reshard_two_shards_into_three_carries_the_decay(tmp_path) -> None:
    cfg = table("adagrad")
    olds = [fresh(cfg, 2, i) for i in range(2)]
    ref = Eager(cfg, olds[0].pull(0, VOCAB, 0))
    g = torch.Generator().manual_seed(8)

    def step_all(states: list[ShardState], step: int) -> None:
        ids, grads = batch(g, n=15, lo=0 if step % 3 == 0 else V // 2)
        where = shard_of(ids, len(states))
        for i, s in enumerate(states):
            s.push(0, ids[where == i], grads[where == i], step)
        ref.step(ids, grads)

    for step in range(9):
        step_all(olds, step)
    dirs = [shard_dir(str(tmp_path / "ps"), i) for i in range(2)]
    for s, d in zip(olds, dirs):
        s.save(d, step=9)
    news = [fresh(cfg, 3, i) for i in range(3)]
    for s in news:
        s.load_resharded(dirs)
    # re-sharded offline (recsys reshard: load_resharded, then a save without a step), then loaded
    for i, s in enumerate(news):
        s.save(shard_dir(str(tmp_path / "ps3"), i))
    news = [fresh(cfg, 3, i) for i in range(3)]
    for i, s in enumerate(news):
        s.load(shard_dir(str(tmp_path / "ps3"), i))
    for step in range(9, 20):
        step_all(news, step)
    where = shard_of(VOCAB, 3)
    for i, s in enumerate(news):
        mine = VOCAB[where == i]
        torch.testing.assert_close(s.pull(0, mine, 20), ref.rows(mine), rtol=0, atol=ATOL)


def test_local_store_saves_through_the_step_before_its_current_one(tmp_path) -> None:
    """LocalStore (3 shards): pushes of steps 0-4, barriers through step 7; a save (its step: the
    store's, 8) writes every row decayed through step 7, and `from_dir` pulls them back."""
    cfg = table("rowwise_adagrad")
    config = PSConfig(num_shards=3, tables=(cfg,))
    store = LocalStore.create(config)
    ref = Eager(cfg, store.pull(0, VOCAB))
    g = torch.Generator().manual_seed(10)
    for step in range(8):
        if step < 5:
            ids, grads = batch(g)
            store.push(0, ids, grads)
            ref.step(ids, grads)
        else:
            ref.idle()
        store.barrier(step)
    store.save(str(tmp_path))
    for i in range(3):
        keys, rows, extra = SavedShard(shard_dir(str(tmp_path), i)).dump_table(0)
        torch.testing.assert_close(rows, ref.rows(keys), rtol=0, atol=ATOL)
        assert (extra["decay_step"] == 7).all()
    again = LocalStore.from_dir(config, str(tmp_path))
    again.step = 8
    torch.testing.assert_close(again.pull(0, VOCAB), ref.rows(VOCAB), rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------------------------- the server's SAVE
def _request(op, step, text=None, flags=0):
    payload = [] if text is None else [text.encode()]
    h = P.Header(op=op, dtype=P.DType.BYTES if text else P.DType.NONE, count=len(payload[0]) if text else 0,
                 step=step, request=step + 1, flags=flags, client=7, worker=0)
    return [h.pack(), b"", *payload]


def _push(ids: torch.Tensor, grads: torch.Tensor, step: int):
    h = P.Header(op=P.Op.PUSH, dtype=P.DType.FP32, count=1, dim=D, step=step, worker=0, client=7, request=100 + step)
    index = np.array([[0, ids.numel()]], dtype=np.int64).tobytes()
    return [h.pack(), b"", index, ids.numpy().tobytes(), grads.numpy().tobytes()]


@pytest.mark.parametrize("background", [False, True])
def test_server_save_writes_rows_decayed_through_the_steps_before_it(tmp_path, background: bool) -> None:
    """Sync shard: steps 0-2 push, steps 3-5 touch nothing of this shard (barriers only); a SAVE of
    step 6 writes every row decayed through step 5."""
    cfg = table("sgd")
    state = fresh(cfg)
    server = ShardServer(PSConfig(mode="sync", tables=(cfg,)), 0, state)
    ref = Eager(cfg, state.pull(0, VOCAB, 0))
    g = torch.Generator().manual_seed(9)
    for step in range(6):
        if step < 3:
            ids, grads = batch(g)
            server.handle(_push(ids, grads, step))
            ref.step(ids, grads)
        else:
            ref.idle()
        server.handle(_request(P.Op.BARRIER, step))
    reply = server.handle(_request(P.Op.SAVE, 6, str(tmp_path), flags=P.FLAG_BACKGROUND if background else 0))
    assert P.unpack_header(reply[0]).status == P.Status.OK, bytes(reply[1])
    assert server.saver.wait(20.0) and json.loads(bytes(reply[1]))["shard"] == 0
    keys, rows, extra = SavedShard(shard_dir(str(tmp_path), 0)).dump_table(0)
    torch.testing.assert_close(rows, ref.rows(keys), rtol=0, atol=ATOL)
    assert (extra["decay_step"] == 5).all()


# ---------------------------------------------------------------------------------------------- config
def test_config_accepts_global_and_checks_lr_times_decay() -> None:
    assert table().weight_decay_mode == "global"
    with pytest.raises(ValueError, match=r"ps.tables\[g\]: global weight decay needs lr \* weight_decay < 1"):
        dataclasses.replace(table(), weight_decay=20.0, lr=0.1)
    plain = fresh(dataclasses.replace(table(), weight_decay=0.0))       # no decay: no decay state
    assert plain.tables[0].decay is None and plain.tables[0].decay_step is None
