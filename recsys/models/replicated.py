"""Replicated tables: small-vocabulary embedding tables trained on every trainer as dense parameters
(`placement = "replicated"`, or `"auto"` resolved here from the training data by `resolve_placement`;
the rule, and how such a table trains: docs/config.md, `placement`). Every trainer holds it whole::

    keys    int64 [R]       its vocabulary: the distinct ids of the training data, sorted
    weight  float32 [R, D]  row r is id keys[r]; an nn.Parameter trained by a torch optimizer

A batch's ids become row indices by a binary search in `keys`; the sparse arch pools them from
`weight` with the same kernels as pulled rows, so autograd gives a dense [R, D] gradient, which DDP
all-reduces with the dense model's (the table sits in the module DDP wraps, `TrainModules`). The
optimizer (`TableOptimizer`) updates every row every step, as torch's optimizers do for an
`nn.Embedding` (its weight decay and Adam moments act on all rows), where the PS updates only the
touched rows. In sync mode W trainers equal one process on the global batch, like PS tables.

An id outside the vocabulary gets the table's `unadmitted` default row (the deterministic init row
of (seed, id), or zeros), untrained. The vocabulary is fixed for the run: it is saved with the
weights (`model/replicated.pt`: `NAME.ids`, `NAME.weight`) and a resumed run keeps it (ids new in
the data then resolve to the default row; a table whose data grew past its vocabulary is retrained,
or warm-started, with a new run).
"""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import numpy as np
import torch
from torch import nn

from data.vocab import distinct_ids
from embedding_ps.wire.config import TableConfig
from embedding_ps.init import init_rows
from embedding_ps.store import RowSource, pull_each
from recsys import eager_optim, storage
from recsys.config import ConfigError, JobConfig
from recsys.rundir import run_path
from recsys.table_plans import table_plans

logger = logging.getLogger(__name__)

REPLICATED_FILE = "replicated.pt"
"""The replicated tables' ids and weights in a model directory (beside dense.pt)."""

_STATE_COPIES = {"sgd": 0, "adagrad": 1, "adam": 2}
"""fp32 [R, D] optimizer state tensors per optimizer (row-wise Adagrad: one float a row)."""


# ---------------------------------------------------------------------------------------------
# which tables, and their vocabularies


def table_bytes(tc: TableConfig, rows: int) -> int:
    """fp32 bytes a replicated table takes on a trainer: weight, gradient and optimizer state."""
    per_row = tc.dim * (2 + _STATE_COPIES.get(tc.optimizer, 0)) + (1 if tc.optimizer == "rowwise_adagrad" else 0)
    return 4 * rows * per_row


def vocabularies(cfg: JobConfig, names: Iterable[str]) -> dict[str, np.ndarray]:
    """Table name -> sorted distinct ids [R] of the data.sparse_columns that read it (embedding and
    first-order lookups), over data.train_paths."""
    names = list(names)
    if not names:
        return {}
    by_table: dict[str, set[str]] = {}
    for plan in table_plans(cfg)[0]:
        by_table.setdefault(plan.name, set()).update(cfg.data.sparse_columns[f] for f in plan.features)
    columns = sorted({c for n in names for c in by_table.get(n, ())})
    per_column = distinct_ids(cfg.data, cfg.data.train_paths, columns)
    parts = {n: [per_column[c] for c in by_table.get(n, ())] for n in names}
    return {n: np.unique(np.concatenate(p)) if p else np.zeros(0, np.int64) for n, p in parts.items()}


@dataclasses.dataclass(frozen=True)
class Placement:
    """`resolve_placement`'s answer: the config with every table's placement `ps` or `replicated`."""

    config: JobConfig
    vocab: dict[str, np.ndarray]          # replicated table -> its ids
    report: dict[str, dict]               # table -> {"placement", "rows", "bytes", "why"}


