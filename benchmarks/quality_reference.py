"""Plain-PyTorch LR, FM and DeepFM on one-id Parquet columns: the reference `quality.py` compares our CLI with.

What a practitioner writes in 200 lines, and what issue #26's 0.951 came from:

- every field an `nn.Embedding` over the distinct ids of the training file (+ row 0 for an id not in
  it: it keeps its init, shrunk by the penalty), a dim-1 one for the first-order weights;
- LR: bias + sum_f w_f(id); FM: LR + sum_{i<j} <v_i, v_j>; DeepFM: FM + an MLP over the
  concatenated embeddings (Linear -> BatchNorm -> ReLU -> Dropout per hidden layer, then Linear to 1);
- loss: mean BCE + l2 * (sum of the squares of every embedding table, whole tables, every step);
- one `torch.optim.Adam(lr)` on everything; one epoch after another, validation logloss after each,
  stop after `patience` epochs without a new best, the best epoch's weights score the test file.

Never imported by the product packages (recsys, data, embedding_ps).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import torch
from torch import nn

from recsys.metrics import auc


@dataclass(frozen=True, kw_only=True)
class RefConfig:
    arch: str                      # "lr" | "fm" | "deepfm"
    dim: int = 16
    hidden: tuple[int, ...] = (64, 32)
    dropout: float = 0.2
    lr: float = 1e-3
    l2: float = 0.01
    init_std: float = 0.01
    batch_size: int = 256
    max_epochs: int = 30
    patience: int = 2
    seed: int = 0


def read_split(paths: list[str], fields: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """ids int64 [N, F], labels float32 [N] of Parquet files."""
    t = [pq.read_table(p, columns=["label", *fields]) for p in paths]
    ids = np.stack([np.concatenate([x.column(f).to_numpy() for x in t]) for f in fields], 1)
    return ids, np.concatenate([x.column("label").to_numpy() for x in t]).astype(np.float32)


class Vocab:
    """Per field: the sorted distinct training ids; id -> 1 + its position, unseen -> 0."""

    def __init__(self, train_ids: np.ndarray) -> None:
        self.keys = [np.unique(train_ids[:, f]) for f in range(train_ids.shape[1])]

    def sizes(self) -> list[int]:
        return [len(k) + 1 for k in self.keys]

    def index(self, ids: np.ndarray) -> torch.Tensor:
        out = np.zeros(ids.shape, np.int64)
        for f, keys in enumerate(self.keys):
            pos = np.clip(np.searchsorted(keys, ids[:, f]), 0, len(keys) - 1)
            out[:, f] = np.where(keys[pos] == ids[:, f], pos + 1, 0)
        return torch.from_numpy(out)


class RefModel(nn.Module):
    def __init__(self, cfg: RefConfig, sizes: list[int]) -> None:
        super().__init__()
        self.arch = cfg.arch
        self.linear = nn.ModuleList(nn.Embedding(n, 1) for n in sizes)
        self.bias = nn.Parameter(torch.zeros(1))
        self.emb = nn.ModuleList(nn.Embedding(n, cfg.dim) for n in sizes) if cfg.arch != "lr" else nn.ModuleList()
        for e in (*self.linear, *self.emb):
            nn.init.normal_(e.weight, std=cfg.init_std)
        self.mlp = None
        if cfg.arch == "deepfm":
            layers, width = [], len(sizes) * cfg.dim
            for h in cfg.hidden:
                layers += [nn.Linear(width, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(cfg.dropout)]
                width = h
            self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x int64 [B, F] -> logits [B]."""
        out = self.bias + sum(t(x[:, f]).squeeze(1) for f, t in enumerate(self.linear))       # [B]
        if self.arch == "lr":
            return out
        v = torch.stack([t(x[:, f]) for f, t in enumerate(self.emb)], 1)                 # [B, F, D]
        out = out + 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)                     # FM
        if self.mlp is not None:
            out = out + self.mlp(v.flatten(1)).squeeze(1)
        return out

    def penalty(self) -> torch.Tensor:
        """Sum of squares of every embedding table, whole."""
        return sum(t.weight.pow(2).sum() for t in (*self.linear, *self.emb))


@torch.no_grad()
def _score(model: RefModel, x: torch.Tensor, y: np.ndarray) -> tuple[float, float]:
    """(AUC, logloss) of the model on x [N, F], labels y [N]."""
    model.eval()
    p = torch.cat([torch.sigmoid(model(x[i:i + 8192])) for i in range(0, len(x), 8192)]).double().numpy()
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return auc(y, p), float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def train_reference(cfg: RefConfig, fields: tuple[str, ...], train: list[str], val: list[str],
                    test: list[str]) -> dict:
    """Trains and early-stops on validation logloss; returns the best epoch's test AUC and logloss."""
    torch.manual_seed(cfg.seed)
    (tr_ids, tr_y), (va_ids, va_y), (te_ids, te_y) = (read_split(p, fields) for p in (train, val, test))
    vocab = Vocab(tr_ids)
    xtr, xva, xte = vocab.index(tr_ids), vocab.index(va_ids), vocab.index(te_ids)
    ytr = torch.from_numpy(tr_y)
    model = RefModel(cfg, vocab.sizes())
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    g = torch.Generator().manual_seed(cfg.seed)
    best, best_state, since, epochs = math.inf, None, 0, 0
    for epoch in range(cfg.max_epochs):
        model.train()
        perm = torch.randperm(len(xtr), generator=g)
        for i in range(0, len(perm) - cfg.batch_size + 1, cfg.batch_size):     # drop_last (batch norm)
            b = perm[i:i + cfg.batch_size]
            loss = nn.functional.binary_cross_entropy_with_logits(model(xtr[b]), ytr[b])
            loss = loss + cfg.l2 * model.penalty()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        epochs = epoch + 1
        _, val_logloss = _score(model, xva, va_y)
        if val_logloss < best:
            best, best_state, since = val_logloss, copy.deepcopy(model.state_dict()), 0
        else:
            since += 1
            if since >= cfg.patience:
                break
    model.load_state_dict(best_state)
    test_auc, test_logloss = _score(model, xte, te_y)
    return {"auc": test_auc, "logloss": test_logloss, "val_logloss": best, "epochs": epochs}
