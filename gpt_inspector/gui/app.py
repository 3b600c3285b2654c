"""Open the window (called by the CLI when no sub-command is given).

``--screenshot PATH`` makes it scriptable: load, run ``--steps`` steps, wait until every view
shows the result, save ``window.grab()`` and exit 0 (2 on an error, with one line on stderr). The
window is ``--screenshot-size`` (default 1366x768), whatever the screen: offscreen it is 800x800.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

SCREENSHOT_TIMEOUT_S = 600
SCREENSHOT_SIZE = (1366, 768)
DEFAULT_STEPS = 8

# What Qt's xcb platform plugin loads besides libxcb itself: Debian/Ubuntu package -> (library
# name for find_library, soname). A minimal desktop lacks some, and Qt then aborts (exit 134)
# with a message about "no Qt platform plugin could be initialized" that names none of them.
XCB_PACKAGES = {
    "libxcb-cursor0": ("xcb-cursor", "libxcb-cursor.so.0"),
    "libxcb-icccm4": ("xcb-icccm", "libxcb-icccm.so.4"),
    "libxcb-keysyms1": ("xcb-keysyms", "libxcb-keysyms.so.1"),
    "libxcb-image0": ("xcb-image", "libxcb-image.so.0"),
    "libxcb-render-util0": ("xcb-render-util", "libxcb-render-util.so.0"),
    "libxcb-shape0": ("xcb-shape", "libxcb-shape.so.0"),
    "libxcb-xkb1": ("xcb-xkb", "libxcb-xkb.so.1"),
    "libxkbcommon-x11-0": ("xkbcommon-x11", "libxkbcommon-x11.so.0"),
}


def _get(args, name, default=None):
    return getattr(args, name, default) if args is not None else default


def _no_display() -> bool:
    if sys.platform != "linux" or os.environ.get("QT_QPA_PLATFORM"):
        return False
    return not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _uses_xcb() -> bool:
    if sys.platform != "linux" or not os.environ.get("DISPLAY"):
        return False
    qpa = os.environ.get("QT_QPA_PLATFORM", "")
    if qpa:
        return qpa.split(":")[0].split(";")[0] == "xcb"
    return not os.environ.get("WAYLAND_DISPLAY")  # else Qt may pick wayland, which needs none of these


def _loadable(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def missing_xcb_packages() -> list[str]:
    """The packages whose libraries Qt's xcb plugin would fail to load (in XCB_PACKAGES order)."""
    # find_library sees what ldconfig knows; loading by soname also finds LD_LIBRARY_PATH's
    return [pkg for pkg, (name, soname) in XCB_PACKAGES.items()
            if ctypes.util.find_library(name) is None and not _loadable(soname)]  # fmt: skip


def xcb_problem() -> str | None:
    """One line saying what to install, when the window would open on xcb and cannot; else None."""
    if not _uses_xcb():
        return None
    missing = missing_xcb_packages()
    if not missing:
        return None
    return (f"Qt cannot open a window: system libraries are missing ({', '.join(missing)}); "
            f"install them with: sudo apt-get install -y {' '.join(missing)}")  # fmt: skip


def _sweep_leftovers() -> None:
    """The temporaries a killed save left (kill -9 mid-write) in the folders this tool writes to, the
    autosaves' and the recent traces', go at the next start (a write sweeps its own folder too)."""
    from pathlib import Path

    from ..core.outfile import remove_leftovers
    from . import autosave, settings
    from .actions import RECENT_TRACES

    for folder in {autosave.path().parent, *(Path(p).expanduser().parent for p in settings.recent(RECENT_TRACES))}:
        remove_leftovers(folder)


