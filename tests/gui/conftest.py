"""Window tests: offscreen Qt, tiny checkpoints, and settings in a temp file (never the user's)."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")

import keys  # noqa: E402

from gpt_inspector.gui import _pyside_fix  # noqa: E402

# an entry point like gui.app.run: nothing installs it on import any more
_pyside_fix.install()


@pytest.fixture(autouse=True)
def no_dialogs(monkeypatch):
    """Every message box is recorded instead of opened: a modal dialog nobody answers would hang an
    offscreen run. Tests assert on the list (or patch QMessageBox themselves to answer a question)."""
    from PySide6.QtWidgets import QMessageBox

    seen = []
    for name in ("warning", "critical", "information"):
        monkeypatch.setattr(QMessageBox, name, lambda parent, title, text, *a, **k: seen.append((title, text)))
    monkeypatch.setattr(QMessageBox, "question",
                        lambda parent, title, text, *a, **k: seen.append((title, text)) or QMessageBox.StandardButton.No)  # fmt: skip
    return seen


@pytest.fixture
def dialogs(no_dialogs):
    return no_dialogs


@pytest.fixture
def shown(make_window, qtbot):
    """A window on a fresh session, shown, active and exposed, as after start."""

    def make(*a, **kw):
        win = make_window(*a, **kw)
        win.activateWindow()
        qtbot.waitExposed(win)
        qtbot.waitUntil(win.isActiveWindow, timeout=3000)
        return win

    return make


@pytest.fixture(autouse=True)
def _private_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT_INSPECTOR_SETTINGS", str(tmp_path / "settings.ini"))
    yield


@pytest.fixture
def wait_idle(qtbot):
    """Wait until the window's worker has finished every command and the snapshot is shown."""

    def wait(win, timeout=20000):
        return keys.wait(qtbot, win, timeout)

    return wait


@pytest.fixture
def make_window(qtbot, tiny_lm, wait_idle):
    """A window showing a fresh session on a tiny checkpoint (loaded once per test run)."""
    from gpt_inspector import Session
    from gpt_inspector.gui.main_window import MainWindow

    made = []

    def make(family="gpt2", prompt="She eats an apple. He reads", **session_kw):
        win = MainWindow(restore_layout=False)
        qtbot.addWidget(win)
        win.resize(1400, 900)
        win.show()
        win.session_panel.prompt.setPlainText(prompt)
        win.show_source(Session(tiny_lm(family), prompt, **session_kw))
        wait_idle(win)
        made.append(win)
        return win

    yield make
    for w in made:
        w.worker.stop()


@pytest.fixture
def window_on(qtbot, wait_idle):
    """``window_on(lm, prompt)`` -> (window, session): a window showing a fresh session of ``lm``."""
    from gpt_inspector import Session
    from gpt_inspector.gui.main_window import MainWindow

    made = []

    def make(lm, prompt="She eats an apple"):
        win = MainWindow(restore_layout=False)
        qtbot.addWidget(win)
        win.resize(1400, 900)
        win.show()
        s = Session(lm, prompt)
        win.show_source(s)
        wait_idle(win)
        made.append(win)
        return win, s

    yield make
    for w in made:
        w.worker.stop()


@pytest.fixture
def click_tab(qtbot):
    """``click_tab(window, title)``: a left click on the dock tab titled ``title``."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QTabBar

    def click(win, title: str) -> None:
        for bar in win.findChildren(QTabBar):
            for i in range(bar.count()):
                if bar.tabText(i) == title:
                    qtbot.mouseClick(bar, Qt.MouseButton.LeftButton, pos=bar.tabRect(i).center())
                    return
        raise AssertionError(f"no tab titled {title!r}")

    return click


@pytest.fixture
def reopened_as_trace(qtbot, wait_idle, tmp_path):
    """``reopened_as_trace(win, steps=1)``: ``steps`` steps with F10, File ▸ Save trace, then the trace
    opened in the window (read-only); returns the snapshots shown before the save and after the open."""
    from PySide6.QtCore import Qt

    def reopen(win, steps=1):
        for _ in range(steps):
            keys.press(qtbot, win, Qt.Key.Key_F10)
            wait_idle(win)
        live = win.snapshot
        path = tmp_path / "t.safetensors"  # beside the window's autosave and settings, as the tests always had it
        win.save_trace(str(path))
        wait_idle(win)
        assert path.is_file(), win.errors
        win.open_trace(str(path))
        qtbot.waitUntil(lambda: win.snapshot is not None and win.snapshot.read_only, timeout=20000)
        return live, wait_idle(win)

    return reopen
