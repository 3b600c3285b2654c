"""Import contracts (the architecture's one-way flow), checked on the source with ``ast``:

- core and figures never import Qt (every front door, scripts included, can use them headless);
- views never import the window (each panel is a thin view over snapshots and a controller);
- nothing outside core imports a name starting with ``_`` from core (core's privates stay private);
- no name starting with ``_`` is imported across rooms (core, figures, gui, commands, cli, export):
  a private name is its room's to change;
- no module is over 600 lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "gpt_inspector"
QT = ("PySide6", "pyqtgraph", "PyQt5", "PyQt6", "shiboken6")


def _imports(f: Path):
    """(module, [imported names]) for every import in ``f``, relative imports made absolute."""
    rel = f.relative_to(PKG.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, [a.name for a in node.names]


def _files(*parts: str):
    root = PKG.joinpath(*parts)
    return [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))


def _violations(files, bad) -> list[str]:
    out = []
    for f in files:
        for mod, names in _imports(f):
            why = bad(mod, names)
            if why:
                out.append(f"{f.relative_to(PKG.parent)}: {why}")
    return out


def _is_qt(mod: str, names) -> str | None:
    return f"imports {mod}" if mod.split(".")[0] in QT else None


def test_core_and_figures_import_no_qt():
    files = _files("core") + _files("figures") + _files("export.py")
    assert len(files) >= 10  # the check really looked at the engine
    assert not _violations(files, _is_qt)


def test_views_never_import_the_window_or_core_privates():
    views = _files("gui", "views")
    assert len(views) >= 8

    def bad(mod, names):
        if mod.endswith(("gui.main_window", "gui.actions", "gui.app")):
            return f"imports the window ({mod})"
        if mod.startswith("gpt_inspector.core") and (mod.rsplit(".", 1)[-1].startswith("_") or
                                                     any(n.startswith("_") for n in names)):  # fmt: skip
            return f"imports a private name from {mod}: {names}"
        return None

    assert not _violations(views, bad)


def test_nothing_outside_core_imports_core_privates():
    outside = [f for f in PKG.rglob("*.py") if "core" not in f.relative_to(PKG).parts]
    assert len(outside) >= 15

    def bad(mod, names):
        if not mod.startswith("gpt_inspector.core"):
            return None
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        if any(part.startswith("_") for part in mod.split(".")) or private:
            return f"imports {private or mod} from core"
        return None

    assert not _violations(outside, bad)


def _room(parts: tuple[str, ...]) -> str:
    """The room of a module path below gpt_inspector: its first folder, or a top-level module's own name."""
    return parts[0] if parts else "__init__"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _cross_room_privates(files) -> list[str]:
    out = []
    for f in files:
        room = _room(f.relative_to(PKG).with_suffix("").parts)
        for mod, names in _imports(f):
            parts = mod.split(".")
            if parts[0] != "gpt_inspector" or _room(tuple(parts[1:])) == room:
                continue
            private = [p for p in parts if _private(p)] + [n for n in names if _private(n)]
            if private:
                out.append(f"{f.relative_to(PKG.parent)}: imports {private} from {mod}")
    return out


def test_no_private_name_is_imported_across_rooms():
    files = sorted(PKG.rglob("*.py"))
    assert len(files) >= 50
    assert not _cross_room_privates(files)


def test_the_cross_room_check_can_fail():
    # a private name imported from another room (relative and absolute), a private module, and the
    # same names inside their own room, which stay allowed
    probe = PKG / "gui" / "views" / "_contract_probe_rooms.py"
    probe.write_text(
        "from ...figures.drawing import _style\nimport gpt_inspector.core.adapters._common\n"
        "from ..viewdata import _heads_side_by_side\nfrom ...figures import __doc__\n"
    )
    try:
        found = _cross_room_privates([probe])
    finally:
        probe.unlink()
    assert len(found) == 2, found
    assert "['_style']" in found[0] and "['_common']" in found[1]


def test_no_module_is_over_600_lines():
    long = {str(f.relative_to(PKG)): n for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > 600}
    assert not long


def test_the_checks_can_fail(tmp_path):
    """The AST reader sees relative imports of private names and Qt (a check that cannot fail is a defect)."""
    f = PKG / "gui" / "views" / "_contract_probe.py"
    f.write_text(
        "from ...core.capture import _CompiledEdits\nfrom PySide6 import QtCore\nfrom ..main_window import X\n"
    )
    try:
        mods = list(_imports(f))
    finally:
        f.unlink()
    assert ("gpt_inspector.core.capture", ["_CompiledEdits"]) in mods
    assert ("PySide6", ["QtCore"]) in mods and ("gpt_inspector.gui.main_window", ["X"]) in mods


def test_importing_core_and_figures_loads_no_qt():
    code = (
        "import sys, importlib.util, gpt_inspector, gpt_inspector.core, gpt_inspector.export\n"
        "if importlib.util.find_spec('gpt_inspector.figures'): import gpt_inspector.figures\n"
        "print([m for m in sys.modules if m.split('.')[0] in %r])" % (QT,)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_figures_load_without_the_engine():
    """Figures draw arrays; only a source passed in needs torch (scripts that plot saved arrays stay light)."""
    code = "import sys, gpt_inspector.figures; print([m for m in ('torch', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_only_the_boundary_module_imports_transformers():
    # core/hf.py holds every version shim; a rename in transformers must stay a one-file change
    files = [f for f in PKG.rglob("*.py") if f != PKG / "core" / "hf.py"]
    assert len(files) >= 50

    def bad(mod, names):
        return f"imports {mod}" if mod.split(".")[0] == "transformers" else None

    assert not _violations(files, bad)
    # and the check sees an import where there is one
    assert _violations([PKG / "core" / "hf.py"], bad)


def test_the_declared_transformers_range_is_the_boundarys():
    import re

    from gpt_inspector.core import hf

    text = (PKG.parent / "pyproject.toml").read_text()
    declared = re.search(r'"transformers([^"]*)"', text).group(1)
    assert declared == ",".join(hf.SUPPORTED)
