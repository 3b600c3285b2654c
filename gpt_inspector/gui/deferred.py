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
        # a closed dock is hidden to the window; a dock tabbed behind another is not (see on_screen);
        # a window not shown yet hides nothing
        if not view.isVisibleTo(self.window) or (self.window.isVisible() and not on_screen(view)):
            self.pending[view] = snap
            return False
        self.pending.pop(view, None)
        view.set_snapshot(snap)
        return True

    def reveal(self, view) -> None:
        """``view``'s dock came to the front (a tab chosen): show it the snapshot it missed."""
        if view in self.pending:
            view.set_snapshot(self.pending.pop(view))

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 (Qt)
        if event.type() == QEvent.Type.Show:
            self.reveal(obj)
        return False


def on_screen(widget) -> bool:
    """Whether any part of ``widget`` can be seen now.

    ``isVisible()`` alone is not enough: Qt keeps a dock tabbed behind another visible, moved
    outside the window, so a panel on an unchosen tab would go on doing its work every step.
    """
    return widget.isVisible() and not widget.visibleRegion().isEmpty()
