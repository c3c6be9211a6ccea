"""A resolved config written back as TOML: `to_toml(cfg)` is text that `recsys.config.load_config`
reads into an equal config (the run directory's config.toml, the configs the launchers hand to
shard and trainer processes). `to_dict`: the config as plain TOML-able values. A table's optimizer
is written grouped, `optimizer = { name = "adam", lr = 0.01, ... }`, with the keys that optimizer
reads (`OPTIMIZER_KEYS`); another optimizer's keys are left out at their defaults."""

from __future__ import annotations

import dataclasses
from typing import Any

from embedding_ps.wire.config import OPTIMIZER_KEYS, TableConfig

_OPTIMIZER_FIELDS = {k for keys in OPTIMIZER_KEYS.values() for k in keys}


def to_dict(cfg: Any) -> Any:
    """The config as plain TOML-able values (tuples become lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (tuple, list)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def to_toml(cfg: Any) -> str:
    """The resolved config as TOML text that `load_config` reads back into an equal config."""
    lines: list[str] = []
    for section, body in to_dict(cfg).items():
        arrays = {k: v for k, v in body.items() if isinstance(v, list) and v and isinstance(v[0], dict)}
        lines.append(f"[{section}]")
        lines += _toml_items({k: v for k, v in body.items() if k not in arrays})
        for name, items in arrays.items():
            for item in items:
                if (section, name) == ("ps", "tables"):
                    item = _grouped(item)
                lines += ["", f"[[{section}.{name}]]"] + _toml_items(item)
        lines.append("")
    return "\n".join(lines)


def _grouped(table: dict[str, Any]) -> dict[str, Any]:
    """A table's fields with its optimizer's keys under `optimizer` (the others dropped where default)."""
    default = to_dict(TableConfig(name="_", dim=1))
    mine = OPTIMIZER_KEYS[table["optimizer"]]
    out: dict[str, Any] = {}
    for k, v in table.items():
        if k == "optimizer":
            out[k] = {"name": v, **{o: table[o] for o in mine}}
        elif k not in _OPTIMIZER_FIELDS or (k not in mine and v != default[k]):
            out[k] = v
    return out


def _toml_items(body: dict[str, Any]) -> list[str]:
    return [f"{k} = {toml_value(v)}" for k, v in body.items() if v is not None]


def toml_value(v: Any) -> str:
    """`v` (bool, number, string, list, dict) as a TOML value, strings quoted and escaped."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else toml_value(k)


__all__ = ["to_dict", "to_toml", "toml_value"]
