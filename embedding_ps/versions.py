"""The torch / fbgemm-gpu pair check.

fbgemm-gpu wheels are compiled against one torch release; a mismatched pair fails deep inside
an operator call with an undefined symbol. We check the installed pair up front and say which
versions are needed instead.
"""

from __future__ import annotations

import importlib.metadata as md

# torch release -> the fbgemm-gpu release built against it (CPU and CUDA wheels share numbers).
# 2.13 / 1.8: the pinned pair (pyproject.toml). 2.11 / 1.6: the CUDA 13 pair of the GPU machines'
# images (torch 2.11.0+cu130 with the fbgemm-gpu 1.6.0 CUDA wheel; fbgemm's own table stops at 1.5 ->
# 2.10), on which benchmarks/train_gpu.py and tests/integration/test_cuda.py ran.
SUPPORTED_PAIRS: dict[str, str] = {"2.13": "1.8", "2.11": "1.6"}
FBGEMM_DISTS = ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-genai")


def _installed(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_torch_fbgemm() -> None:
    """Raise ImportError naming the needed versions if torch and fbgemm-gpu do not match."""
    torch_v = _installed("torch")
    fbgemm = [(d, v) for d in FBGEMM_DISTS if (v := _installed(d)) is not None]
    need = "; ".join(f"torch=={t}.* with fbgemm-gpu(-cpu)=={f}.*" for t, f in SUPPORTED_PAIRS.items())
    hint = "CPU: pip install torch==2.13.0 fbgemm-gpu-cpu==1.8.0"
    if torch_v is None or not fbgemm:
        missing = "torch" if torch_v is None else "fbgemm-gpu-cpu (or fbgemm-gpu)"
        raise ImportError(f"{missing} is not installed; supported pairs: {need}. {hint}")
    want = SUPPORTED_PAIRS.get(_minor(torch_v))
    for dist, v in fbgemm:
        if want is None or _minor(v) != want:
            raise ImportError(f"torch {torch_v} with {dist} {v} is not a supported pair (they are ABI-locked); "
                              f"supported: {need}. {hint}")
