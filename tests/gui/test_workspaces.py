"""View ▸ Workspace: named arrangements of the docks, chosen from the menu or with Alt+1..Alt+5, the
last one remembered for the next window (in the test's own settings file, see conftest)."""

from __future__ import annotations

from keys import press
from PySide6.QtCore import Qt

from gpt_inspector.gui import settings as _settings
from gpt_inspector.gui.layout import ALIASES, SETTINGS_KEY, WORKSPACES
from gpt_inspector.gui.main_window import MainWindow

NAMES = ["Attention", "Cache", "Lens", "Lab", "Compare"]
MAIN = {"Attention": "scores", "Cache": "kv", "Lens": "lens", "Lab": "lab", "Compare": "compare"}


def _menu(win):
    view = next(a.menu() for a in win.menuBar().actions() if a.text() == "&View")
    return next(a.menu() for a in view.actions() if a.menu() is not None and a.menu().title() == "&Workspace")


def _dock(win, key):
    return win.docks[ALIASES.get(key, key)]


def _in_front(dock) -> bool:
    return dock.isVisible() and not dock.visibleRegion().isEmpty()


def _checked(win) -> list[str]:
    return [a.text() for a in _menu(win).actions() if a.isChecked()]


def _main_slot(win, name, qtbot):
    """The workspace's main dock is in front, under the tokens, and the widest panel right of Session."""
    main = _dock(win, MAIN[name])

    def placed():
        g, tokens = main.geometry(), win.docks["tokens"].geometry()
        others = [
            d
            for k, d in win.docks.items()
            if d is not main and k not in ("session", "breakpoints", "tokens") and _in_front(d)
        ]
        return (_in_front(main) and abs(g.top() - tokens.bottom()) < 12 and abs(g.left() - tokens.left()) < 12
                and all(g.width() >= d.width() for d in others))  # fmt: skip

    # the arrangement is sized once Qt has laid it out (the next turn of the event loop)
    qtbot.waitUntil(placed, timeout=3000)


def test_workspace_menu_and_shortcuts_arrange_the_docks(shown, qtbot):
    win = shown()
    acts = _menu(win).actions()
    assert [a.text() for a in acts] == NAMES
    assert [a.shortcut().toString() for a in acts] == [f"Alt+{i}" for i in range(1, 6)]
    assert _checked(win) == ["Attention"]
    _main_slot(win, "Attention", qtbot)
    win.docks["kv"].toggleViewAction().trigger()  # the user closes the KV cache panel
    assert not win.docks["kv"].isVisible()
    for i, name in enumerate(NAMES[1:], start=2):
        press(qtbot, win, Qt.Key(Qt.Key.Key_0.value + i), Qt.KeyboardModifier.AltModifier)
        qtbot.waitUntil(lambda name=name: win.workspace == name, timeout=3000)
        _main_slot(win, name, qtbot)
        assert _checked(win) == [name]
        assert _settings.settings().value(SETTINGS_KEY) == name
        # every panel is docked somewhere, none floats, none stays closed; each group's first tab in front
        assert all(d.isVisible() and not d.isFloating() for d in win.docks.values())
        ws = WORKSPACES[name]
        for group in (ws.main, *ws.side, *ws.bottom):
            qtbot.waitUntil(lambda g=group: _in_front(_dock(win, g[0])), timeout=3000)
    next(a for a in acts if a.text() == "Attention").trigger()  # from the menu
    qtbot.waitUntil(lambda: win.workspace == "Attention", timeout=3000)
    _main_slot(win, "Attention", qtbot)
    assert _in_front(win.docks["softmax"]) and _in_front(win.docks["qkv"]) and _in_front(win.docks["overview"])


def test_the_last_workspace_comes_back_in_the_next_window(shown, qtbot):
    win = shown()
    press(qtbot, win, Qt.Key.Key_3, Qt.KeyboardModifier.AltModifier)
    qtbot.waitUntil(lambda: win.workspace == "Lens", timeout=3000)
    win.close()  # saves the layout, as a quit does

    again = MainWindow()
    qtbot.addWidget(again)
    again.show()
    try:
        assert again.workspace == "Lens" and _checked(again) == ["Lens"]
        _main_slot(again, "Lens", qtbot)
    finally:
        again.worker.stop()


def test_a_remembered_workspace_is_arranged_when_no_saved_layout_fits(qtbot):
    # a layout saved by an older version is ignored (STATE_VERSION); the workspace name still counts
    st = _settings.settings()
    st.setValue(SETTINGS_KEY, "Cache")
    st.remove("window/state")
    st.sync()
    win = MainWindow()
    qtbot.addWidget(win)
    win.resize(1400, 900)
    win.show()
    try:
        assert win.workspace == "Cache" and _checked(win) == ["Cache"]
        _main_slot(win, "Cache", qtbot)
    finally:
        win.worker.stop()


def test_reset_layout_goes_back_to_the_attention_workspace(shown, qtbot):
    win = shown()
    press(qtbot, win, Qt.Key.Key_4, Qt.KeyboardModifier.AltModifier)
    qtbot.waitUntil(lambda: win.workspace == "Lab", timeout=3000)
    win.acts.reset_layout.trigger()
    assert win.workspace == "Attention" and _checked(win) == ["Attention"]
    assert _settings.settings().value(SETTINGS_KEY) == "Attention"
    _main_slot(win, "Attention", qtbot)
