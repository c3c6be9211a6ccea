"""The CUDA path (train.device = "cuda"), skipped without a GPU (CI has none: these run on a GPU
machine, e.g. `pytest -q tests/integration/test_cuda.py` there).

- A row cache held on the GPU serves exactly the rows of the wrapped store (multi-table calls,
  duplicates, empty parts), on the GPU, and its pushes reach the store like the CPU cache's.
- Sync training with the dense model on the GPU ends where the same job on the CPU ends: the same
  losses at every logged step and the same rows on the shard, to float tolerance.
- Async training with the row cache on the GPU learns and logs its hit rates.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from embedding_ps.client.cache import CachingStore
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.init import init_rows
from embedding_ps.local import LocalStore
from recsys.config import JobConfig, load_config
from recsys.training.launch import launch_train

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_a_row_cache_on_the_gpu_serves_what_the_cpu_cache_serves() -> None:
    """The same calls on a cache on the GPU and one on the CPU (each over its own store): the same
    rows at every step (hits, misses, stale hits within max_age), and the same rows in the stores
    after every push. Refresh-ahead off, so which rows are cached depends on the calls alone."""
    cfg = PSConfig(num_shards=2, tables=(TableConfig(name="a", dim=4, lr=0.1, seed=1, cache_rows=4),
                                         TableConfig(name="b", dim=4, lr=0.1, seed=2),
                                         TableConfig(name="c", dim=4, lr=0.1, seed=3, cache_rows=100)))
    caches = {d: CachingStore(LocalStore.create(cfg), cfg, max_age=2, device=d, refresh_ahead=0)
              for d in ("cpu", "cuda")}
    calls = [([0, 1, 2, 0], [ids(5, 7, 5, -3), ids(5, 2**62), ids(), ids(8, 8)]),
             ([2, 0], [ids(1, 2, 3), ids(7, 5, 6, 9, 10, 5)]),
             ([0], [ids()]),
             ([1, 0, 0], [ids(4), ids(5), ids(7, -3)]),
             ([0, 2], [ids(5, 7, 1, 2, 3), ids(1, 2, 3, 8)]),
             ([0, 2], [ids(5, 7, 11, 12), ids(8, 1)])]
    for step, (tables, parts) in enumerate(calls):
        got = {d: c.pull_many_async(tables, parts, step).result() for d, c in caches.items()}
        assert got["cuda"].device.type == "cuda" and got["cpu"].device.type == "cpu"
        assert torch.equal(got["cuda"].cpu(), got["cpu"]), step
        grads = torch.randn(got["cpu"].shape, generator=torch.Generator().manual_seed(step))
        for d, c in caches.items():
            c.push_many_async(tables, parts, grads.to(d), step).result()
    x = ids(5, 7, -3, 2**62, 1, 2, 3, 4, 6, 8, 9, 10, 11, 12)
    for t in range(3):             # every push reached the store, hits too
        assert torch.equal(caches["cuda"].inner.pull(t, x), caches["cpu"].inner.pull(t, x)), t
    stats = {d: c.cache_stats() for d, c in caches.items()}      # (hits, misses) since the last read
    assert stats["cuda"] == stats["cpu"]
    h, m = stats["cuda"]["a"]
    assert h > 0 and m > 0


def job(tmp_path: Path, data: Path, device: str, name: str, overrides: tuple[str, ...] = ()) -> JobConfig:
    return load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", "data.eval_paths=[]", "data.batch_size=64",
        "data.shuffle_buffer_rows=64", "train.max_steps=30", "train.log_every=5", "train.num_threads=1",
        f"train.run_dir='{tmp_path / name}'", f"train.device='{device}'", *overrides,
    ])


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [x["loss/train"] for x in lines if "loss/train" in x]


def test_sync_training_on_the_gpu_ends_where_the_cpu_run_ends(tmp_path: Path, tiny_dataset) -> None:
    data = tiny_dataset(rows=4000, files=2, seed=3)
    runs = {}
    for device in ("cpu", "cuda"):
        cfg = job(tmp_path, data, device, f"run-{device}", ("ps.mode='sync'",))
        launch_train(cfg)
        runs[device] = cfg
    cpu, gpu = losses(tmp_path / "run-cpu"), losses(tmp_path / "run-cuda")
    assert len(cpu) == len(gpu) >= 5
    for a, b in zip(cpu, gpu):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5), (cpu, gpu)
    dense = {d: torch.load(Path(cfg.train.run_dir) / "model" / "dense.pt", weights_only=True) for d, cfg in runs.items()}
    assert dense["cpu"].keys() == dense["cuda"].keys()
    for name, p in dense["cpu"].items():
        torch.testing.assert_close(dense["cuda"][name].cpu(), p, rtol=1e-4, atol=1e-5, msg=f"dense {name}")
    stores = {d: LocalStore.from_dir(cfg.ps, Path(cfg.train.run_dir) / "model" / "ps") for d, cfg in runs.items()}
    table = pq.read_table(data / "part-00000.parquet")
    moved = 0.0
    for t, spec in enumerate(runs["cpu"].ps.tables):
        col = table.column(spec.name).combine_chunks()
        col = pc.list_flatten(col) if pa.types.is_list(col.type) else col
        x = torch.from_numpy(pc.unique(col.drop_null()).to_numpy().astype("int64"))          # [U] the file's ids
        a, b = stores["cpu"].pull(t, x), stores["cuda"].pull(t, x)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"table {spec.name}")
        moved = max(moved, float((a - init_rows(x, spec.dim, spec.seed, spec.init, spec.init_scale)).abs().max()))
    assert moved > 1e-3          # the rows were trained


def test_async_training_with_the_row_cache_on_the_gpu_learns(tmp_path: Path, tiny_dataset) -> None:
    data = tiny_dataset(rows=20000, files=2, seed=4)
    cfg = job(tmp_path, data, "cuda", "run", ("ps.mode='async'", "ps.max_staleness=3", "train.pull_ahead_batches=2",
                                               "ps.table_defaults.cache_rows=64", "train.max_steps=150",
                                               "train.log_every=15"))
    assert dataclasses.asdict(cfg.ps)["tables"][0]["cache_rows"] == 64
    launch_train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [x for x in lines if "loss/train" in x]
    assert len(train) >= 8
    got = [x["loss/train"] for x in train]
    assert sum(got[-3:]) / 3 < sum(got[:2]) / 2 - 0.05, f"loss did not go down: {got}"
    assert max(x["cache/hit_rate"] for x in train) > 0.2


def test_ids_deduplicated_on_the_gpu_equal_the_host_dedup() -> None:
    """on_device.dedup_tables on the GPU: the CPU's unique ids (on the host), inverse indices (on the
    GPU) and counts, for tables with shared ids, an empty one and extreme int64 ids."""
    from recsys.models.on_device import dedup_tables
    g = torch.Generator().manual_seed(0)
    big = ids(2**62, -2**63, 2**63 - 1, -1, 0, -1)
    values = [torch.randint(0, 50, (5000,), generator=g), ids(), big, torch.randint(0, 50, (300,), generator=g)]
    want = dedup_tables(values, counts=True)
    got = dedup_tables([v.cuda() for v in values], counts=True)
    for k in range(len(values)):
        assert got[0][k].device.type == "cpu" and got[2][k].device.type == "cpu"
        assert got[1][k].device.type == "cuda"
        assert torch.equal(got[0][k], want[0][k]) and torch.equal(got[2][k], want[2][k])
        assert torch.equal(got[1][k].cpu(), want[1][k])


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_a_lookup_with_ids_on_the_gpu_pools_and_pushes_what_the_cpu_does(pooling: str) -> None:
    """SparseArch with device_ids on the GPU (ids, dedup, pooling there; rows and grads through
    pinned blocks on the side stream) against the CPU lookup: pooled outputs, row gradients pushed."""
    from tests.unit.recsys.models.test_sparse_arch import V, DictStore, make_batch
    from recsys.models.sparse_arch import SparseArch, plan_tables
    keys = ("a", "b", "c")
    tables = (TableConfig(name="t0", dim=8), TableConfig(name="t1", dim=8))
    plans = plan_tables(keys, tables, {"a": "t0", "b": "t1", "c": "t0"}, {}, {"t0": pooling, "t1": pooling})
    g = torch.Generator().manual_seed(3)
    dense = {t: torch.randn(V, 8, generator=g) for t in range(2)}
    w = torch.randn(64, 3, 8, generator=g)
    got = {}
    for device in ("cpu", "cuda"):
        arch = SparseArch(plans)
        if device == "cuda":
            arch.device, arch.device_ids = torch.device("cuda"), True
        store = DictStore(dense)
        for step in range(3):                 # the side stream's blocks reused across steps
            lookup = arch.lookup(make_batch(64, keys, seed=4 + step), store)
            pooled, _ = lookup.wait()
            assert pooled.device.type == device
            (pooled * w.to(device)).sum().backward()
            pending = lookup.push_start()
            futures = pending.send()
            assert all(f.done() for f in futures)
        got[device] = pooled.detach().cpu(), {t: dict(zip(i.tolist(), gr)) for t, (i, gr) in store.pushed.items()}
    torch.testing.assert_close(got["cuda"][0], got["cpu"][0], rtol=1e-5, atol=1e-6)
    for t, rows in got["cpu"][1].items():
        assert got["cuda"][1][t].keys() == rows.keys()
        for i, grad in rows.items():
            assert got["cuda"][1][t][i].device.type == "cpu"
            torch.testing.assert_close(got["cuda"][1][t][i], grad, rtol=1e-5, atol=1e-6)


def test_auto_placement_on_the_gpu_ends_where_the_cpu_run_ends(tmp_path: Path, tiny_dataset) -> None:
    """Replicated tables on the GPU (keys searched there, torch's fused optimizer) and the rest (C4, 10k
    ids > ps.replicate_max_rows 500) on 2 PS shards (rows assembled in page-locked memory), sync: the
    same losses as the CPU run."""
    data = tiny_dataset(rows=4000, files=2, seed=5)
    got = {}
    for device in ("cpu", "cuda"):
        cfg = job(tmp_path, data, device, f"auto-{device}", ("ps.mode='sync'", "ps.table_defaults.placement='auto'",
                                                             "ps.replicate_max_rows=500", "ps.num_shards=2"))
        launch_train(cfg)
        got[device] = losses(tmp_path / f"auto-{device}")
    assert len(got["cpu"]) == len(got["cuda"]) >= 5
    for a, b in zip(got["cpu"], got["cuda"]):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5), got
