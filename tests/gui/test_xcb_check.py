"""On a minimal Linux desktop the window says which packages to install instead of aborting."""

from __future__ import annotations

import ctypes.util

from gpt_inspector.gui import app


def _no_libs(monkeypatch, missing):
    real = ctypes.util.find_library
    names = {app.XCB_PACKAGES[p][0] for p in missing}
    monkeypatch.setattr(ctypes.util, "find_library", lambda n: None if n in names else (real(n) or f"lib{n}.so"))
    monkeypatch.setattr(app, "_loadable", lambda soname: False)


def test_missing_xcb_libraries_name_the_apt_get_command(monkeypatch, capsys):
    monkeypatch.setattr(app.sys, "platform", "linux")
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.delenv("QT_QPA_PLATFORM", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    _no_libs(monkeypatch, ["libxcb-cursor0", "libxkbcommon-x11-0"])
    assert app.missing_xcb_packages() == ["libxcb-cursor0", "libxkbcommon-x11-0"]
    assert app.run(None) == 2  # before any QApplication: Qt would abort the process
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "sudo apt-get install -y libxcb-cursor0 libxkbcommon-x11-0" in err[0]


def test_every_library_present_or_another_platform_means_no_complaint(monkeypatch):
    monkeypatch.setattr(app.sys, "platform", "linux")
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.setattr(ctypes.util, "find_library", lambda n: f"lib{n}.so")
    monkeypatch.delenv("QT_QPA_PLATFORM", raising=False)
    assert app.xcb_problem() is None
    _no_libs(monkeypatch, list(app.XCB_PACKAGES))
    assert "libxcb-icccm4" in app.xcb_problem()
    for platform in ("offscreen", "wayland", "minimal"):
        monkeypatch.setenv("QT_QPA_PLATFORM", platform)
        assert app.xcb_problem() is None
    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    assert app.xcb_problem() is not None
    monkeypatch.delenv("DISPLAY")
    assert app.xcb_problem() is None