def resolve_placement(cfg: JobConfig) -> Placement:
    """Decide `auto` tables from the training data's distinct ids, before any process starts.

    Raises ConfigError when the `replicated` tables alone do not fit ps.replicate_max_bytes."""
    ps = cfg.ps
    eligible = [t for t in ps.tables if t.placement == "replicated" or _why_ps(t) is None]
    vocab = vocabularies(cfg, [t.name for t in eligible])
    report: dict[str, dict] = {}
    budget, used, max_rows = ps.replicate_max_bytes, 0, ps.replicate_max_rows
    # the `replicated` tables first (in config order), then the `auto` ones, smallest first
    for t in sorted(eligible, key=lambda t: -1 if t.placement == "replicated" else table_bytes(t, vocab[t.name].size)):
        rows, size = int(vocab[t.name].size), table_bytes(t, vocab[t.name].size)
        if t.placement == "replicated" or (rows <= max_rows and used + size <= budget):
            used += size
            if used > budget:          # only a `replicated` table gets here
                raise ConfigError(
                    f"ps.tables[{t.name}].placement = 'replicated': {rows} distinct ids in "
                    f"data.train_paths take {size} bytes on each trainer (weight, gradient, optimizer state); "
                    f"the replicated tables need {used} > ps.replicate_max_bytes = {budget} (raise it, or "
                    f"set placement = 'ps' or 'auto')")
            why = f"auto: {rows} ids <= {max_rows}" if t.placement == "auto" else "placement = 'replicated'"
            report[t.name] = {"placement": "replicated", "rows": rows, "bytes": size, "why": why}
        else:
            why = (f"{rows} distinct ids > ps.replicate_max_rows = {max_rows}" if rows > max_rows
                   else f"{size} bytes would pass ps.replicate_max_bytes = {budget} ({used} used)")
            report[t.name] = {"placement": "ps", "rows": rows, "why": f"auto: {why}"}
    tables = []
    for t in ps.tables:
        entry = report.setdefault(t.name, {"placement": "ps", "why": _why_ps(t)})
        tables.append(dataclasses.replace(t, placement=entry["placement"]))
    new = dataclasses.replace(cfg, ps=dataclasses.replace(ps, tables=tuple(tables)))
    keep = {n: v for n, v in vocab.items() if report[n]["placement"] == "replicated"}
    return Placement(new, keep, report)


def _why_ps(t: TableConfig) -> str | None:
    """Why a `ps` or `auto` table trains on the PS whatever its size; None: `auto` may replicate it."""
    if t.placement == "ps":
        return "placement = 'ps'"
    if t.optimizer == "ftrl":
        return "auto: optimizer 'ftrl' trains on the PS only"
    if t.kind != "dynamic":
        return "auto: a hashed table trains on the PS"
    if t.cache_rows:
        return "auto: cache_rows is set (a PS row cache)"
    if t.ttl_steps or t.max_rows:
        return "auto: ttl_steps / max_rows age rows out on the PS"
    return None


def log_placement(report: dict[str, dict]) -> None:
    """One line: where each table trains."""
    rep = [f"{n} ({e['rows']} rows)" if "rows" in e else n for n, e in report.items() if e["placement"] == "replicated"]
    ps = [n for n, e in report.items() if e["placement"] == "ps"]
    logger.info("table placement: replicated on the trainers: %s; on the PS: %s",
                ", ".join(rep) or "none", ", ".join(ps) or "none")


# ---------------------------------------------------------------------------------------------
# the tables


