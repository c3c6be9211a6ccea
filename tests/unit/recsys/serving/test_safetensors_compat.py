"""Export tables through the `safetensors` package: files written by the code before it (our own
writer, commit bd447f6: tests/fixtures/export_bd447f6) load with the values written, and reads
are memory-mapped."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from recsys.serving.errors import ExportError
from recsys.serving.export import read_tensors, write_tensors

OLD = Path(__file__).resolve().parents[3] / "fixtures" / "export_bd447f6"


@pytest.mark.parametrize("name", sorted(json.loads((OLD / "expected.json").read_text())))
def test_tables_written_before_the_package_still_load(name) -> None:
    want = json.loads((OLD / "expected.json").read_text())[name]
    tensors, meta = read_tensors(OLD / "tables" / f"{name}.safetensors")
    assert meta == {"table": name, "precision": want["precision"], "dim": str(want["dim"])}
    assert set(tensors) == {"ids", "weight"} | ({"tombstones"} if want["tombstones"] is not None else set())
    assert tensors["ids"].dtype == np.int64 and tensors["ids"].tolist() == want["ids"]
    w = tensors["weight"]
    assert str(w.dtype) == want["weight_dtype"] and list(w.shape) == want["weight_shape"]
    np.testing.assert_array_equal(w.astype(np.float64), np.array(want["weight"], np.float64).reshape(w.shape))
    if want["tombstones"] is not None:
        assert tensors["tombstones"].dtype == np.int64 and tensors["tombstones"].tolist() == want["tombstones"]


def test_written_files_read_back_mapped_and_read_only(tmp_path) -> None:
    path = tmp_path / "t.safetensors"
    weight = np.arange(4096 * 8, dtype=np.float16).reshape(4096, 8)
    write_tensors(path, {"ids": np.arange(4096, dtype=np.int64), "weight": weight}, {"dim": "8"})
    plain = safetensors.numpy.load_file(str(path))                  # the package's own (copying) reader
    np.testing.assert_array_equal(plain["weight"], weight)
    tensors, meta = read_tensors(path)
    assert meta == {"dim": "8"} and not tensors["weight"].flags.writeable
    # the same tensors and metadata give the same bytes (the package alone orders metadata keys at random)
    again = tmp_path / "again.safetensors"
    many = {f"key{i}": str(i) for i in range(8)}
    write_tensors(path, {"ids": np.arange(3)}, many)
    first = path.read_bytes()
    for _ in range(3):
        write_tensors(again, {"ids": np.arange(3)}, many)
        assert again.read_bytes() == first
    assert read_tensors(again)[1] == many
    write_tensors(path, {"ids": np.arange(4096, dtype=np.int64), "weight": weight}, {"dim": "8"})
    tensors, meta = read_tensors(path)
    np.testing.assert_array_equal(tensors["weight"], weight)
    # a memory map, not a copy: bytes changed in the file afterwards show through the array
    data = bytearray(path.read_bytes())
    data[-2:] = np.float16(-7).tobytes()
    with open(path, "r+b") as f:
        f.write(data)
    assert tensors["weight"][-1, -1] == -7


def test_a_truncated_file_is_named(tmp_path) -> None:
    path = tmp_path / "t.safetensors"
    write_tensors(path, {"ids": np.arange(10, dtype=np.int64)}, {})
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ExportError, match="t.safetensors.*truncated"):
        read_tensors(path)
