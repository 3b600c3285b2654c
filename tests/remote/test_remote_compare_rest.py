"""Compare's last gaps over the link (a real ``serve`` process): "Inspect beam" in a window on a remote
engine (the engine keeps its last comparison and answers the inspected beam's reads from it; every
number the window shows is a local Inspect's of the same comparison on the same checkpoint), and
``compare --connect --assistant-model DIR`` (the draft loaded from the engine's disk; the output is a
local run's)."""

# ruff: noqa: F811  (the fixtures imported from the other remote tests are redefined as test arguments)

from __future__ import annotations

import json

import pytest
import torch
from on_device import DEVICE

from gpt_inspector.core.compare import compare
from gpt_inspector.core.errors import InspectorError

pytest.importorskip("pytestqt")

from keys import press, wait  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402
from test_remote_labs import _no_seconds, _type  # noqa: E402
from test_remote_window import PROMPT, no_dialogs, same_as_local, window  # noqa: E402, F401  (fixtures)

SETTINGS = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 4}


def test_inspect_beam_over_the_link_shows_the_local_inspects_numbers(
    server, window, local_lm, qtbot, no_dialogs, tmp_path, monkeypatch
):
    from PySide6.QtWidgets import QFileDialog

    from gpt_inspector import load_trace
    from gpt_inspector.gui.viewdata import ViewModel

    win, r = window(server.url)
    panel = win.compare_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.run_button.isEnabled, timeout=10000)
    _type(qtbot, panel.beams, "3")
    _type(qtbot, panel.returns, "2")
    _type(qtbot, panel.new_tokens, "4")
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.result is not None and not panel.job.running, timeout=60000)
    assert panel.inspect_button.isEnabled() and panel.inspect_pick.count() == 2
    local = compare(local_lm, prompt_ids=list(r.prompt_ids), **SETTINGS)

    panel.inspect_pick.setFocus()
    qtbot.keyClick(panel.inspect_pick, Qt.Key.Key_Down)  # beam 2
    assert panel.inspect_pick.currentIndex() == 1
    qtbot.mouseClick(panel.inspect_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "Beam 2" in win.windowTitle(), timeout=30000)
    snap = wait(qtbot, win)
    assert snap.read_only and "read-only" in win.windowTitle() and not win.acts.step.isEnabled()
    beam = local.beam_view(1)
    assert list(snap.tokens.token_ids) == beam.tokens and beam.tokens != local.beam_view(0).tokens
    vm = ViewModel(beam)
    same_as_local(snap, vm)

    win.score_matrix.setFocus()
    press(qtbot, win, Qt.Key.Key_BracketRight)  # the next head, then the next layer: read from the beam
    wait(qtbot, win)
    press(qtbot, win, Qt.Key.Key_PageDown)
    snap = wait(qtbot, win)
    assert (snap.selection.layer, snap.selection.head) == (1, 1)
    same_as_local(snap, vm)

    # Ctrl+S saves the beam: the engine writes its trace, the laptop keeps the file
    path = tmp_path / "beam.safetensors"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(path), ""))
    press(qtbot, win, Qt.Key.Key_S, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: win.statusBar().currentMessage().startswith(f"Saved trace to {path}"), timeout=30000)
    saved = load_trace(path)
    assert list(saved.tokens) == beam.tokens and saved.prompt_length == len(r.prompt_ids)
    assert torch.equal(saved.attention_rows(1, 0, 3), beam.attention_rows(1, 0, 3))

    # Ctrl+Tab: back to the live session, which the beam's reads left as it was; it steps on
    press(qtbot, win, Qt.Key.Key_Tab, Qt.KeyboardModifier.ControlModifier)
    back = wait(qtbot, win)
    assert not back.read_only and back.n_steps == 0 and list(back.tokens.token_ids) == list(r.prompt_ids)
    press(qtbot, win, Qt.Key.Key_F10)
    qtbot.waitUntil(lambda: win.snapshot is not None and win.snapshot.n_steps == 1, timeout=30000)
    assert not no_dialogs and not win.errors


def test_a_later_comparison_replaces_the_beams_kept_on_the_engine(server):
    import gpt_inspector as gi

    with gi.connect(server.url, prompt=PROMPT) as r:
        first = r.remote_compare(**SETTINGS)
        beam = first.beam_view(0)
        assert beam.live.why_not("step") and beam.read_only and beam.tokens == first.beams[0]["token_ids"]
        with pytest.raises(InspectorError, match="read-only"):
            beam.step()
        with pytest.raises(InspectorError, match=r"beam must be in \[0, 2\)"):
            first.beam_view(2)
        r.remote_compare(**SETTINGS)
        with pytest.raises(InspectorError, match="no longer on the engine"):
            first.beam_view(1)
        with pytest.raises(InspectorError, match="no longer on the engine"):
            beam.attention_rows(0, 0, 3)
        assert r.n_steps == 0 and r.step().index == 0  # the session itself is as it was


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A draft on the engine's disk: another tiny Llama (other weights) with the target's tokenizer."""
    import tiny_models

    return tiny_models.build(tmp_path_factory.mktemp("draft") / "draft", "llama", seed=7)


def test_compare_connect_with_a_draft_on_the_engines_disk_prints_a_local_runs_output(server, tiny_llama, draft, capsys):
    from gpt_inspector.cli import main

    cmp = ["compare", "--prompt", PROMPT, "--max-new-tokens", "6", "--num-beams", "2", "--assistant-model", str(draft),
           "--num-assistant-tokens", "3", "--json"]  # fmt: skip
    outs = []
    for where in (["--connect", server.url], ["--model", str(tiny_llama), "--device", DEVICE]):
        assert main([*cmp, *where]) == 0
        outs.append(_no_seconds(json.loads(capsys.readouterr().out)))
    assert outs[0]["assisted"]["assisted"]["mode"] == "draft model" and outs[0]["assisted"]["rounds"]
    assert outs[0]["assisted"]["token_ids"] == outs[0]["greedy"]["token_ids"]  # assisted greedy: greedy's tokens
    assert outs[0] == outs[1]
    # a folder the engine's machine does not have: one line, exit 2
    assert main([*cmp[:-5], "--assistant-model", str(draft / "missing"), "--connect", server.url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no folder" in err and "engine's machine" in err


@pytest.mark.parametrize(
    "op, args, words",
    [
        ("state", {"beam": [1 << 40, 0]}, "no longer on the engine"),
        ("state", {"beam": [1]}, "[comparison, beam]"),
        ("attention_rows", {"layer": 0, "p0": 0, "p1": 1, "beam": [0, -1]}, "must lie in"),
        ("step", {"beam": [1, 0]}, "unknown argument 'beam'"),  # a beam is read, never stepped
        ("compare", {"max_new_tokens": 2, "assistant": "/nowhere"}, "no folder '/nowhere' on the engine's machine"),
    ],
)
def test_malformed_beam_reads_and_drafts_are_refused_in_one_line(server, op, args, words):
    from test_remote_fuzz import _answer, _still_serving, _ws

    from gpt_inspector.remote import wire

    with _ws(server.url) as ws:
        ws.send(wire.request("open", 1, {"prompt": PROMPT}))
        assert _answer(ws)["ok"]
        ws.send(wire.request(op, 2, args))
        head = _answer(ws)
        assert not head["ok"] and words in head["error"], head["error"]
        _still_serving(ws)
