"""Tools ▸ Probe, Tools ▸ Check math and the lens with a beam, a trace or a KV-lab policy run on screen:
each panel shows a result or the source's one-line reason; an error is a dialog."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("pytestqt")

import gpt_inspector as gi  # noqa: E402
from gpt_inspector.core.beams import BeamSearch  # noqa: E402
from gpt_inspector.core.kvlab import KVLab, make  # noqa: E402
from gpt_inspector.core.mathcheck import check, check_all  # noqa: E402

PROMPT = "She eats an apple. He reads"
PROBE = "Probe the KV cache (checked layers)"
CHECK = "Check the math of the selected head"
CHECK_ALL = "Check the math of every head"
LENS = "Logit lens of the current step"


def _trigger(win, text: str) -> None:
    acts = [a for a in win.tools_menu.actions() if a.text() == text]
    assert len(acts) == 1, text
    acts[0].trigger()


@pytest.fixture
def on_screen(make_window, wait_idle, tiny_lm, tmp_path):
    """``on_screen(kind)`` -> (window, an equal source kept here for the expected numbers)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model; threads only add OpenMP spinning on a busy machine

    def show(kind: str):
        lm = tiny_lm("llama")
        win = make_window("llama", prompt=PROMPT)
        if kind == "beam":
            bs = BeamSearch(lm, PROMPT, num_beams=2, num_return_sequences=2, max_new_tokens=3)
            bs.run()
            twin = BeamSearch(lm, PROMPT, num_beams=2, num_return_sequences=2, max_new_tokens=3)
            twin.run()
            win.show_source(bs.result_view(1))  # the search is finished: the worker owns the view from here
            mine = twin.result_view(1)
        elif kind == "trace":
            mine = gi.Session(lm, PROMPT)
            mine.run(3)
            mine.save_trace(tmp_path / "t.safetensors")
            mine = gi.load_trace(tmp_path / "t.safetensors")
            win.open_trace(str(tmp_path / "t.safetensors"))
        else:
            lab = KVLab(lm, PROMPT, make("streaming", 6))
            lab.run_steps(4)
            twin = KVLab(lm, PROMPT, make("streaming", 6))
            twin.run_steps(4)
            win.show_source(lab.run)
            mine = twin.run
        snap = wait_idle(win)
        assert snap.T == mine.cache_length and snap.token_ids == tuple(mine.tokens)
        return win, mine

    yield show
    torch.set_num_threads(n)


@pytest.mark.parametrize("kind", ["beam", "trace", "policy run"])
def test_the_math_check_shows_a_result_on_every_source(on_screen, wait_idle, qtbot, no_dialogs, kind):
    win, mine = on_screen(kind)
    panel = win.mathcheck_panel
    win.select(layer=1, head=3)
    wait_idle(win)
    _trigger(win, CHECK)
    qtbot.waitUntil(lambda: panel.check is not None, timeout=20000)
    want = check(mine, 1, 3)
    got = panel.check
    assert (got.layer, got.head, got.position) == (1, 3, mine.cache_length - 1)
    np.testing.assert_array_equal(got.recomputed, want.recomputed)
    np.testing.assert_array_equal(got.model, want.model)
    assert "✓ match" in panel.verdict.text()
    _trigger(win, CHECK_ALL)
    qtbot.waitUntil(lambda: panel.report is not None, timeout=20000)
    report = check_all(mine)
    np.testing.assert_array_equal(panel.report.max_diff, report.max_diff)
    assert panel.heads.rowCount() == mine.n_layers and report.ok
    assert not no_dialogs and not win.errors


@pytest.mark.parametrize("kind,says", [("trace", "a trace file has no model"), ("policy run", "KV cache lab's Probe")])
def test_the_probe_says_in_one_line_why_it_cannot_run(on_screen, qtbot, no_dialogs, kind, says):
    win, mine = on_screen(kind)
    panel = win.probe_panel
    why = mine.live.why_not("probe")
    assert says in why and "\n" not in why
    assert not panel.probe_button.isEnabled() and panel.probe_button.toolTip() == why
    _trigger(win, PROBE)
    qtbot.waitUntil(lambda: panel.summary.text() == why, timeout=5000)
    assert panel.result is None and panel.table.rowCount() == 0
    assert not no_dialogs and not win.errors  # a capability the source lacks is not an error


def test_the_probe_reads_an_inspected_beam_back(on_screen, qtbot, no_dialogs):
    win, mine = on_screen("beam")
    panel = win.probe_panel
    assert panel.probe_button.isEnabled()
    _trigger(win, PROBE)  # raised AttributeError ('BeamView' has no 'cache') before the run-source protocol
    qtbot.waitUntil(lambda: panel.result is not None, timeout=20000)
    assert panel.result.true_tokens == mine.processed_tokens and panel.result.all_recovered
    assert panel.table.rowCount() == mine.cache_length
    assert [panel.table.item(r, 2).text() for r in range(mine.cache_length)] == mine.token_labels(mine.processed_tokens)
    assert f"recovered {mine.cache_length}/{mine.cache_length}" in panel.summary.text()
    assert not no_dialogs and not win.errors


def test_the_lens_says_why_not_on_a_beam(on_screen, qtbot, no_dialogs):
    win, mine = on_screen("beam")
    win.raise_panel(win.lens_panel)
    qtbot.waitUntil(lambda: win.lens_panel.status.text() == mine.live.why_not("lens"), timeout=5000)
    assert "beam" in win.lens_panel.status.text() and not no_dialogs


def test_a_math_check_error_is_a_dialog(on_screen, wait_idle, qtbot, no_dialogs):
    # a trace keeps head outputs from the prompt's last position on; an earlier query is the user's error
    win, mine = on_screen("trace")
    win.controller.select_query(0)
    assert wait_idle(win).query == 0
    _trigger(win, CHECK)
    qtbot.waitUntil(lambda: bool(no_dialogs), timeout=20000)
    title, text = no_dialogs[-1]
    assert title == "Math check failed" and "is not kept" in text and "\n" not in text
    assert win.mathcheck_panel.check is None


def test_stepping_a_beam_is_refused_in_the_beams_own_words(on_screen, wait_idle, qtbot, no_dialogs):
    win, mine = on_screen("beam")
    assert not win.acts.step.isEnabled() and not win.controller.live
    win.controller.step()  # what a script or a stale shortcut would post
    qtbot.waitUntil(lambda: bool(no_dialogs), timeout=20000)
    assert no_dialogs[-1][1] == mine.live.why_not("step") and "a beam is read-only" in no_dialogs[-1][1]
    assert wait_idle(win).n_steps == mine.n_steps  # the beam is shown as it was
