"""The config reference, read from the config dataclasses themselves: every key with its type,
default, meaning (the field's docstring) and valid values.

    recsys print-config --explain ps.table_defaults.lr     # one key
    python -m recsys.config_doc > docs/config.md           # the whole reference (a test checks it)

The docstrings are read from the source with `ast` (dataclasses keep none at runtime); types are
the annotations as written, defaults the dataclasses' own.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from functools import cache

from data.config import DataConfig
from embedding_ps.wire.config import PSConfig, TableConfig
from recsys.config import TrainConfig
from recsys.config_cluster import ClusterConfig
from recsys.config_model import ModelConfig
from recsys.config_retrieval import EvalConfig

SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("data", DataConfig, "Input pipeline: Parquet files, columns, shuffling."),
    ("ps", PSConfig, "Parameter-server shards: mode, transport, auth, storage."),
    ("ps.tables", TableConfig, "One embedding table: `[[ps.tables]]` entries; `[ps.table_defaults]` takes any of "
                               "these keys for every table (auto-created tables included)."),
    ("model", ModelConfig, "The CTR model: architecture and its options."),
    ("train", TrainConfig, "The training loop and the launcher."),
    ("eval", EvalConfig, "Offline evaluation (retrieval metrics)."),
    ("cluster", ClusterConfig, "Which engine places the processes: the local launcher or a Ray cluster."),
)


@dataclasses.dataclass(frozen=True)
class Key:
    section: str
    name: str
    type: str
    default: str
    doc: str

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


@cache
def _docstrings(cls: type) -> dict[str, tuple[str, str]]:
    """{field: (annotation source, docstring on one line)} from `cls`'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    out = {}
    for node, nxt in zip(body, [*body[1:], None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else ""
            out[node.target.id] = (ast.unparse(node.annotation), " ".join(str(doc).split()))
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "(required)"
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return repr(list(value) if isinstance(value, tuple) else value)


def keys() -> list[Key]:
    """Every config key, section by section, in declaration order."""
    out = []
    for section, cls, _ in SECTIONS:
        docs = _docstrings(cls)
        for f in dataclasses.fields(cls):
            if (section, f.name) == ("ps", "tables"):     # documented as its own section
                continue
            annotation, doc = docs[f.name]
            out.append(Key(section, f.name, annotation, _default(f), doc))
    return out


def explain(dotted: str) -> str:
    """The reference of one key (`ps.table_defaults.X` and `ps.tables.X` name a table key);
    ValueError naming close matches when there is no such key."""
    name = dotted.replace("ps.table_defaults.", "ps.tables.")
    for k in keys():
        if k.dotted == name:
            return "\n".join([f"{dotted}: {k.type} = {k.default}", "", *textwrap.wrap(k.doc, 100)])
    import difflib
    close = difflib.get_close_matches(name, [k.dotted for k in keys()], n=4)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ValueError(f"no config key {dotted!r}{hint}; `recsys print-config --explain SECTION` lists a section")


def section(name: str) -> str:
    """Every key of one section, one line each (its docstring's first sentence)."""
    rows = [k for k in keys() if k.section == name]
    if not rows:
        raise ValueError(f"no config section {name!r}: one of {', '.join(s for s, _, _ in SECTIONS)}")
    return "\n".join(f"{k.dotted} = {k.default}    # {k.doc[:k.doc.find('. ') + 1] or k.doc}" for k in rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """docs/config.md."""
    out = ["# Config reference", "",
           "Generated from the config dataclasses by `python -m recsys.config_doc > docs/config.md` "
           "(`tests/unit/recsys/test_config_doc.py` checks it is current). One key: "
           "`recsys print-config --explain KEY`; the resolved config of a job: `recsys print-config --config X`.",
           "", f"{len(keys())} keys. Every key can be set in the TOML file or with `--set section.key=value`.", ""]
    for name, _, about in SECTIONS:
        out += [f"## [{name}]", "", about, "", "| key | type | default | meaning |", "|---|---|---|---|",
                *(f"| `{k.name}` | `{_cell(k.type)}` | `{_cell(k.default)}` | {_cell(k.doc or '-')} |"
                  for k in keys() if k.section == name), ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
