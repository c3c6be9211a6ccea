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
import warnings
import zipfile
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim

from recsys.config import JobConfig
from recsys.serving.tensorfile import ExportError
from recsys.models import build_job_model

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
    """din as served: (dense [B, Dn], pooled [B, F, D], behaviors [B, S, L, D], mask bool [B, S, L]) -> logits [B] f32."""

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
    model.eval()
    pooled_plans = [p for p in sparse.plans if not p.linear]
    F = sum(len(p.features) for p in pooled_plans)
    F_lin = sum(len(p.features) for p in sparse.plans if p.linear)
    D = pooled_plans[0].dim
    Dn = len(cfg.data.dense_columns)
    B = Dim("batch", min=1, max=MAX_BATCH)
    args: tuple[torch.Tensor, ...] = (torch.zeros(2, Dn), torch.zeros(2, F, D))
    if F_lin:
        args += (torch.zeros(2, F_lin),)
    S, L = len(getattr(sparse, "sequences", ())), cfg.model.max_seq_len
    if S:              # din: the behavior lists' rows per position and their mask (recsys.models.sequence)
        args += (torch.zeros(2, S, L, D), torch.ones(2, S, L, dtype=torch.bool))
    scorer = (SequenceScorer if S else Scorer)(model, cfg.train.autocast).eval()
    with torch.no_grad():
        program = torch.export.export(scorer, args, dynamic_shapes=tuple({0: B} for _ in args))
    program._example_inputs = None              # saved with torch.save (pickle) otherwise
    with warnings.catch_warnings():             # parameters sharing storage: harmless on CPU
        warnings.filterwarnings("ignore", message="No complete tensor found")
        torch.export.save(program, out_path)
    inputs = [{"name": "dense", "shape": ["B", Dn]}, {"name": "pooled", "shape": ["B", F, D]}]
    if F_lin:
        inputs.append({"name": "linear", "shape": ["B", F_lin]})
    if S:
        inputs += [{"name": "behaviors", "shape": ["B", S, L, D]}, {"name": "mask", "shape": ["B", S, L], "dtype": "bool"}]
    return {"file": out_path.name, "arch": cfg.model.arch, "inputs": inputs, "output": "logits [B] float32",
            "max_batch": MAX_BATCH, "autocast_bf16": cfg.train.autocast}


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


def load_dense(path: Path) -> nn.Module:
    """The exported scorer as a callable module (after the pickle check)."""
    check_no_pickle(path)
    return torch.export.load(path).module()
