"""The PySide6 refcount workaround is an explicit, idempotent install(), never an import side effect."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_gui_package_has_no_side_effect():
    code = (
        "import sys, gpt_inspector.gui as g; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('PySide6', 'shiboken6') or m.endswith('_pyside_fix')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_install_is_idempotent():
    code = (
        "import sys; from gpt_inspector.gui import _pyside_fix as f; "
        "f.install(); n = sys.getrefcount(None); again = f.install(); "
        "print(again, sys.getrefcount(None) - n < 1000)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]
