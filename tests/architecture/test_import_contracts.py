"""The engine must stay Qt-free: every front door, including scripts, can use it headless."""

import ast
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "gpt_inspector" / "core"
QT = ("PySide6", "pyqtgraph", "PyQt5", "PyQt6", "shiboken6")


def test_core_sources_import_no_qt():
    offenders = []
    for f in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{f.name}: {n}" for n in names if n.split(".")[0] in QT]
    assert not offenders, offenders
    assert len(list(CORE.glob("*.py"))) >= 6  # the check really looked at the engine


def test_importing_core_loads_no_qt():
    code = "import sys, gpt_inspector, gpt_inspector.core; print([m for m in sys.modules if m.split('.')[0] in %r])" % (QT,)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
