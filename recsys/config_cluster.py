"""The `[cluster]` section: which engine places the job's processes (`ClusterConfig`; an example: docs/cluster.md).

A resource table maps a Ray resource name (`CPU`, `GPU`, `memory`, or a custom one of the cluster's nodes,
`ps = 1`) to an amount (a number, fractions allowed; `memory` also a size string: `parse_bytes`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
          "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: float | str, key: str) -> int:
    """`memory` of a resource table in bytes: a number (bytes) or "32GiB", "512MiB", "2GB", "100KB".

    >>> parse_bytes("1.5GiB", "cluster.ps_resources.memory")
    1610612736
    """
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{key} must be >= 0 bytes, got {value!r}")
        return int(value)
    m = _SIZE.match(value)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{key} must be a byte count or a size such as '32GiB', '512MiB', '2GB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def resources(table: dict[str, float | str], key: str) -> dict[str, float]:
    """A resource table as Ray's numbers: memory in bytes, every amount >= 0 (ValueError naming `key`)."""
    out: dict[str, float] = {}
    for name, amount in table.items():
        if name == "memory":
            amount = parse_bytes(amount, f"{key}.memory")
        elif isinstance(amount, str):
            raise ValueError(f"{key}.{name} must be a number (only memory takes a size string), got {amount!r}")
        elif amount < 0:
            raise ValueError(f"{key}.{name} must be >= 0, got {amount!r}")
        out[name] = float(amount)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterConfig:
    """Where the shards and trainers run: this machine (the local launcher) or a Ray cluster."""

    engine: Literal["local", "ray"] = "local"
    """"local": `recsys train` starts every process on this machine; "ray": shards become Ray actors
    and trainers Ray Train workers on the cluster at `address` (needs `pip install -e .[ray]`)."""
    address: str = ""
    """Ray cluster to join (engine = "ray"): "" starts a local Ray instance for the job, "auto" joins the
    cluster this machine belongs to (`ray start` ran here), "ray://HOST:10001" goes through Ray Client."""
    ps_resources: dict[str, float | str] = field(default_factory=lambda: {"CPU": 1})
    """Resources one PS shard reserves (one placement-group bundle per shard), e.g.
    `{ CPU = 4, memory = "32GiB" }` or `{ CPU = 1, ps = 1 }` to land on nodes offering a custom `ps`
    resource. CPU left out reserves none."""
    trainer_resources: dict[str, float | str] = field(default_factory=lambda: {"CPU": 1})
    """Resources one trainer (Ray Train worker) reserves, e.g. `{ CPU = 8, trainer = 1 }`; with
    use_gpu one GPU is added unless the table names GPU. CPU left out reserves none."""
    use_gpu: bool = False
    """Trainers on GPUs (one each; Ray Train then sets up NCCL). Needs train.device = "cuda"."""
    placement: Literal["spread", "pack"] = "spread"
    """Placement-group strategy of the shards' bundles and of the trainers: "spread" (SPREAD: across
    nodes where possible) or "pack" (PACK: onto as few nodes as possible)."""
    start_timeout_s: float = 60.0
    """How long the shards' and the trainers' resources may take to be granted; past it the job ends
    with one line naming the role and the resources the cluster lacks."""

    def __post_init__(self) -> None:
        if self.address and not (self.address == "auto" or self.address.startswith("ray://")
                                 or re.match(r"^[\w.\-]+:\d+$", self.address)):
            raise ValueError(f"cluster.address must be '', 'auto', 'ray://HOST:PORT' or 'HOST:PORT', "
                             f"got {self.address!r}")
        for key in ("ps_resources", "trainer_resources"):
            resources(getattr(self, key), f"cluster.{key}")        # raises naming the key
        if self.start_timeout_s <= 0:
            raise ValueError(f"cluster.start_timeout_s must be > 0, got {self.start_timeout_s}")

    def ps_bundle(self) -> dict[str, float]:
        """One shard's resources in Ray's numbers."""
        return resources(self.ps_resources, "cluster.ps_resources")

    def trainer_bundle(self) -> dict[str, float]:
        """One trainer's resources in Ray's numbers (GPU 1 added with use_gpu)."""
        out = resources(self.trainer_resources, "cluster.trainer_resources")
        if self.use_gpu:
            out.setdefault("GPU", 1.0)
        return out
