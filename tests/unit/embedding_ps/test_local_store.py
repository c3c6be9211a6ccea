"""LocalStore: implements the EmbeddingStore Protocol, and N shard states act as one."""

import dataclasses
import inspect

import pytest
import torch

from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.local import LocalStore
from embedding_ps.store import EmbeddingStore

# two dims (4 and 8), a hashed table, two optimizers
TABLES = (
    TableConfig(name="a", dim=4, lr=0.1, seed=1),
    TableConfig(name="b", dim=4, lr=0.1, seed=2, optimizer="adam"),
    TableConfig(name="c", dim=8, lr=0.1, seed=3),
    TableConfig(name="h", dim=8, lr=0.1, seed=4, kind="hashed", num_embeddings=97),
)


def store_of(num_shards: int) -> LocalStore:
    return LocalStore.create(PSConfig(num_shards=num_shards, tables=TABLES))


def protocol_members() -> list[str]:
    return sorted(n for n in dir(EmbeddingStore) if not n.startswith("_")) + sorted(
        n for c in EmbeddingStore.__mro__ for n in vars(c).get("__annotations__", {}) if not n.startswith("_"))


def test_local_store_satisfies_the_protocol() -> None:
    store = store_of(2)
    assert isinstance(store, EmbeddingStore)
    members = protocol_members()
    assert {"step", "pull_many_async", "push_many_async", "pull", "push", "barrier", "barrier_async", "sweep",
            "save", "wait_saved", "load", "stats", "close"} <= set(members)
    for name in members:
        assert hasattr(store, name), name
        want = getattr(EmbeddingStore, name, None)
        if not callable(want):
            continue
        got, spec = inspect.signature(getattr(LocalStore, name)), inspect.signature(want)
        # same parameters, in order, of the same kind and default (annotations are strings on both sides)
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
               [(p.name, p.kind, p.default) for p in spec.parameters.values()], name


def random_calls(seed: int, steps: int) -> list[tuple[list[int], list[torch.Tensor], torch.Tensor]]:
    """Per step one multi-table push per dim group, with duplicate ids within and across parts."""
    g = torch.Generator().manual_seed(seed)
    calls = []
    for _ in range(steps):
        for tables, dim in (([0, 1, 0], 4), ([2, 3], 8)):           # table 0 twice in one call
            ids = [torch.randint(-50, 200, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g)
                   for _ in tables]                                  # int64, duplicates likely
            grads = torch.randn(sum(x.numel() for x in ids), dim, generator=g)
            calls.append((tables, ids, grads))
    return calls


def test_three_states_give_the_rows_of_one() -> None:
    one, three = store_of(1), store_of(3)
    probe = torch.arange(-60, 210)
    for step in range(4):
        for tables, ids, grads in random_calls(step, 1):
            pulled = [s.pull_many_async(tables, ids).result() for s in (one, three)]
            torch.testing.assert_close(pulled[0], pulled[1], atol=0, rtol=0)
            for s in (one, three):
                s.push_many_async(tables, ids, grads).result()
        one.barrier(step)
        three.barrier(step)
    assert one.step == three.step == 4
    for t, table in enumerate(TABLES):
        torch.testing.assert_close(one.pull(t, probe), three.pull(t, probe), atol=1e-6, rtol=1e-6)
    rows = [sum(s["state"]["rows"] for s in store.stats()) for store in (one, three)]
    assert rows[0] == rows[1] > 0
    assert all(s["state"]["rows"] > 0 for s in three.stats())       # every shard got some


def test_duplicates_are_summed_within_a_call() -> None:
    """[5, 5, 7] + [5] of one table in one call == one update of 5 with the sum (the PS's rule)."""
    a, b = store_of(3), store_of(3)
    g = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    a.push_many_async([0, 0], [torch.tensor([5, 5, 7]), torch.tensor([5])], g).result()
    b.push(0, torch.tensor([5, 7]), torch.stack([g[0] + g[1] + g[3], g[2]]))
    ids = torch.tensor([5, 7, 9])
    torch.testing.assert_close(a.pull(0, ids), b.pull(0, ids), atol=1e-6, rtol=1e-6)


def test_save_load_and_wait(tmp_path) -> None:
    store = store_of(2)
    for tables, ids, grads in random_calls(7, 2):
        store.push_many_async(tables, ids, grads)
    saved = store.save(str(tmp_path / "ps"))
    assert [(s["shard"], s["directory"], s["background"]) for s in saved] == \
           [(i, str(tmp_path / "ps" / f"shard{i}"), False) for i in range(2)]
    assert [s["state"] for s in store.wait_saved(str(tmp_path / "ps"), timeout_s=1)] == ["done", "done"]
    with pytest.raises(RuntimeError, match="last save"):
        store.wait_saved(str(tmp_path / "other"), timeout_s=1)
    probe = torch.arange(-60, 210)
    back = LocalStore.from_dir(store.config, tmp_path / "ps")
    for t in range(len(TABLES)):
        torch.testing.assert_close(back.pull(t, probe), store.pull(t, probe), atol=0, rtol=0)
    store.close()


def test_input_errors() -> None:
    store = store_of(2)
    with pytest.raises(ValueError, match="share one dim"):
        store.pull_many_async([0, 2], [torch.tensor([1]), torch.tensor([1])])
    with pytest.raises(ValueError, match=r"grads must be \[3, 4\]"):
        store.push_many_async([0], [torch.tensor([1, 2, 3])], torch.zeros(2, 4))
    with pytest.raises(IndexError, match="table 9"):
        store.pull(9, torch.tensor([1]))
    with pytest.raises(ValueError, match="shards 0..1"):
        LocalStore(dataclasses.replace(store.config), store.states[::-1])


def test_both_stores_check_a_call_the_same_way() -> None:
    """One check (`store.call_dim`) for LocalStore and PSClient: a table outside ps.tables is an IndexError
    and a ValueError (each store raised one of the two before); no request is sent."""
    import socket

    from embedding_ps.client.client import PSClient

    local = store_of(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = PSClient(local.config, [f"tcp://127.0.0.1:{port}"])
    try:
        for store in (local, client):
            for err in (IndexError, ValueError):
                with pytest.raises(err, match=r"table 9 out of range \[0, 4\)"):
                    store.pull_many_async([9], [torch.tensor([1])])
            with pytest.raises(ValueError, match="ids must be int64"):
                store.pull_many_async([0], [torch.tensor([1.0])])
            with pytest.raises(ValueError, match=r"grads must be \[2, 4\]"):
                store.push_many_async([0], [torch.tensor([1, 2])], torch.zeros(2, 3))
    finally:
        client.close()
        local.close()
