"""The dense model as a `torch.export` program (`dense.pt2`), and loading it back without pickle.

    info = export_dense(cfg, model_dir / "dense.pt", out / "dense.pt2")    # -> manifest["dense"]
    scorer = load_dense(out / "dense.pt2")                                # callable
    logits = scorer(dense, pooled)             # [B, Dn], [B, F, D] -> [B]
    logits = scorer(dense, pooled, linear)     # + [B, F_lin] when the model has linear tables
    logits = scorer(dense, pooled, behaviors, mask)   # din: + rows [B, S, L, D] f32, mask [B, S, L] bool

The batch dimension is dynamic (1 .. 2**20). The program wraps the model exactly as
`Trainer.forward` calls it in eval mode (bf16 autocast when `train.autocast`), and returns float32.

No pickle: the archive's tensors are stored raw by `torch.export.save` (plain tensors), its
example inputs are removed before saving, and `load_dense` refuses an archive that holds a pickled
payload (a weight or constant marked `use_pickle`, a custom or opaque object, or non-empty
example inputs, which torch would unpickle) before handing it to `torch.export.load`.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
import zipfile
from pathlib import Path

import torch
from torch import nn

from recsys.config import JobConfig
from recsys.manifest import sha256_file
from recsys.serving.errors import ExportError
from recsys.models import build_job_model, build_sparse_arch

logger = logging.getLogger(__name__)

MAX_BATCH = 1 << 20


class Scorer(nn.Module):
    """The dense model as served: (dense [B, Dn], pooled [B, F, D][, linear [B, F_lin]]) -> logits [B] f32."""

    def __init__(self, model: nn.Module, autocast: bool) -> None:
        super().__init__()
        self.model = model
        self.autocast = autocast

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor, linear: torch.Tensor | None = None) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(dense, pooled, linear)                          # [B]
        return logits.float()


class SequenceScorer(Scorer):
    """din as served: (dense, pooled, behaviors [B, S, L, D], mask bool [B, S, L]) -> logits [B] f32."""

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor, behaviors: torch.Tensor,   # type: ignore[override]
                mask: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(dense, pooled, None, behaviors, mask)                # [B]
        return logits.float()


def export_dense(cfg: JobConfig, state_dict_path: Path, out_path: Path) -> dict:
    """Write `dense.pt2`; returns what a server needs to build its inputs (the manifest's "dense")."""
    sparse, model = build_job_model(cfg)
    try:
        state = torch.load(state_dict_path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as e:
        raise ExportError(f"{state_dict_path}: unreadable dense state ({e})") from None
    model.load_state_dict(state)
    info, args = program_inputs(cfg, sparse)
    export_program((SequenceScorer if sparse.sequences else Scorer)(model, cfg.train.autocast).eval(), args, out_path)
    return info


def export_program(module: nn.Module, args: tuple[torch.Tensor, ...], out_path: Path) -> None:
    """`module` traced by torch.export on `args`, dim 0 of every input a batch of 1..MAX_BATCH, saved
    to `out_path` (the dense program, the user tower)."""
    from torch.export import Dim           # imports torch._dynamo (slow: figures-from-the-code.md): only when tracing

    B = Dim("batch", min=1, max=MAX_BATCH)
    with torch.no_grad():
        program = torch.export.export(module, args, dynamic_shapes=tuple({0: B} for _ in args))
    program._example_inputs = None              # saved with torch.save (pickle) otherwise
    with warnings.catch_warnings():             # parameters sharing storage: harmless on CPU
        warnings.filterwarnings("ignore", message="No complete tensor found")
        torch.export.save(program, out_path)


def save_program(cfg: JobConfig, model_dir: Path) -> None:
    """A model directory's own program (`train.save_program`): MODEL_DIR/dense.pt2 traced from its
    dense.pt, and PROGRAM_OF naming that dense.pt by its hash (`dense_program` copies it)."""
    export_dense(cfg, model_dir / "dense.pt", model_dir / "dense.pt2")
    (model_dir / PROGRAM_OF).write_text(json.dumps({"dense_sha256": sha256_file(model_dir / "dense.pt")}))


def program_inputs(cfg: JobConfig, sparse) -> tuple[dict, tuple[torch.Tensor, ...]]:
    """The manifest's "dense" section and example inputs (batch 2) of the program of `cfg`'s model."""
    pooled_plans = [p for p in sparse.plans if not p.linear]
    F = sum(len(p.features) for p in pooled_plans)
    F_lin = sum(len(p.features) for p in sparse.plans if p.linear)
    D, S, L = pooled_plans[0].dim, len(sparse.sequences), cfg.model.max_seq_len
    specs = [("dense", [len(cfg.data.dense_columns)]), ("pooled", [F, D])] + ([("linear", [F_lin])] if F_lin else [])
    if S:              # din: the behavior lists' rows per position and their mask (recsys.models.sequence)
        specs += [("behaviors", [S, L, D]), ("mask", [S, L])]
    args = tuple(torch.ones(2, *s, dtype=torch.bool) if n == "mask" else torch.zeros(2, *s) for n, s in specs)
    inputs = [{"name": n, "shape": ["B", *s], **({"dtype": "bool"} if n == "mask" else {})} for n, s in specs]
    info = {"file": "dense.pt2", "arch": cfg.model.arch, "inputs": inputs, "output": "logits [B] float32",
            "max_batch": MAX_BATCH, "autocast_bf16": cfg.train.autocast}
    return info, args


PROGRAM_OF = "dense.pt2.json"
"""Beside a model directory's dense.pt2 (`train.save_program`): {"dense_sha256"} of the dense.pt it
was traced from, so a program left from an earlier save of that directory is never taken for this one."""


def dense_program(cfg: JobConfig, model_dir: Path, out_path: Path) -> dict:
    """`out_path` = the dense program of `model_dir`: a copy of the one its trainer saved with it
    (`train.save_program`) when that was traced from this dense.pt, else `export_dense`."""
    saved, of = model_dir / "dense.pt2", model_dir / PROGRAM_OF
    try:
        fresh = saved.is_file() and json.loads(of.read_text())["dense_sha256"] == sha256_file(model_dir / "dense.pt")
    except (OSError, ValueError, KeyError, TypeError):
        fresh = False
    if not fresh:
        return export_dense(cfg, model_dir / "dense.pt", out_path)
    check_no_pickle(saved)
    shutil.copyfile(saved, out_path)
    return program_inputs(cfg, build_sparse_arch(cfg))[0]


def check_no_pickle(path: Path) -> None:
    """Raise ExportError if the pt2 archive at `path` holds anything torch.export.load would unpickle."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ExportError(f"{path}: not a pt2 archive ({e})") from None
    with zf:
        for info in zf.infolist():
            name = info.filename
            if "/data/sample_inputs/" in name and info.file_size:
                raise ExportError(f"{path}: {name}: example inputs are a pickle; refusing to load")
            if "/data/constants/" in name and any(p in name.rsplit("/", 1)[-1] for p in ("custom_obj", "opaque")):
                raise ExportError(f"{path}: {name}: a pickled object constant; refusing to load")
            if name.endswith("_config.json") and "/data/" in name:
                config = json.loads(zf.read(name))
                bad = [k for k, v in config.get("config", {}).items() if v.get("use_pickle")]
                if bad:
                    raise ExportError(f"{path}: {name}: {bad[0]!r} is stored as a pickle; refusing to load")


class FastScorer:
    """Runs the exported program's own (lifted) graph without `.module()`'s per-call cost at B = 1 (sympy
    checks of the shape constraints in forward pre-hooks, parameters fetched through `nn.Module.__getattr__`
    chains, a `wrap_with_autocast` op; benchmarks/history/figures-from-the-code.md): `graph_module` called
    with the parameters and buffers fetched once at load, disabled autocasts inlined, one check of the batch
    size and each input's trailing shape. Same graph, kernels and results (test_export.py compares)."""

    def __init__(self, gm: nn.Module, lifted: list[torch.Tensor], shapes: list[tuple[int, ...]]) -> None:
        self.gm, self.lifted, self.shapes = gm, lifted, shapes

    @classmethod
    def of(cls, program: torch.export.ExportedProgram) -> "FastScorer | None":
        """A FastScorer for a program of lifted inputs then user inputs and one user output, else None."""
        from torch.export.graph_signature import InputKind, OutputKind

        sig = program.graph_signature
        kinds = [spec.kind for spec in sig.input_specs]
        user = kinds.count(InputKind.USER_INPUT)
        if (kinds[len(kinds) - user:] != [InputKind.USER_INPUT] * user
                or [o.kind for o in sig.output_specs] != [OutputKind.USER_OUTPUT]):
            return None
        lifted = []
        for spec in sig.input_specs[:len(kinds) - user]:
            value = program.state_dict.get(spec.target, program.constants.get(spec.target))
            if not isinstance(value, torch.Tensor):
                return None
            lifted.append(value.detach())
        metas = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
        shapes = [tuple(int(d) for d in metas[spec.arg.name].shape[1:]) for spec in sig.input_specs[len(kinds) - user:]]
        _inline_disabled_autocast(program.graph_module)
        return cls(program.graph_module, lifted, shapes)

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        B = args[0].shape[0]
        if len(args) != len(self.shapes) or not 1 <= B <= MAX_BATCH or any(
                a.shape[0] != B or tuple(a.shape[1:]) != s for a, s in zip(args, self.shapes)):
            raise ValueError(f"dense program inputs: expected shapes {[('B',) + s for s in self.shapes]} "
                             f"with 1 <= B <= {MAX_BATCH}, got {[tuple(a.shape) for a in args]}")
        return self.gm.forward(*self.lifted, *args)[0]


def _inline_disabled_autocast(gm: nn.Module) -> None:
    """Replace `wrap_with_autocast(device, dtype, False, cache, f, *args)` nodes by `f(*args)`."""
    hop, graph = torch.ops.higher_order.wrap_with_autocast, gm.graph
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is hop and n.args[2] is False
             and getattr(n.args[4], "op", None) == "get_attr"]
    for node in nodes:
        with graph.inserting_before(node):
            call = graph.call_module(node.args[4].target, tuple(node.args[5:]))
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    if nodes:
        graph.eliminate_dead_code()
        gm.recompile()


def load_dense(path: Path, fast: bool = True) -> "nn.Module | FastScorer":
    """The exported scorer as a callable (after the pickle check): a `FastScorer` of the program,
    or its `.module()` (with `fast=False`, or for a program FastScorer does not handle)."""
    check_no_pickle(path)
    program = torch.export.load(path)
    scorer = FastScorer.of(program) if fast else None
    return scorer if scorer is not None else program.module()
