"""Work around reference-count bugs in PySide6 6.12 on Python 3.11.

``Signal.emit()`` returns ``True`` without owning a reference to it, and void methods
(``QObject.setObjectName``, ``QTimer.start``, ...) do the same with ``None``: each call takes one
reference away. A window makes thousands of such calls (pyqtgraph's included); once the count
reaches zero the interpreter aborts with "bool_dealloc" / "none_dealloc", often at exit while
garbage collecting. Python 3.12+ makes these singletons immortal, so only older versions care.

The bug is detected, not assumed: a few calls are made and the counts measured. If references
go missing, ``True``, ``False`` and ``None`` get a count no run can exhaust (2**40, never given
back, which is what 3.12 does for them anyway).
"""

from __future__ import annotations

import ctypes
import sys

_done = False


def _leaks() -> bool:
    from PySide6.QtCore import QObject, Signal

    class _Probe(QObject):
        sig = Signal()

    p = _Probe()
    true0, none0 = sys.getrefcount(True), sys.getrefcount(None)
    for _ in range(16):
        p.sig.emit()
        p.setObjectName("probe")
    return true0 - sys.getrefcount(True) >= 16 or none0 - sys.getrefcount(None) >= 16


def install() -> bool:
    """Protect the singletons if this PySide6 leaks them; returns whether this call applied the fix.

    Every entry point that starts Qt calls it (``gui.app.run``, the GUI tests' conftest); calling
    it again does nothing.
    """
    global _done
    if _done or sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return False
    _done = True
    if not _leaks():
        return False
    for obj in (True, False, None):
        # ob_refcnt is the first field of every CPython object (a Py_ssize_t)
        ctypes.c_ssize_t.from_address(id(obj)).value += 1 << 40
    return True
