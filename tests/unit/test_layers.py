"""The package layering of ARCHITECTURE.md, read from the imports with ast."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "data": {"recsys", "embedding_ps"},
    "embedding_ps": {"recsys", "data"},
}


def imported_top_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module", "__import__"
        ):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_forbidden_layers(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no python files under {package}/"
    bad = {
        str(f.relative_to(ROOT)): sorted(imported_top_modules(f) & FORBIDDEN[package]) for f in files
    }
    bad = {f: mods for f, mods in bad.items() if mods}
    assert not bad, f"forbidden imports (see ARCHITECTURE.md): {bad}"


def test_checker_sees_forbidden_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import recsys.config\nfrom data.batch import Batch\nimportlib.import_module('embedding_ps.x')\n")
    assert imported_top_modules(src) >= {"recsys", "data", "embedding_ps"}


def test_no_pickle_in_packages() -> None:
    for package in ("data", "embedding_ps", "recsys"):
        for f in (ROOT / package).rglob("*.py"):
            mods = imported_top_modules(f)
            assert not mods & {"pickle", "cloudpickle", "marshal", "dill"}, f"{f} imports a pickler"


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Dotted names of every module `path` imports (relative imports resolved against its package,
    by default the one its place under ROOT names)."""
    if package is None:
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


# rooms of recsys/ (ARCHITECTURE.md): serving and models stand beside training, not on it
ROOM_FORBIDDEN = {
    "recsys/serving": ("recsys.training",),
    "recsys/models": ("recsys.training", "recsys.serving"),
    # embedding_ps (#29): the client never imports the shard; the wire neither of them
    "embedding_ps/client": ("embedding_ps.shard", "embedding_ps.local"),
    "embedding_ps/wire": ("embedding_ps.client", "embedding_ps.shard", "embedding_ps.local", "embedding_ps.store"),
}


@pytest.mark.parametrize("room", sorted(ROOM_FORBIDDEN))
def test_rooms_do_not_import_forbidden_rooms(room: str) -> None:
    files = sorted((ROOT / room).rglob("*.py"))
    assert files, f"no python files under {room}/"
    bad = {str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f)
                                            if any(m == p or m.startswith(p + ".") for p in ROOM_FORBIDDEN[room]))
           for f in files}
    bad = {f: mods for f, mods in bad.items() if mods}
    assert not bad, f"forbidden imports (see ARCHITECTURE.md): {bad}"


def test_room_checker_sees_relative_and_from_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from ..training import trainer\nfrom recsys import training\n")
    assert {"recsys.training", "recsys.training.trainer"} <= imported_modules(src, "recsys.serving")


def test_only_native_py_calls_the_native_library() -> None:
    """#29: `lib()` (the loaded C library) is called in embedding_ps/native.py alone; every other
    module calls native's operations, or asks `native.available()`."""
    calls = []
    for package in ("data", "embedding_ps", "recsys"):
        for f in sorted((ROOT / package).rglob("*.py")):
            if f == ROOT / "embedding_ps" / "native.py":
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "lib":
                    calls.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not calls, f"native library handle taken outside embedding_ps/native.py: {calls}"
