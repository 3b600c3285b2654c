"""The debugger window (PySide6 + pyqtgraph) on top of the Qt-free engine.

The GUI thread never runs the model: ``worker.Worker`` owns the session in a QThread and hands
the views immutable ``viewdata.Snapshot`` values. Start it with ``gpt_inspector.gui.app.run``.

Importing this package changes nothing. Whoever starts Qt (``app.run``, the test suite, a
benchmark) calls ``gpt_inspector.gui._pyside_fix.install()`` first.
"""
