"""`recsys tune`'s search space file and command line (no Ray here: the space is read and checked
against the job config before Ray starts; recsys/training/tune.py runs the search).

A space file is TOML; each key is a config key in quotes, as `--set` names it, and its value one
distribution:

    "ps.table_defaults.lr" = { loguniform = [0.01, 0.3] }
    "train.dense_lr"       = { uniform = [0.001, 0.01] }
    "model.dropout"        = { choice = [0.0, 0.2, 0.5] }
    "data.batch_size"      = { randint = [256, 1024] }        # both ends included
    "train.epochs"         = { qrandint = [2, 6, 2] }         # 2, 4 or 6: multiples of 2, both ends included
    "train.seed"           = { grid = [0, 1] }                # every value, --trials times

`check_space` loads the config with every value a choice / grid names and both ends of a range (the
config's own validation: an unknown key or a bad value is a ConfigError naming it), and refuses a key
whose values all give the same config (e.g. `ps.table_defaults.lr` where every table sets its own lr).
A space of choice / randint / qrandint keys only runs no combination twice (`distinct_trials`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recsys.config import RENAMED_KEYS, ConfigError, JobConfig, load_config, read_toml
from recsys.config_toml import toml_value

KINDS = {"loguniform": 2, "uniform": 2, "randint": 2, "qrandint": 3, "choice": 0, "grid": 0}
"""Distribution -> the length of its list (0: any non-empty list)."""


@dataclasses.dataclass(frozen=True)
class Param:
    """One searched config key: `kind` (a KINDS name) over `args`."""

    key: str
    kind: str
    args: tuple

    def corners(self) -> list:
        """The values `check_space` loads: every listed value, or both ends of a range."""
        return list(self.args) if self.kind in ("choice", "grid") else list(self.args[:2])

    def domain(self) -> Any:
        """The Ray Tune search domain (imports ray.tune)."""
        from ray import tune

        a = self.args
        return {"loguniform": lambda: tune.loguniform(a[0], a[1]), "uniform": lambda: tune.uniform(a[0], a[1]),
                "randint": lambda: tune.randint(a[0], a[1] + 1), "qrandint": lambda: tune.qrandint(*a),
                "choice": lambda: tune.choice(list(a)), "grid": lambda: tune.grid_search(list(a))}[self.kind]()


MAX_ENUMERATED = 100_000
"""Combinations up to which a space of discrete keys is drawn without repeats (`distinct_trials`)."""


def discrete_values(p: Param) -> list | None:
    """Every value a choice / randint / qrandint key takes (a choice's repeated value once); None for
    real ranges and grids."""
    if p.kind == "choice":
        return list(dict.fromkeys(p.args))
    if p.kind == "randint":
        return list(range(p.args[0], p.args[1] + 1))
    if p.kind == "qrandint":
        lo, hi, q = p.args
        return [v for v in range(lo, hi + 1) if v % q == 0] or None
    return None


def distinct_trials(params: Sequence[Param], trials: int, seed: int = 0) -> list[dict[str, Any]] | None:
    """The trials of a space whose keys are all choice / randint / qrandint: `trials` distinct value
    combinations drawn at random, or every combination once (in random order) when the space has no
    more than `trials`. None for any other space, which Ray Tune samples itself: a real range does not
    repeat a trial, a grid repeats each value --trials times on purpose, and a space of more than
    MAX_ENUMERATED combinations rarely repeats one. (Drawn independently, as Ray Tune draws them, 8 trials
    of a 6-combination space repeat at least two.)"""
    values = [discrete_values(p) for p in params]
    if not values or any(v is None for v in values):
        return None
    n = math.prod(len(v) for v in values)
    if n > MAX_ENUMERATED:
        return None
    combos = list(itertools.product(*values))           # the last key fastest
    return [dict(zip((p.key for p in params), combos[i])) for i in random.Random(seed).sample(range(n), min(trials, n))]


def override(key: str, value: Any) -> str:
    """`key=value` as `--set` takes it (numpy scalars, as Tune samples them, become Python ones)."""
    value = value.item() if hasattr(value, "item") else value
    return f"{key}={toml_value(value)}"


def trial_overrides(values: dict[str, Any]) -> list[str]:
    """A trial's `--set` overrides from its sampled {config key: value}."""
    return [override(k, v) for k, v in sorted(values.items())]


def read_space(path: str | Path) -> list[Param]:
    """The parameters of space file `path`; ConfigError naming the file and key."""
    raw = read_toml(path, "search space file")
    if not raw:
        raise ConfigError(f'{path}: no keys to search (e.g. "model.dropout" = {{ choice = [0.0, 0.2] }})')
    params = []
    for key, spec in raw.items():
        where = f"{path}: {key!r}"
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
            raise ConfigError(f"{where}: expected one of {{ {' | '.join(KINDS)} = [...] }} (a config key in quotes: "
                              f'"section.key" = {{ choice = [...] }}), got {spec!r}')
        kind, args = next(iter(spec.items()))
        n = KINDS[kind]
        if not isinstance(args, list) or not args or (n and len(args) != n):
            raise ConfigError(f"{where}: {kind} takes a list of {n or 'one or more'} values, got {args!r}")
        if kind in ("randint", "qrandint") and not all(isinstance(x, int) for x in args):
            raise ConfigError(f"{where}: {kind} takes integers, got {args!r}")
        if n and not all(isinstance(x, (int, float)) and math.isfinite(x) for x in args):
            raise ConfigError(f"{where}: {kind} takes numbers, got {args!r}")
        if n and not (args[0] < args[1] and (kind != "loguniform" or args[0] > 0)):
            raise ConfigError(f"{where}: {kind} needs low < high{' and low > 0' if kind == 'loguniform' else ''}, "
                              f"got {args!r}")
        params.append(Param(key, kind, tuple(args)))
    return params


def check_space(params: Sequence[Param], config: str | Path, overrides: Sequence[str], source: str) -> JobConfig:
    """Every key known (to `recsys.config_doc`; ps.table_defaults.X: a table key) and every corner value
    loading into a different config; the base config."""
    from recsys import config_doc

    base = load_config(config, overrides)
    for p in params:
        section, _, name = p.key.rpartition(".")
        if (section, name) in RENAMED_KEYS:
            raise ConfigError(f"{source}: {p.key!r} is the old name of {section}.{RENAMED_KEYS[section, name]}; "
                              f"use that")
        try:
            config_doc.explain(p.key)
        except ValueError as e:
            raise ConfigError(f"{source}: unknown config key: {e}") from None
        seen: list[JobConfig] = []
        for value in p.corners():
            try:
                cfg = load_config(config, [*overrides, override(p.key, value)])
            except ConfigError as e:
                raise ConfigError(f"{source}: {p.key} = {value!r}: {e}") from None
            if cfg not in seen:
                seen.append(cfg)
        if len(p.corners()) > 1 and len(seen) == 1:
            hint = (" (every table sets its own value, and ps.table_defaults applies only where a table does not:"
                    " search ps.tables' values through [ps.table_defaults] in the config instead)"
                    if p.key.startswith("ps.table_defaults.") else "")
            raise ConfigError(f"{source}: {p.key}: its values {p.corners()!r} all give the same config of "
                              f"{config}{hint}")
    return base


__all__ = ["KINDS", "Param", "check_space", "discrete_values", "distinct_trials", "override", "read_space",
           "trial_overrides"]
