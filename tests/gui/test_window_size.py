"""The first window fits the screen it opens on, and every panel stays usable at common sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from gpt_inspector.gui.main_window import PANEL_MIN, MainWindow, screen_share

SIZES = [(1366, 768), (1920, 1080), (2560, 1440)]


def front_docks(win):
    """The docks a user sees: shown, and not hidden behind another tab."""
    return {k: d for k, d in win.docks.items() if d.isVisible() and not d.visibleRegion().isEmpty()}


def check_layout(win):
    inside = win.rect()
    shown = front_docks(win)
    for key in PANEL_MIN:
        if key != "mask":  # tabbed behind Next token
            assert key in shown, f"{key} is not visible"
    for key, d in shown.items():
        g = d.geometry()
        assert inside.contains(g), f"{key} {g} leaves the window {inside}"
        w = d.widget()
        assert w.width() >= w.minimumWidth() and w.height() >= w.minimumHeight(), key
        mw, mh = PANEL_MIN.get(key, (0, 0))
        assert w.width() >= mw and w.height() >= mh, f"{key} is {w.size()}, below its minimum {mw}x{mh}"


def test_first_window_is_a_share_of_the_screen(qtbot):
    win = MainWindow(restore_layout=False)
    qtbot.addWidget(win)
    avail = win.screen().availableGeometry()
    share = screen_share(avail.height())
    want_w = max(min(int(avail.width() * share), 2200), win.minimumSizeHint().width())
    assert win.width() == want_w
    assert screen_share(768) == 1.0 and screen_share(1440) == 0.9  # a laptop screen is used whole
    win.worker.stop()


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_every_panel_fits_at(qtbot, size):
    win = MainWindow(restore_layout=False)
    qtbot.addWidget(win)
    win.show()
    win.resize(*size)  # as a user (or the window manager) would: maximise, drag the corner
    qtbot.waitUntil(lambda: win.size().width() == size[0], timeout=3000)
    qtbot.wait(50)
    check_layout(win)
    # the room goes to the plots, not to the Session controls
    assert win.docks["scores"].width() > win.docks["session"].width()
    win.worker.stop()


HIDPI = textwrap.dedent(
    """
    import json, sys
    from PySide6.QtWidgets import QApplication
    app = QApplication([])
    from gpt_inspector.gui.main_window import MainWindow
    win = MainWindow(restore_layout=False)
    win.show()
    for _ in range(20):
        app.processEvents()
    avail = win.screen().availableGeometry()
    docks = {k: [d.geometry().getRect(), d.widget().minimumWidth(), d.widget().width()]
             for k, d in win.docks.items() if d.isVisible() and not d.visibleRegion().isEmpty()}
    print(json.dumps({"dpr": win.devicePixelRatio(), "win": [win.width(), win.height()],
                      "avail": [avail.width(), avail.height()], "docks": docks}))
    win.worker.stop()
    """
)


def test_hidpi_scale_two_fits_a_1366x768_logical_screen(tmp_path):
    screen = {"screens": [{"name": "hidpi", "x": 0, "y": 0, "width": 2732, "height": 1536, "logicalDpi": 96,
                           "logicalBaseDpi": 96, "dpr": 1}]}  # fmt: skip
    (tmp_path / "screen.json").write_text(json.dumps(screen))
    env = dict(os.environ, QT_QPA_PLATFORM=f"offscreen:configfile={tmp_path / 'screen.json'}", QT_SCALE_FACTOR="2",
               GPT_INSPECTOR_SETTINGS=os.environ.get("GPT_INSPECTOR_SETTINGS", ""))  # fmt: skip
    out = subprocess.run([sys.executable, "-c", HIDPI], env=env, capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # fmt: skip
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["dpr"] == 2 and r["avail"] == [1366, 768], r
    assert r["win"][0] <= r["avail"][0] and r["win"][1] <= r["avail"][1], r
    for key, ((x, y, w, h), minw, width) in r["docks"].items():
        assert x >= 0 and y >= 0 and x + w <= r["win"][0] and y + h <= r["win"][1], (key, r)
        assert width >= minw, key


@pytest.mark.parametrize("size", [(1366, 768), (1920, 1080)])
def test_the_kv_lab_buttons_are_in_reach_in_its_tab(make_window, qtbot, click_tab, size):
    # the lab is a tab of the narrow Q/K/V dock: its controls wrap instead of pushing Run off the side
    win = make_window()
    win.resize(*size)
    click_tab(win, "KV cache lab")
    panel = win.kvlab_panel
    qtbot.waitUntil(lambda: not panel.visibleRegion().isEmpty(), timeout=3000)
    for b in (panel.run_button, panel.step_button, panel.back_button, panel.probe_button, panel.show_button):
        seen = b.visibleRegion().boundingRect()
        assert seen.size() == b.size(), f"{b.text()!r} shows {seen.size()} of {b.size()}"
