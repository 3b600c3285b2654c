"""The KV lab panel's Stop (or Esc) during the cache probe in a window on a real ``serve`` process: the cancel
reaches the engine, which ends the probe between two forward passes and keeps serving; the lab there
is as it was (its next step is a local lab's, bit for bit)."""

from __future__ import annotations

import pytest
from keys import stop_the_probe, wait
from test_remote_labs import _same_steps, _type
from test_remote_window import no_dialogs  # noqa: F401  (its fixture)

from gpt_inspector.core.kvlab import KVLab, make
from gpt_inspector.remote.client import RemoteSession

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402

# long enough that the probe runs for seconds (~90 forward passes on the tiny model): Stop lands in it
PROMPT = " ".join(["She eats an apple. He reads"] * 3)


@pytest.mark.parametrize("how", ["Stop", "Esc"])
def test_stop_cancels_the_cache_probe_on_the_engine(server, local_lm, qtbot, no_dialogs, how):  # noqa: F811 (the fixture imported above)
    from gpt_inspector.gui.main_window import MainWindow

    r = RemoteSession(server.url, timeout=20)
    r.open(PROMPT)
    win = MainWindow(restore_layout=False)
    qtbot.addWidget(win)
    try:
        win.resize(1400, 900)
        win.show()
        win.show_source(r)
        wait(qtbot, win)
        panel = win.kvlab_panel
        win.raise_panel(panel)
        qtbot.waitUntil(panel.run_button.isEnabled, timeout=10000)
        _type(qtbot, panel.budget, "4")
        _type(qtbot, panel.steps, "2")
        qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: panel.view is not None and not panel.job.running, timeout=60000)

        stop_the_probe(qtbot, win, panel, how, timeout=30000)  # the engine ends it between two forward passes
        assert not no_dialogs and not win.errors

        local = KVLab(local_lm, policy=make(panel.policy.currentText(), 4, **panel.options()),
                      prompt_ids=list(r.prompt_ids))  # fmt: skip
        local.run_steps(2)
        qtbot.mouseClick(panel.step_button, Qt.MouseButton.LeftButton)  # the engine's lab goes on as if no probe ran
        local.step()
        qtbot.waitUntil(lambda: len(panel.view.steps) == 3 and not panel.job.running, timeout=30000)
        _same_steps(panel.view.steps, local.history)
    finally:
        win.worker.stop()
        r.close()
