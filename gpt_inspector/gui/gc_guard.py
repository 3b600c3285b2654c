"""Keep Python's cyclic garbage collector on the GUI thread while a worker thread runs.

Automatic collection runs on whichever thread happens to allocate past the threshold. When that
is the worker (building a figure, stepping the model) and the garbage holds Qt objects, their C++
destructors run there while holding the GIL; a destructor that needs a Qt mutex the GUI thread
holds while it waits for the GIL deadlocks both threads (seen in CI: the worker collecting inside
matplotlib's CallbackRegistry, the GUI thread parked in ``processEvents``). pyqtgraph ships the
standard cure, ``GarbageCollector``: disable automatic collection and collect on a GUI-thread
timer. It has no way to stop, so this module counts the workers alive and gives automatic
collection back when the last one stops (tests and scripts go on without windows afterwards).
"""

from __future__ import annotations

import gc

_holders = 0
_collector = None
_was_enabled = True


def hold() -> None:
    """A worker thread is starting: from now on only the GUI thread collects. Call on the GUI thread."""
    global _holders, _collector, _was_enabled
    _holders += 1
    if _holders == 1:
        from pyqtgraph.util.garbage_collector import GarbageCollector

        _was_enabled = gc.isenabled()
        _collector = GarbageCollector(interval=0.5)  # disables automatic collection itself


def release() -> None:
    """A worker thread has stopped; the last one gives automatic collection back."""
    global _holders, _collector
    if _holders == 0:
        return
    _holders -= 1
    if _holders == 0 and _collector is not None:
        _collector.timer.stop()
        _collector = None
        if _was_enabled:
            gc.enable()


def holding() -> bool:
    return _holders > 0
