"""The package's folders are layers: a folder imports only folders below it (docs/DESIGN.md).

Bottom to top: the root modules (errors, humanize, config), then ``store``, ``state``,
``cluster``, ``engine``, ``lifecycle``, ``fuse``, ``ops``. Modules of one folder may import
each other. The graph is read from the source with ``ast`` (imports inside functions and
under ``TYPE_CHECKING`` count: they are dependencies too); ``__main__`` is the entry point
and may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckptfs"
LAYERS = ("", "store", "state", "cluster", "engine", "lifecycle", "fuse", "ops")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    """The folder of ``ckptfs.x.y`` (``""`` for a root module)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else ""


def imports(path: Path) -> set[str]:
    """The ckptfs modules ``path`` imports (``from ckptfs.x import y`` names ckptfs.x.y if
    that is a module, else ckptfs.x)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "ckptfs"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "ckptfs":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                as_path = PACKAGE.parent.joinpath(*sub.split("."))
                found.add(sub if as_path.with_suffix(".py").exists() or as_path.is_dir()
                          else node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import (write ckptfs.x in full)")
    return found


def upward_imports() -> list[str]:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        if importer == "ckptfs.__main__":
            continue
        here = LAYERS.index(layer(importer))
        for imported in sorted(imports(path)):
            there = layer(imported)
            assert there in LAYERS, f"{importer} imports {imported}: not in a known layer"
            if LAYERS.index(there) > here:
                wrong.append(f"{importer} ({layer(importer) or 'root'}) imports {imported} "
                             f"({there})")
    return wrong


def test_every_module_is_in_a_layer() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS) - {""}
    for folder in folders:
        assert (PACKAGE / folder / "__init__.py").read_text().startswith('"""'), \
            f"ckptfs/{folder}/__init__.py says what the layer holds"


def test_a_folder_imports_only_folders_below_it() -> None:
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The rule would catch one (the check is not vacuous)."""
    probe = tmp_path / "probe.py"
    probe.write_text("from ckptfs.ops.client import sync\nimport ckptfs.engine.fs\n"
                     "from ckptfs.store import tiers\nfrom ckptfs import errors\n")
    assert imports(probe) == {"ckptfs.ops.client", "ckptfs.engine.fs", "ckptfs.store.tiers",
                              "ckptfs.errors"}
    assert [layer(m) for m in sorted(imports(probe))] == ["engine", "", "ops", "store"]
    assert layer("ckptfs.config") == "" and layer("ckptfs.state") == "state"
