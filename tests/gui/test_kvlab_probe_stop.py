"""The KV lab panel's Stop (or Esc) during the cache probe, in a local window: the probe ends between two
forward passes, the panel says so without a dialog, and the lab is as it was (its next step is the
reference lab's)."""

from __future__ import annotations

import pytest
from keys import run_lab, stop_the_probe
from PySide6.QtCore import Qt

# long enough that the probe runs for seconds (~90 forward passes on the tiny model): Stop lands in it
PROMPT = " ".join(["She eats an apple. He reads"] * 3)


@pytest.mark.parametrize("how", ["Stop", "Esc"])
def test_stop_ends_the_cache_probe_and_the_lab_stays(make_window, wait_idle, qtbot, tiny_lm, no_dialogs, how):
    from gpt_inspector.core.kvlab import KVLab, make

    win = make_window(prompt=PROMPT)
    panel = run_lab(qtbot, win, "h2o", 4, 2)
    wait_idle(win)

    stop_the_probe(qtbot, win, panel, how, timeout=20000)
    assert not no_dialogs

    ref = KVLab(tiny_lm("gpt2"), PROMPT, make("h2o", 4, **panel.options()))
    ref.run_steps(2)
    qtbot.mouseClick(panel.step_button, Qt.MouseButton.LeftButton)  # the lab goes on as if no probe had run
    qtbot.waitUntil(lambda: len(panel.view.steps) == 3 and not panel.job.running, timeout=20000)
    ref.step()
    assert [s.to_json() for s in panel.view.steps] == [s.to_json() for s in ref.history]
