"""Views that nobody can see do no work: a panel behind another tab, or a closed dock, gets the
newest snapshot only when it is shown again (the snapshots in between are skipped, not queued)."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject


class DeferredViews(QObject):
    """Hands snapshots to views, holding them back from views hidden inside ``window``."""

    def __init__(self, window, views):
        super().__init__(window)
        self.window = window
        self.pending: dict[object, object] = {}
        for v in views:
            v.installEventFilter(self)

    def apply(self, view, snap) -> bool:
        """Give ``snap`` to ``view`` now if it can be seen (or will be, once the window is); True if it was."""
        # isVisibleTo: a dock tabbed away or closed is hidden; a window not shown yet hides nothing
        if not view.isVisibleTo(self.window):
            self.pending[view] = snap
            return False
        self.pending.pop(view, None)
        view.set_snapshot(snap)
        return True

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 (Qt)
        if event.type() == QEvent.Type.Show and obj in self.pending:
            obj.set_snapshot(self.pending.pop(obj))
        return False