def _offer_restore(win) -> dict | None:
    """Ask whether to bring back a session whose window is gone (crashed); a no discards those."""
    from PySide6.QtWidgets import QMessageBox

    from . import autosave

    rejected: list[str] = []
    found = autosave.read_with_owner(rejected)
    for line in rejected:  # checked whole before the question: a bad file never reaches the window
        print(f"gpt-inspector: {line}", file=sys.stderr)
        win.statusBar().showMessage(line)
    if found is None:
        return None
    recipe, owner = found
    remote = "remote" in recipe  # it ran on an engine: reconnect there, or rebuild it there if the engine lost it
    answer = QMessageBox.question(
        win, "Reconnect to the last session?" if remote else "Restore the last session?",
        "gpt-inspector saved your last session:\n\n" + autosave.summary(recipe) + "\n\n"
        + ("Reconnect to the engine and take it back (rebuilt there from the saved recipe if the engine no "
           "longer holds it)?" if remote else "Restore it?"),
        QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No, QMessageBox.StandardButton.Yes,
    )  # fmt: skip
    if answer == QMessageBox.StandardButton.Yes:
        # the restored session carries on in the same file, under the lock the offer claimed, so a clean
        # quit removes it and no stale copy is offered again
        autosave.release(win.worker.autosave_owner)
        win.worker.autosave_owner = owner
        return recipe
    autosave.clear(owner)  # the claimed file, then every other whose owner is gone; live windows keep theirs
    autosave.clear()
    return None


def _image_bytes(pixmap, fmt: str) -> bytes | None:
    """The pixmap encoded as ``fmt`` (PNG, JPG, ...), so the file goes through the one writer (Qt's save writes in place)."""
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice

    data = QByteArray()
    buf = QBuffer(data)
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    ok = pixmap.save(buf, fmt)
    buf.close()
    return bytes(data.data()) if ok else None


def _connect(args, sampler: dict, chat: dict | None = None):
    """The remote session ``--connect URL`` names (None without it): the server's own session, or a
    new one when ``--prompt`` is given or the server has none. InspectorError in one line otherwise."""
    url = _get(args, "connect")
    if not url:
        return None
    from ..remote.client import RemoteSession

    r = RemoteSession(url)
    prompt = _get(args, "prompt")
    if prompt is not None or chat is not None or not r.tokens:
        from .controls import DEFAULT_PROMPT

        extra = {k: v for k, v in sampler.items() if k not in ("temperature", "top_k", "top_p")}
        if chat is not None:  # the turns: the engine's tokenizer applies its template
            prompt, extra = "", {**extra, **chat}
        r.open(DEFAULT_PROMPT if prompt is None else prompt, sampler.get("temperature", 0.0), sampler.get("top_k"),
               sampler.get("top_p"), _get(args, "seed") or 0, **extra)  # fmt: skip
    return r


