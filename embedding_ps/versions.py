"""The torch / fbgemm-gpu pair check.

fbgemm-gpu wheels are compiled against one torch release; a mismatched pair fails deep inside
an operator call with an undefined symbol. We check the installed pair up front and say which
versions are needed instead.
"""

from __future__ import annotations

import importlib.metadata as md

# torch release -> the fbgemm-gpu release built against it (CPU and CUDA wheels share numbers).
SUPPORTED_PAIRS: dict[str, str] = {"2.13": "1.8"}
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
            raise ImportError(
                f"torch {torch_v} with {dist} {v} is not a supported pair (they are ABI-locked); "
                f"supported: {need}. {hint}"
            )
