"""The batch types the pipeline hands to the trainer: `Jagged`, `KeyedJagged`, `Batch` (needs only torch).

Shapes: B examples, F sparse features, Dn dense features, N ids in the batch (N = sum(lengths)).

`KeyedJagged` stores one form only, the per-(feature, example) `lengths`; `offsets()` is computed
when asked. Hot-path code does not check its inputs: `validate_batch()` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def _exclusive_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """int64 [len(lengths) + 1]: 0, then the running sum of `lengths`."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


@dataclass(frozen=True, slots=True)
class Jagged:
    """The ids of one feature for B examples: example b owns `values[offsets[b]:offsets[b + 1]]`."""

    values: torch.Tensor
    """int64 [N_f]"""
    lengths: torch.Tensor
    """int32 [B]"""

    def offsets(self) -> torch.Tensor:
        """int64 [B + 1], offsets[0] = 0, offsets[-1] = N_f."""
        return _exclusive_offsets(self.lengths)


@dataclass(frozen=True, slots=True)
class KeyedJagged:
    """Ids of F features for B examples, feature-major (all of feature 0, then all of feature 1, ...).

    Example (F = 2 features, B = 3 examples)::

        keys     ("C1",            "M1")
        example   0    1    2       0        1      2
        ids      [7]  []   [9]     [1, 2]   [3]    []
        lengths  [1,   0,   1,      2,       1,     0]        int32 [F * B]
        values   [7, 9, 1, 2, 3]                              int64 [N]
        offsets  [0, 1, 1, 2, 4, 5, 5]                        int64 [F * B + 1], computed
    """

    keys: tuple[str, ...]
    """F feature names."""
    values: torch.Tensor
    """int64 [N], N = sum(lengths)."""
    lengths: torch.Tensor
    """int32 [F * B], feature-major."""

    @property
    def stride(self) -> int:
        """B, the number of examples (0 when there are no features)."""
        return self.lengths.numel() // len(self.keys) if self.keys else 0

    def offsets(self) -> torch.Tensor:
        """int64 [F * B + 1]: where each (feature, example) starts in `values`; computed, never stored."""
        return _exclusive_offsets(self.lengths)

    def length_per_key(self) -> torch.Tensor:
        """int64 [F]: ids per feature."""
        return self.lengths.view(len(self.keys), -1).sum(dim=1, dtype=torch.int64)

    def __getitem__(self, key: str) -> Jagged:
        """The ids of one feature: values int64 [N_f] (a view), lengths int32 [B] (a view)."""
        try:
            f = self.keys.index(key)
        except ValueError:
            raise KeyError(f"feature '{key}' is not in this KeyedJagged; keys: {list(self.keys)}") from None
        per_key = self.length_per_key().tolist()
        start, B = sum(per_key[:f]), self.stride
        return Jagged(self.values[start:start + per_key[f]], self.lengths[f * B:(f + 1) * B])

    def to_torchrec(self, weights: torch.Tensor | None = None) -> Any:
        """A `torchrec.sparse.jagged_tensor.KeyedJaggedTensor` over the same tensors (needs torchrec)."""
        KJT = _torchrec_kjt()
        return KJT(keys=list(self.keys), values=self.values, lengths=self.lengths, weights=weights)

    @staticmethod
    def from_torchrec(kjt: Any) -> KeyedJagged:
        """The inverse of `to_torchrec` (the KJT's weights, if any, are not kept here)."""
        _torchrec_kjt()
        return KeyedJagged(tuple(kjt.keys()), kjt.values().to(torch.int64), kjt.lengths().to(torch.int32))


def _torchrec_kjt() -> Any:
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError as e:
        raise ImportError("KeyedJagged.to_torchrec / from_torchrec need torchrec, which is not "
                          f"installed ({e}); install the torchrec release matching torch "
                          f"{torch.__version__}") from e
    return KeyedJaggedTensor