class ReplicatedTables(nn.Module):
    """Every replicated table of a job: `keys[name]` int64 [R] and `weight[name]` float32 [R, D]."""

    def __init__(self, tables: dict[str, TableConfig], vocab: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.configs = dict(tables)
        self.weight = nn.ParameterDict()
        self.keys: dict[str, torch.Tensor] = {}
        self.grown: dict[str, torch.Tensor] = {}     # warm start: saved row i is now row grown[name][i]
        self._keys_on: dict[tuple[str, torch.device], torch.Tensor] = {}   # keys copied to a device (`rows`)
        for name, tc in self.configs.items():
            keys = torch.from_numpy(np.ascontiguousarray(vocab[name], dtype=np.int64))
            self.keys[name] = keys
            self.weight[name] = nn.Parameter(init_rows(keys, tc.dim, tc.seed, tc.init, tc.init_scale))

    def grow_from(self, state: dict[str, torch.Tensor]) -> None:
        """Warm start: every table's vocabulary becomes the union of the saved one and its own (the new
        data's ids), the saved rows kept, new ids at their init rows. `grown[name]` maps the saved rows
        to their new positions (for the optimizer state, `TableOptimizer.load_state_dict`). Before DDP
        wraps the tables (their shapes change). Tables the state lacks keep their fresh rows."""
        for name, tc in self.configs.items():
            if f"{name}.ids" not in state:
                continue
            saved_ids, saved = state[f"{name}.ids"].to(torch.int64), state[f"{name}.weight"].float()
            if saved.dim() != 2 or saved.shape != (saved_ids.numel(), tc.dim):
                raise ValueError(f"replicated table {name!r} saved as {tuple(saved.shape)}, config dim {tc.dim}")
            keys = torch.from_numpy(np.union1d(saved_ids.numpy(), self.keys[name].numpy()))
            weight = init_rows(keys, tc.dim, tc.seed, tc.init, tc.init_scale)
            pos = torch.searchsorted(keys, saved_ids)
            weight[pos] = saved
            self.keys[name] = keys
            self._keys_on.clear()
            self.weight[name].data = weight.to(self.weight[name].device)
            self.grown[name] = pos

    def rows(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [R + E, D], index [N] into them) of ids [N]: the table's weight, plus, when some ids are
        not in the vocabulary, their E distinct default rows (not trained) after it."""
        weight, extra, pos = self.rows_parts(name, ids)
        return (weight if extra is None else torch.cat([weight, extra])), pos

    def rows_parts(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """`rows` before the concatenation: (weight [R, D] (the parameter itself), the E default rows
        [E, D] on its device or None, index [N]); the sparse arch joins them when the step reads them
        (after the previous step's optimizer update of the weight, on the compute stream)."""
        return self.rows_parts_many([(name, ids)])[0]

    def rows_parts_many(self, items: Sequence[tuple[str, torch.Tensor]]
                        ) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
        """`rows_parts` of several (table name, ids [N]) at once: whether each table's ids all hit its
        vocabulary is read back in one go (ids on a GPU: one wait for all of them, not one a table)."""
        found = []
        for name, ids in items:
            keys = self.keys[name]
            if keys.device != ids.device:        # ids on the GPU (SparseArch.device_ids): search there
                keys = self._keys_on.get((name, ids.device))
                if keys is None:
                    keys = self._keys_on[(name, ids.device)] = self.keys[name].to(ids.device)
            if keys.numel() == 0:
                found.append((torch.zeros_like(ids), torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)))
                continue
            pos = torch.searchsorted(keys, ids).clamp_(max=keys.numel() - 1)     # [N]
            found.append((pos, keys.index_select(0, pos) == ids))
        all_hit = torch.stack([hit.all() for _, hit in found]).tolist() if found else []
        return [self._with_defaults(name, ids, pos, hit, ok)
                for (name, ids), (pos, hit), ok in zip(items, found, all_hit)]

    def _with_defaults(self, name: str, ids: torch.Tensor, pos: torch.Tensor, hit: torch.Tensor, all_hit: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(weight, default rows of the ids that missed or None, index [N]) from a vocabulary search."""
        weight, R = self.weight[name], self.keys[name].numel()
        if all_hit:
            return weight, None, pos.to(weight.device) if weight.device != pos.device else pos
        miss_ids, inv = torch.unique(ids[~hit], return_inverse=True)             # [E], [N_miss]
        pos = pos.clone()
        pos[~hit] = R + inv
        tc = self.configs[name]
        if tc.unadmitted == "zeros":
            extra = torch.zeros(miss_ids.numel(), tc.dim)
        else:
            extra = init_rows(miss_ids.cpu(), tc.dim, tc.seed, tc.init, tc.init_scale)
        return weight, extra.to(weight.device, weight.dtype), pos.to(weight.device)

    def state(self) -> dict[str, torch.Tensor]:
        """`NAME.ids` and `NAME.weight` of every table (what model/replicated.pt holds)."""
        out = {}
        for name in self.configs:
            out[f"{name}.ids"] = self.keys[name].clone()
            out[f"{name}.weight"] = self.weight[name].detach().cpu().clone()
        return out

    def load_state(self, state: dict[str, torch.Tensor], where: str = "") -> None:
        """Take the saved vocabulary and weights (shapes may differ from the fresh ones: the saved
        vocabulary wins). Raises ValueError naming the table when one is missing or its dim differs."""
        for name, tc in self.configs.items():
            if f"{name}.ids" not in state or f"{name}.weight" not in state:
                raise ValueError(f"{where}: replicated table {name!r} is not saved there (was it on the PS "
                                 f"in that run? its placement cannot change on resume)")
            keys, weight = state[f"{name}.ids"].to(torch.int64), state[f"{name}.weight"].float()
            if weight.dim() != 2 or weight.shape[1] != tc.dim or weight.shape[0] != keys.numel():
                raise ValueError(f"{where}: replicated table {name!r} is saved as {tuple(weight.shape)} with "
                                 f"{keys.numel()} ids; the config says dim {tc.dim}")
            self.keys[name] = keys.contiguous()
            self._keys_on.clear()
            param = self.weight[name]
            if param.shape == weight.shape:
                param.data.copy_(weight)
            else:          # before DDP wraps the table (its buckets are sized by the shapes)
                param.data = weight.to(param.device).contiguous()


def save_bytes(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def load_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(data), weights_only=True)


def read_replicated(model_dir) -> dict[str, torch.Tensor] | None:  # noqa: ANN001 (a Path or a URI string)
    """MODEL_DIR/replicated.pt (a local path or URI) as tensors, or None when the model has none."""
    path = run_path(model_dir, REPLICATED_FILE)
    return load_bytes(storage.read_bytes(path)) if storage.is_file(path) else None


# ---------------------------------------------------------------------------------------------
# the optimizer


class _RowwiseAdagrad(eager_optim.Optimizer):
    """fbgemm's EXACT_ROWWISE_ADAGRAD on a dense table: h += mean(g*g) per row; w -= lr g / (sqrt(h) + eps)."""

    def __init__(self, params, lr: float, eps: float, initial_accumulator: float, weight_decay: float) -> None:
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator": initial_accumulator,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if group["weight_decay"]:
                    g = g.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                if "sum_sq" not in state:
                    state["sum_sq"] = torch.full((p.shape[0],), float(group["initial_accumulator"]),
                                                 dtype=torch.float32, device=p.device)
                h = state["sum_sq"]
                h.add_(g.pow(2).mean(dim=1))
                p.addcdiv_(g, (h.sqrt() + group["eps"]).unsqueeze(1), value=-group["lr"])
        return None


class TableOptimizer:
    """One torch optimizer per replicated table, by its TableConfig (applied to every row every step).

    sgd / adagrad / adam are torch.optim.SGD / Adagrad / Adam; rowwise_adagrad is fbgemm's row-wise
    Adagrad. Weight decay: `l2` is the optimizer's own weight_decay (wd * w added to the gradient);
    `decoupled` and `global` scale the whole table by (1 - lr * wd) before the update (AdamW's form;
    for a table updated every step the PS's "global" decay is this)."""

    def __init__(self, tables: ReplicatedTables) -> None:
        self.tables = tables
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        for name, tc in tables.configs.items():
            p = [tables.weight[name]]
            wd = tc.weight_decay if tc.weight_decay_mode == "l2" else 0.0
            # on a GPU, torch's fused kernels: one launch a step for the table (sgd / adam)
            fused = {"fused": True} if p[0].device.type == "cuda" else {}
            if tc.optimizer == "sgd":
                opt = eager_optim.SGD(p, lr=tc.lr, weight_decay=wd, **fused)
            elif tc.optimizer == "adagrad":
                opt = eager_optim.Adagrad(p, lr=tc.lr, eps=tc.eps, weight_decay=wd,
                                          initial_accumulator_value=tc.initial_accumulator)
            elif tc.optimizer == "adam":
                opt = eager_optim.Adam(p, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, weight_decay=wd, **fused)
            elif tc.optimizer == "rowwise_adagrad":
                opt = _RowwiseAdagrad(p, lr=tc.lr, eps=tc.eps, initial_accumulator=tc.initial_accumulator,
                                      weight_decay=wd)
            else:
                raise ValueError(f"ps.tables[{name}]: optimizer {tc.optimizer!r} cannot train a replicated table")
            self.optimizers[name] = opt

    @torch.no_grad()
    def step(self) -> None:
        for name, opt in self.optimizers.items():
            tc = self.tables.configs[name]
            if tc.weight_decay and tc.weight_decay_mode != "l2":
                self.tables.weight[name].mul_(1.0 - tc.lr * tc.weight_decay)
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict, remap: dict[str, torch.Tensor] | None = None) -> None:
        """Load each table's optimizer state; `remap[name]` (a warm start's grown vocabulary) puts the
        saved rows' state at their new positions, new rows at the optimizer's initial state."""
        for name, opt in self.optimizers.items():
            if name not in state:
                logger.warning("replicated table %s: no optimizer state saved; it starts fresh", name)
                continue
            st = state[name]
            if remap and name in remap:
                st = _remapped(st, remap[name], self.tables.weight[name].shape[0], self.tables.configs[name])
            opt.load_state_dict(st)


def _remapped(state: dict, pos: torch.Tensor, rows: int, tc: TableConfig) -> dict:
    """A torch optimizer state_dict whose per-row tensors [R_old, ...] become [rows, ...] with row i at pos[i]."""
    out = {"param_groups": state["param_groups"], "state": {}}
    for key, per_param in state["state"].items():
        new = {}
        for k, v in per_param.items():
            if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == pos.numel():
                fill = tc.initial_accumulator if k in ("sum", "sum_sq") else 0.0
                grown = torch.full((rows, *v.shape[1:]), fill, dtype=v.dtype)
                grown[pos] = v
                v = grown
            new[k] = v
        out["state"][key] = new
    return out


def build_replicated(cfg: JobConfig, state: dict[str, torch.Tensor] | None = None,
                     grow: bool = False) -> ReplicatedTables | None:
    """The job's replicated tables (None without any): from `state` (a saved model/replicated.pt: a
    resumed run, or eval), or with vocabularies read from data.train_paths; with `grow` (a warm start)
    both: the data's vocabularies joined with the saved ones (`ReplicatedTables.grow_from`)."""
    if any(t.placement == "auto" for t in cfg.ps.tables):
        raise ValueError("resolve_placement(cfg) first: the config still has placement = 'auto' tables")
    configs = {t.name: t for t in cfg.ps.tables if t.placement == "replicated"}
    if not configs:
        return None
    if state is not None and not grow:
        vocab = {n: state[f"{n}.ids"].numpy() if f"{n}.ids" in state else np.zeros(0, np.int64) for n in configs}
        tables = ReplicatedTables(configs, vocab)
        tables.load_state(state)
        return tables
    tables = ReplicatedTables(configs, vocabularies(cfg, configs))
    if state is not None:
        tables.grow_from(state)
    return tables


__all__ = ["REPLICATED_FILE", "Placement", "ReplicatedStore", "ReplicatedTables", "TableOptimizer", "TrainModules",
           "build_replicated", "read_replicated",
           "load_bytes", "log_placement", "resolve_placement", "save_bytes",
           "table_bytes", "vocabularies"]


class TrainModules(nn.Module):
    """What DDP wraps: the dense model and the replicated tables, so one ring-allreduce (DDP's buckets)
    averages both gradients. Its forward is the dense model's; the tables are used by the sparse arch
    before it (their gradients still reach DDP's hooks in the same backward)."""

    def __init__(self, model: nn.Module, replicated: ReplicatedTables | None) -> None:
        super().__init__()
        self.model = model
        self.replicated = replicated

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003 (the dense model's signature)
        return self.model(*args, **kwargs)


class ReplicatedStore:
    """A `RowSource` that serves the replicated tables from `tables` (rows as they are, no gradient)
    and everything else from `inner`: for code that pulls rows by table index rather than through a
    sparse arch (two-tower's item corpus for retrieval eval and export)."""

    def __init__(self, inner: RowSource, tables: ReplicatedTables, names: Sequence[str]) -> None:
        self.inner, self.tables = inner, tables
        self.local = {i: n for i, n in enumerate(names) if n in tables.configs}

    def pull(self, table: int, ids: torch.Tensor, step: int | None = None) -> torch.Tensor:
        if table not in self.local:
            return self.inner.pull(table, ids, step)
        with torch.no_grad():
            rows, idx = self.tables.rows(self.local[table], ids)
            return rows.index_select(0, idx.to(rows.device)).cpu()

    def pull_many_async(self, tables, ids, step=None, **kwargs):  # noqa: ANN001, ANN003 (the Protocol's)
        if not any(t in self.local for t in tables):
            return self.inner.pull_many_async(tables, ids, step, **kwargs)
        return pull_each(self, tables, ids, step)

    @property
    def step(self) -> int:
        return self.inner.step

    def barrier(self, step: int) -> None:
        self.inner.barrier(step)

    def barrier_async(self, step: int) -> Future:
        return self.inner.barrier_async(step)

    def stats(self) -> list[dict]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()
