"""Row storage of an export for each precision, through fbgemm's row-wise quantizers.

One table's rows float32 [R, D] become a matrix, stored as it is in the safetensors file::

    fp32   float32 [R, D]
    fp16   float16 [R, D]
    int8   uint8 [R, D + 8]     fbgemm FloatToFused8BitRowwiseQuantized: D codes | f32 scale | f32 bias
    int4   uint8 [R, P + 4]     fbgemm FloatToFusedNBitRowwiseQuantizedSBHalf(bit_rate=4):
                                P = 2 * ceil(D / 4) bytes of codes, 2 per byte, low nibble first,
                                | f16 scale | f16 bias

Value of code c: `c * scale + bias`, per row (bias is the row minimum). fbgemm's 4-bit quantizer
needs a width that is a multiple of 4, so a table of other D is quantized with its last column
repeated up to it (same row min and max, hence the same scale and bias); the extra codes are
ignored.

fbgemm's inference TBE (`IntNBitTableBatchedEmbeddingBagsCodegen`) wants another row layout:
f16 scale | f16 bias | codes. `tbe_rows` converts (int8's f32 scale and bias round to f16 there;
int4 moves bytes only).
"""

from __future__ import annotations

import numpy as np
import torch


def _fbgemm():
    """torch.ops.fbgemm, importing fbgemm_gpu (which registers it; slow to import) on the first int8 / int4 use."""
    import fbgemm_gpu  # noqa: F401

    return torch.ops.fbgemm

PRECISIONS = ("fp32", "fp16", "int8", "int4")
QUANTIZED = ("int8", "int4")


def quantize(rows: torch.Tensor, precision: str) -> np.ndarray:
    """float32 [R, D] -> the stored matrix (see the module docstring)."""
    rows = rows.detach().to(torch.float32).contiguous()
    if precision == "fp32":
        return rows.numpy()
    if precision == "fp16":
        return rows.to(torch.float16).numpy()
    if precision == "int8":
        return _fbgemm().FloatToFused8BitRowwiseQuantized(rows).numpy()
    if precision == "int4":
        pad = tbe_dim("int4", rows.shape[1]) - rows.shape[1]
        if pad:
            rows = torch.cat([rows, rows[:, -1:].expand(-1, pad)], dim=1)    # [R, D + pad]
        return _fbgemm().FloatToFusedNBitRowwiseQuantizedSBHalf(rows, 4).numpy()
    raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def dequantize(matrix: np.ndarray, precision: str, dim: int) -> torch.Tensor:
    """The stored matrix [R, W] -> float32 [R, D]; for fp32 it shares memory with a writable `matrix`."""
    if not matrix.flags.writeable or not matrix.flags.c_contiguous:
        matrix = np.array(matrix)                   # a read-only memory map: torch wants its own copy
    m = torch.from_numpy(matrix)
    if precision == "fp32":
        return m
    if precision == "fp16":
        return m.float()
    if precision == "int8":
        return _fbgemm().Fused8BitRowwiseQuantizedToFloat(m)
    if precision == "int4":
        return _fbgemm().FusedNBitRowwiseQuantizedSBHalfToFloat(m, 4)[:, :dim].contiguous()
    raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def split_fused(matrix: np.ndarray, precision: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A quantized matrix [R, W] -> (codes uint8 [R, W - 8 or W - 4], scale float32 [R], bias float32 [R])."""
    tail = 8 if precision == "int8" else 4
    sb = np.ascontiguousarray(matrix[:, -tail:]).view(np.float32 if precision == "int8" else np.float16)  # [R, 2]
    return matrix[:, :-tail], sb[:, 0].astype(np.float32), sb[:, 1].astype(np.float32)


def tbe_rows(matrix: np.ndarray, precision: str, scale_dtype: type = np.float16) -> np.ndarray:
    """A quantized matrix [R, W] -> fbgemm inference TBE rows uint8 [R, 4 + codes]: f16 scale | f16 bias | codes
    (`scale_dtype` np.float32: [R, 8 + codes], the same f16-rounded values as float32, for native_fused)."""
    codes, scale, bias = split_fused(matrix, precision)
    sb = np.stack([scale, bias], axis=1).astype(np.float16).astype(scale_dtype)   # [R, 2]
    out = np.empty((matrix.shape[0], 2 * sb.itemsize + codes.shape[1]), np.uint8)
    out[:, :2 * sb.itemsize] = sb.view(np.uint8)
    out[:, 2 * sb.itemsize:] = codes
    return out


def tbe_dim(precision: str, dim: int) -> int:
    """Embedding width the TBE is built with: int4 rows carry padding columns up to a multiple of 4."""
    return -(-dim // 4) * 4 if precision == "int4" else dim
