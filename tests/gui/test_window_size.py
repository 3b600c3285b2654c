"""The first window fits the screen it opens on, and every panel stays usable at common sizes.

The screen-size tests run the window in a child process whose offscreen screen is the size named
(the offscreen platform's screen is fixed when the application starts): the demo model loaded,
three steps taken with F10, then the window as it first opens and maximised, in every workspace
(chosen with its Alt+N shortcut), is measured in screen pixels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from keys import press
from PySide6.QtCore import QPointF, Qt

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

    def fits():  # once the docks have followed the resize
        check_layout(win)
        # the room goes to the plots, not to the Session controls
        assert win.docks["scores"].width() > win.docks["session"].width()

    qtbot.waitUntil(fits, timeout=3000)
    win.worker.stop()


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


# the demo model's 4 layers at 1366 x 768: the overview's rows are shorter than a label in the panels'
# font, and the KV cache panel's bytes per layer bars narrower than the 28 px a bottom label was given:
# L1 and L3 went unlabelled in both
LAYER_AXES = {
    "overview rows": (lambda win: (win.overview.left, win.overview.plot.getViewBox()), 1),
    "kv cache bytes per layer": (lambda win: (win.kv_cache.laxis, win.kv_cache.bplot.getViewBox()), 0),
}


@pytest.mark.parametrize("where", list(LAYER_AXES))
def test_every_layer_is_labelled_on_a_laptop_screen(qtbot, wait_idle, monkeypatch, where):
    from PySide6.QtGui import QFontInfo

    import gpt_inspector as gi

    win = MainWindow(restore_layout=False)
    qtbot.addWidget(win)
    win.resize(1366, 768)
    win.show()
    win.show_source(gi.Session(gi.load_model(gi.DEMO_MODEL, device="cpu"), "She eats apple"))
    wait_idle(win)
    press(qtbot, win, Qt.Key.Key_F10)
    wait_idle(win)
    pick, across = LAYER_AXES[where]  # across: the coordinate a label's cell spans (1: down the side)
    axis, view = pick(win)
    painted = []  # what the axis draws when the window paints: [(font px, [(rect, text)])]
    draw = axis.drawPicture

    def spy(p, axis_spec, tick_specs, text_specs):
        painted.append((QFontInfo(p.font()).pixelSize(), [(rect, text) for rect, _, text in text_specs]))
        return draw(p, axis_spec, tick_specs, text_specs)

    monkeypatch.setattr(axis, "drawPicture", spy)
    axis.picture = None
    axis.update()
    qtbot.waitUntil(lambda: bool(painted), timeout=3000)
    px, labels = painted[-1]
    assert [text for _, text in labels] == [f"L{layer}" for layer in range(4)]
    for layer, (rect, _) in enumerate(labels):
        # each label beside (under) its own row (bar), inside the axis the window shows
        ends = []
        for v in (layer, layer + 1):
            at = axis.mapFromScene(view.mapViewToScene(QPointF(0, v) if across else QPointF(v, 0)))
            ends.append(at.y() if across else at.x())
        centre = rect.center().y() if across else rect.center().x()
        assert min(ends) <= centre <= max(ends), (layer, rect, ends)
        assert axis.boundingRect().contains(rect), (layer, rect)
    for (a, _), (b, _) in zip(labels, labels[1:]):
        assert not a.intersects(b), (a, b)
    assert px >= axis.MIN_PX
    win.worker.stop()


SCREEN = textwrap.dedent(
    """
    import json, time
    from PySide6.QtCore import QPoint, Qt
    from PySide6.QtGui import QFontMetrics
    from PySide6.QtTest import QTest
    from PySide6.QtWidgets import QApplication, QTabBar
    app = QApplication([])
    from gpt_inspector.gui import _pyside_fix
    _pyside_fix.install()
    from gpt_inspector.gui.views.common import apply_theme
    apply_theme(app)
    from gpt_inspector.gui.layout import PANEL_MIN, WORKSPACES
    from gpt_inspector.gui.main_window import MainWindow
    from gpt_inspector.gui.worker import ModelSpec, SessionSpec

    def settle(ms):
        end = time.monotonic() + ms / 1000
        while time.monotonic() < end:
            app.processEvents()
            time.sleep(0.005)

    def steady(win, until=0.0):
        # the layout's deferred fits are zero-delay timers: done once what is measured stops changing
        # (four looks 50 ms apart), and not before the monotonic time ``until``; a busy machine only waits longer
        seen, same, end = None, 0, time.monotonic() + 20
        while (same < 4 or time.monotonic() < until) and time.monotonic() < end:
            settle(50)
            now = json.dumps(measure(win))
            same, seen = (same + 1 if now == seen else 0), now

    def idle(win):
        end = time.monotonic() + 60
        while (win.busy or win.snapshot is None) and time.monotonic() < end:
            app.processEvents()
            time.sleep(0.005)
        win.controller.take_snapshot()
        steady(win)

    def press(win, key, mod=Qt.KeyboardModifier.NoModifier):
        QTest.keyClick(QApplication.focusWidget() or win, key, mod)

    def rect(w):
        p = w.mapToGlobal(QPoint(0, 0))
        return [p.x(), p.y(), w.width(), w.height()]

    def click_tab(win, title):
        for bar in win.findChildren(QTabBar):
            for i in range(bar.count()):
                if bar.tabText(i) == title and bar.isVisible():
                    QTest.mouseClick(bar, Qt.MouseButton.LeftButton, pos=bar.tabRect(i).center())
                    return

    def measure(win):
        sb = win.statusBar()
        out = {"frame": list(win.frameGeometry().getRect()), "status": rect(sb), "status_min": sb.minimumSizeHint().height(),
               "status_whole": [lab.text() for lab in (win.st_run, win.st_step, win.st_positions, win.st_kv, win.st_device)
                                if lab.width() < lab.sizeHint().width()],
               # the room a message ("Loaded …") has: up to the first permanent label, against the load's own line
               "status_room": [min(w.x() for w in (win.st_run, win.st_step) if w.isVisible()) - 4,
                               sb.fontMetrics().horizontalAdvance(win.loaded_message)],
               "docks": {}, "tabs": []}
        for k, d in win.docks.items():
            if d.isVisible() and not d.visibleRegion().isEmpty():
                w = d.widget()
                out["docks"][k] = [rect(w), [w.minimumWidth(), w.minimumHeight()], list(PANEL_MIN.get(k, (0, 0)))]
        for bar in win.findChildren(QTabBar):
            if bar.parent() is win and bar.isVisible() and bar.count():
                out["tabs"].append([bar.elideMode() == Qt.TextElideMode.ElideNone,
                                    [bar.tabText(i) for i in range(bar.count()) if not bar.rect().contains(bar.tabRect(i))]])
        nt = win.next_token
        fm = QFontMetrics(nt.axis.style.get("tickFont") or nt.font())
        out["next"] = [nt.shown, nt.plot.getViewBox().height() / max(nt.shown, 1), fm.height()]
        out["kv_rows_px"] = win.qkv.kplot.getViewBox().height()
        return out

    win = MainWindow(restore_layout=False)
    win.persist_layout = False
    win.load_model(ModelSpec(), SessionSpec("She eats apple", 0.0, None, None, 0))
    win.show()
    shown_at = time.monotonic()
    win.activateWindow()
    idle(win)
    for _ in range(3):
        press(win, Qt.Key.Key_F10)
        idle(win)
    steady(win, shown_at + 0.8)  # the first-show fit runs up to 600 ms after the window appears
    avail = win.screen().availableGeometry()
    res = {"avail": list(avail.getRect()), "dpr": win.devicePixelRatio(), "first": measure(win), "maximised": {}}
    win.showMaximized()
    steady(win)
    for i, name in enumerate(WORKSPACES):
        press(win, Qt.Key(Qt.Key.Key_1.value + i), Qt.KeyboardModifier.AltModifier)
        steady(win)
        m = res["maximised"][name] = measure(win)
        m["workspace"] = win.workspace
    press(win, Qt.Key.Key_4, Qt.KeyboardModifier.AltModifier)  # Lab: the lab large
    steady(win)
    res["lab_plot"] = [win.kvlab_panel.plot.height(), win.kvlab_panel.plot.minimumHeight()]
    press(win, Qt.Key.Key_3, Qt.KeyboardModifier.AltModifier)  # Lens: it follows the steps while shown
    end = time.monotonic() + 30
    while win.lens_panel.result is None and time.monotonic() < end:
        settle(50)
    steady(win)
    t = win.lens_panel.table
    header = t.horizontalHeader()
    res["lens_cut"] = [header.model().headerData(c, Qt.Orientation.Horizontal) for c in range(t.columnCount())
                       if not t.isColumnHidden(c) and header.sectionViewportPosition(c) + header.sectionSize(c) > t.viewport().width()]
    res["lens_shown"] = [c for c in range(t.columnCount()) if not t.isColumnHidden(c)]
    print(json.dumps(res))
    win.worker.stop()
    """
)


def _start_on_screen(tmp_path, w: int, h: int, scale: int = 1) -> subprocess.Popen:
    """The SCREEN script started on a screen of w x h logical pixels (``scale`` device pixels each)."""
    screen = {
        "screens": [
            {"name": "s", "x": 0, "y": 0, "width": w * scale, "height": h * scale, "logicalDpi": 96,
             "logicalBaseDpi": 96, "dpr": 1}
        ]
    }  # fmt: skip
    (tmp_path / "screen.json").write_text(json.dumps(screen))
    env = dict(os.environ, QT_QPA_PLATFORM=f"offscreen:configfile={tmp_path / 'screen.json'}",
               GPT_INSPECTOR_SETTINGS=str(tmp_path / "settings.ini"), QT_SCALE_FACTOR=str(scale))  # fmt: skip
    # files, not pipes: nobody reads a pipe while the other children run, and a full one would stall its child
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        return subprocess.Popen([sys.executable, "-c", SCREEN], env=env, stdout=out, stderr=err, text=True,
                                cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # fmt: skip


@pytest.fixture(scope="module")
def on_screen(request, tmp_path_factory):
    """``on_screen(size, scale)`` -> the SCREEN script's measurements on that screen.

    Every selected size's child starts at once, when the first of them is asked for: each is mostly
    imports and waits for the layout to settle, and they overlap (one after another took 5 x 15 s).
    """
    wanted = [item.callspec.params for item in request.session.items
              if getattr(item, "function", None) is test_first_and_maximised_windows_fit_the_screen_in_every_workspace]  # fmt: skip
    started = {}
    for p in wanted:
        key = (tuple(p["size"]), p["scale"])
        if key not in started:
            folder = tmp_path_factory.mktemp(f"screen{key[0][0]}x{key[0][1]}x{key[1]}")
            started[key] = (_start_on_screen(folder, *key[0], key[1]), folder)

    def result(size, scale) -> dict:
        child, folder = started[(tuple(size), scale)]
        try:
            child.wait(timeout=400)  # the children share the machine: each may take longer than alone
        except subprocess.TimeoutExpired:
            child.kill()
            raise
        assert child.returncode == 0, (folder / "err").read_text()[-3000:]
        return json.loads((folder / "out").read_text().strip().splitlines()[-1])

    yield result
    for child, _ in started.values():
        if child.poll() is None:  # a test that failed before it waited
            child.kill()
            child.wait()


def _inside(inner, outer) -> bool:
    x, y, w, h = inner
    X, Y, W, H = outer
    return X <= x and Y <= y and x + w <= X + W and y + h <= Y + H


def _check(m, avail, what):
    assert _inside(m["frame"], avail), f"{what}: the window {m['frame']} leaves the screen {avail}"
    sb = m["status"]
    assert _inside(sb, avail) and _inside(sb, m["frame"]), f"{what}: the status bar {sb} is off the screen {avail}"
    assert sb[3] >= m["status_min"] and not m["status_whole"], f"{what}: status bar cut: {m['status_whole']}"
    room, need = m["status_room"]
    assert need > 100 and room >= need, (
        f"{what}: the status bar leaves a message {room} px, the load's line needs {need}"
    )
    for key, (r, (mw, mh), (pw, ph)) in m["docks"].items():
        assert _inside(r, avail) and _inside(r, m["frame"]), f"{what}: {key} {r} leaves the screen {avail}"
        assert r[2] >= max(mw, pw) and r[3] >= max(mh, ph), (
            f"{what}: {key} is {r[2:]}, below its minimum {max(mw, pw)}x{max(mh, ph)}"
        )
    for unelided, cut in m["tabs"]:
        assert unelided and not cut, f"{what}: dock tabs elided or cut: {cut}"
    shown, pitch, line = m["next"]
    assert shown >= 4 and pitch >= line, (
        f"{what}: next token shows {shown} rows {pitch:.1f} px apart, labels {line} px high"
    )


# every size at scale 1; at scale 2 (a HiDPI screen of twice the pixels) the laptop's and the largest
SCALED = [(size, 1) for size in SIZES] + [((1366, 768), 2), ((2560, 1440), 2)]


@pytest.mark.parametrize("size,scale", SCALED, ids=[f"{w}x{h}_scale{k}" for (w, h), k in SCALED])
def test_first_and_maximised_windows_fit_the_screen_in_every_workspace(on_screen, size, scale):
    r = on_screen(size, scale)
    assert r["dpr"] == scale
    avail = r["avail"]
    assert avail == [0, 0, *size]
    first = r["first"]
    _check(first, avail, "first window")
    # the first window uses the screen: all of a laptop's, most of a large one's
    assert first["frame"][2] >= 0.85 * size[0] and first["frame"][3] >= 0.85 * size[1] - 32, first["frame"]
    assert set(first["docks"]) >= set(PANEL_MIN) - {"mask"}
    for name, m in r["maximised"].items():
        assert m["workspace"] == name
        _check(m, avail, f"maximised, {name} workspace")
        assert m["frame"][3] >= size[1] - 8, f"{name}: not maximised: {m['frame']}"
    # the Q/K/V heatmaps have rows to read, the lab's plot its height, the lens's words whole
    assert r["maximised"]["Attention"]["kv_rows_px"] >= 70
    height, minimum = r["lab_plot"]
    assert minimum >= 140 and height >= minimum
    assert not r["lens_cut"] and len(r["lens_shown"]) >= 5, r


def test_screenshot_takes_a_size_and_shows_whole_tab_titles(tiny_dir, tmp_path, monkeypatch):
    from PySide6.QtGui import QImage
    from PySide6.QtWidgets import QTabBar

    from gpt_inspector.cli import build_parser, main
    from gpt_inspector.gui import app

    seen = []
    grab = MainWindow.grab

    def look_then_grab(win, *a):  # what the PNG will show, read off the window as it is grabbed
        bars = [b for b in win.findChildren(QTabBar) if b.parent() is win and b.isVisible() and b.count()]
        seen.append(
            [
                (b.elideMode(), [b.tabText(i) for i in range(b.count()) if not b.rect().contains(b.tabRect(i))])
                for b in bars
            ]
        )
        return grab(win, *a)

    monkeypatch.setattr(MainWindow, "grab", look_then_grab)
    base = ["--model", str(tiny_dir["gpt2"]), "--device", "cpu", "--prompt", "One two three", "--steps", "2"]
    for extra, want in (([], (1366, 768)), (["--screenshot-size", "1920x1080"], (1920, 1080))):
        out = tmp_path / f"shot-{want[0]}.png"
        assert app.run(build_parser().parse_args([*base, "--screenshot", str(out), *extra])) == 0
        img = QImage(str(out))
        assert (img.width(), img.height()) == want
        assert seen[-1] and all(mode == Qt.TextElideMode.ElideNone and not cut for mode, cut in seen[-1]), seen[-1]
    with pytest.raises(SystemExit) as e:
        main(["--screenshot", str(tmp_path / "x.png"), "--screenshot-size", "1366"])
    assert e.value.code == 2