@dataclass(frozen=True, slots=True)
class Batch:
    """B examples: dense features, sparse ids, labels, optional per-id weights, passthrough columns and
    per-row example weights."""

    dense: torch.Tensor
    """float32 [B, Dn]"""
    sparse: KeyedJagged
    """F features, lengths int32 [F * B], values int64 [N]"""
    labels: torch.Tensor
    """float32 [B]"""
    weights: torch.Tensor | None = None
    """float32 [N], aligned with `sparse.values` (1.0 for features without a weight column), or None."""
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    """Passthrough columns (`data.passthrough_columns`), each a numpy array [B]; stay on the host."""
    example_weights: torch.Tensor | None = None
    """float32 [B] per-row loss weights (`data.example_weight_column`, each >= 0 and finite), or None."""

    @property
    def batch_size(self) -> int:
        """B."""
        return self.labels.shape[0]

    def _map(self, f: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """f of every tensor (extras, numpy, are kept as they are)."""
        kj = KeyedJagged(self.sparse.keys, f(self.sparse.values), f(self.sparse.lengths))
        return Batch(dense=f(self.dense), sparse=kj, labels=f(self.labels),
                     weights=None if self.weights is None else f(self.weights), extras=self.extras,
                     example_weights=None if self.example_weights is None else f(self.example_weights))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The tensors on `device` (extras stay numpy on the host)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """Copies of the tensors in page-locked memory (needs a CUDA build of torch)."""
        return self._map(lambda t: t.pin_memory())


def _check_tensor(name: str, t: Any, dtype: torch.dtype, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {list(t.shape)}")


def validate_batch(batch: Batch) -> None:
    """Checks every invariant of `batch`; raises ValueError with the actual shapes and values."""
    _check_tensor("labels", batch.labels, torch.float32, 1)
    B = batch.labels.shape[0]
    _check_tensor("dense", batch.dense, torch.float32, 2)
    if batch.dense.shape[0] != B:
        raise ValueError(f"dense has {batch.dense.shape[0]} rows, labels has B = {B}")
    for name, t in (("dense", batch.dense), ("labels", batch.labels)):
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            idx = bad.nonzero()[0].tolist()
            raise ValueError(f"{name}{idx} = {t[tuple(idx)].item()} is not finite")
    kj = batch.sparse
    _check_tensor("sparse.values", kj.values, torch.int64, 1)
    _check_tensor("sparse.lengths", kj.lengths, torch.int32, 1)
    F, n_len = len(kj.keys), kj.lengths.numel()
    if len(set(kj.keys)) != F:
        raise ValueError(f"sparse.keys has duplicates: {list(kj.keys)}")
    if F == 0 and (n_len or kj.values.numel()):
        raise ValueError(f"sparse has no keys but {n_len} lengths and {kj.values.numel()} values")
    if F and n_len % F:
        raise ValueError(f"sparse.lengths has {n_len} entries, not a multiple of F = {F} keys")
    if n_len != F * B:
        raise ValueError(f"sparse.lengths has {n_len} entries, expected F * B = {F} * {B}")
    if n_len and int(kj.lengths.min()) < 0:
        i = int(torch.argmin(kj.lengths))
        raise ValueError(f"sparse.lengths[{i}] = {int(kj.lengths[i])} is negative "
                         f"(feature '{kj.keys[i // (n_len // F)]}')")
    total = int(kj.lengths.sum(dtype=torch.int64))
    if total != kj.values.numel():
        raise ValueError(f"sum(sparse.lengths) = {total} != sparse.values.numel() = {kj.values.numel()}")
    if total and int(kj.values.min()) < 0:
        i = int(torch.argmin(kj.values))
        raise ValueError(f"sparse.values[{i}] = {int(kj.values[i])} is a negative id")
    if batch.weights is not None:
        _check_tensor("weights", batch.weights, torch.float32, 1)
        if batch.weights.numel() != batch.sparse.values.numel():
            raise ValueError(f"weights has {batch.weights.numel()} entries, sparse.values has "
                             f"{batch.sparse.values.numel()}")
    if batch.example_weights is not None:
        w = batch.example_weights
        _check_tensor("example_weights", w, torch.float32, 1)
        if w.shape[0] != B:
            raise ValueError(f"example_weights has {w.shape[0]} rows, labels has B = {B}")
        bad = ~(torch.isfinite(w) & (w >= 0))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"example_weights[{i}] = {w[i].item()} is not a finite number >= 0")
    for name, col in batch.extras.items():
        if len(col) != B:
            raise ValueError(f"extras['{name}'] has {len(col)} rows, labels has B = {B}")