def run(args) -> int:
    from ..commands.common import prompt_args, window_settings

    sampler = window_settings(args)  # bad values: one line, exit 2, before any window
    start = prompt_args(args) if args is not None else {}  # a chat's turns: a bad file refused here too
    chat = start if "messages" in start else None
    screenshot = _get(args, "screenshot")
    if screenshot:
        from ..core import outfile
        from ..core.errors import InspectorError

        try:
            screenshot = str(outfile.check_writable(outfile.expand(screenshot)))
        except InspectorError as e:  # before the model loads and the steps run, not after
            print(f"gpt-inspector: error: --screenshot: {e}", file=sys.stderr)
            return 2
    if _no_display():
        if not screenshot:
            print("gpt-inspector: error: no display (DISPLAY is not set); run it in a desktop session, "
                  "or use a sub-command, or --screenshot to render offscreen", file=sys.stderr)  # fmt: skip
            return 2
        os.environ["QT_QPA_PLATFORM"] = "offscreen"  # a screenshot needs no screen
    problem = xcb_problem()
    if problem is not None:
        print(f"gpt-inspector: error: {problem}", file=sys.stderr)
        return 2
    remote = _connect(args, sampler, chat)  # a bad URL or token: one line, exit 2, before any window
    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from . import _pyside_fix, tour

    _pyside_fix.install()  # before the first signal: the bug it guards against counts from the start

    from .controls import DEFAULT_PROMPT
    from .main_window import MainWindow
    from .views.common import apply_theme
    from .worker import ModelSpec, SessionSpec

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setOrganizationName("gpt-inspector")
    app.setApplicationName("gpt-inspector")
    _sweep_leftovers()  # where the autosaves live is known once the names are set
    apply_theme(app)
    steps = _get(args, "steps")
    win = MainWindow(restore_layout=not screenshot)  # screenshots always show the default layout
    win.headless_errors = bool(screenshot)
    if screenshot:  # the offscreen screen is 800x800: a first window that fits it elided the tabs ("Ne…")
        win.resize(*(_get(args, "screenshot_size") or SCREENSHOT_SIZE))
    win.persist_layout = not screenshot
    prompt = prompt_given = _get(args, "prompt")
    if chat is not None:
        win.session_panel.set_chat(chat)
        prompt = ""
    elif prompt is not None:
        win.session_panel.prompt.setPlainText(prompt)
    else:
        prompt = win.session_panel.prompt.toPlainText() or DEFAULT_PROMPT
    spec = ModelSpec(_get(args, "model"), _get(args, "device") or "auto", _get(args, "dtype"),
                     bool(_get(args, "allow_pickle")), bool(_get(args, "trust_remote_code")),
                     bool(_get(args, "unverified")), device_map=_get(args, "device_map"),
                     max_memory=_get(args, "max_memory"), offload_folder=_get(args, "offload_folder"))  # fmt: skip
    win.session_panel.set_model_spec(spec)
    win.session_panel.set_sampler_settings(sampler)
    t, k, p = win.session_panel.decoding()
    win.worker.autosave = not screenshot
    win.show()
    recipe = None
    if (
        remote is None
        and not screenshot
        and _get(args, "model") is None
        and _get(args, "prompt") is None
        and chat is None
    ):
        recipe = _offer_restore(win)
    if remote is not None:
        from .remote_link import offer_rebuild

        # the engine restarted since this window's last session on it: offer to rebuild that session there
        rebuild = offer_rebuild(win, remote) if not screenshot and prompt_given is None and chat is None else None
        win.show_source(remote)  # the live session, on the engine: the controls show its prompt and seed
        if rebuild is not None:
            win.restore(rebuild)
    elif recipe is not None:
        win.restore(recipe)
    else:
        win.load_model(spec, SessionSpec(prompt, t, k, p, win.session_panel.seed.value(), sampler, chat=chat))
        if not screenshot:
            tour.offer_at_start(win)
    n = steps if steps is not None else (DEFAULT_STEPS if screenshot else None)
    if n:
        win.run(n)
    if not screenshot:
        rc = app.exec()
        if remote is not None:
            remote.close()  # the engine's one client slot is free at once, not when the process ends
        return rc

    status = {"rc": 0}
    # a local loop, not app.exec()/quit(): quitting the application would also stop every
    # QThread started later in this process (tests, embedding)
    loop = QEventLoop()

    def fail(message: str = "") -> None:
        if message:
            print(f"gpt-inspector: error: {message}", file=sys.stderr)
        status["rc"] = 2
        loop.quit()

    def finish():
        if win.errors:
            return fail()  # the error is printed already (headless_errors)
        # one more turn of the event loop so layouts settle, then paint everything into a pixmap
        QTimer.singleShot(300, shoot)

    def shoot():
        from ..core import outfile
        from ..core.errors import InspectorError

        app.processEvents()
        fmt = os.path.splitext(screenshot)[1][1:].upper() or "PNG"  # as Qt's own save chose it: by the suffix
        data = _image_bytes(win.grab(), fmt)
        if data is None:
            return fail(f"cannot write {screenshot}: Qt cannot encode a {fmt} image (use .png)")
        try:
            outfile.write_bytes(screenshot, data)
        except InspectorError as e:
            return fail(str(e))
        loop.quit()

    win.when_idle(finish)
    guard = QTimer(singleShot=True)
    guard.timeout.connect(lambda: fail("timed out waiting for the window"))
    guard.start(SCREENSHOT_TIMEOUT_S * 1000)
    loop.exec()
    guard.stop()
    win.close()
    if remote is not None:
        remote.close()
    return status["rc"]
