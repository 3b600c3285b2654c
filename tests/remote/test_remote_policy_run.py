"""The KV lab's "Show policy run" over the link (a real ``serve`` process): a window on the engine and a
window on a local session of the same checkpoint get the same clicks and keys (Run, Show policy run,
the next head and layer, Step and Step back in the window, the lab's own Step and Back), and show the
same numbers, array for array: the score matrix with the evicted columns masked, the KV cache panel's
greyed rows, the lab's table. Then the quantizing policy's row error and the engine's refusals."""

# ruff: noqa: F811  (the fixtures imported from the other remote tests are redefined as test arguments)

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
import torch
from test_remote_fuzz import _answer, _still_serving, _ws

import gpt_inspector as gi
from gpt_inspector.core.compare import compare
from gpt_inspector.core.errors import InspectorError
from gpt_inspector.core.kvlab import KVLab, make, policy_rows
from gpt_inspector.core.trace import save_refusal
from gpt_inspector.remote import wire

pytest.importorskip("pytestqt")

from keys import press, wait  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402
from test_remote_labs import _no_seconds, _type  # noqa: E402
from test_remote_window import PROMPT, no_dialogs, window  # noqa: E402, F401  (fixtures)

from gpt_inspector.gui.snapshot import PARTS  # noqa: E402


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    return a == b


def _same_on_screen(wins) -> None:
    """What the two windows show, field for field of their snapshots and in the panels' widgets."""
    a, b = (w.snapshot for w in wins)
    assert (a.T, a.query, a.selection, dict(a.live.refused)) == (b.T, b.query, b.selection, dict(b.live.refused))
    for part, cls in PARTS.items():
        for f in fields(cls):
            x, y = getattr(getattr(a, part), f.name), getattr(getattr(b, part), f.name)
            if f.name == "step":  # a Step: what the panels show of it
                x, y = [(s.token_id, s.prob, s.entropy, list(s.top)) for s in (x, y)]
            assert _equal(x, y), f"{part}.{f.name}"
    for w in wins:  # the same snapshot on screen, not only built
        assert np.array_equal(w.score_matrix.image.image, w.snapshot.scores.matrix, equal_nan=True)
    (sa, ka), (sb, kb) = ((w.score_matrix, w.kv_cache) for w in wins)
    assert sa.title.text() == sb.title.text() and ka.title.text() == kb.title.text()
    assert ka.axis.labels == kb.axis.labels
    for va, vb in zip(ka.evicted_veils, kb.evicted_veils):
        assert va.isVisible() == vb.isVisible() and _equal(va.image, vb.image)
    pa, pb = (w.kvlab_panel for w in wins)
    assert pa.status.text() == pb.status.text() and pa.table.rowCount() == pb.table.rowCount()
    for r in range(pa.table.rowCount()):
        for c in range(pa.table.columnCount()):
            assert pa.table.item(r, c).text() == pb.table.item(r, c).text()


def _local_window(qtbot, local_lm):
    from gpt_inspector.gui.main_window import MainWindow

    win = MainWindow(restore_layout=False)
    qtbot.addWidget(win)
    win.resize(1400, 900)
    win.show()
    win.show_source(gi.Session(local_lm, PROMPT))
    wait(qtbot, win)
    return win


def test_show_policy_run_over_the_link_shows_what_a_local_window_shows(server, window, local_lm, qtbot, no_dialogs,
                                                                        tmp_path, monkeypatch):  # fmt: skip
    remote, r = window(server.url)
    wins = [_local_window(qtbot, local_lm), remote]
    try:
        _journey(qtbot, wins, no_dialogs, r)
        _saved(qtbot, wins, tmp_path, monkeypatch)
    finally:
        wins[0].worker.stop()


def _saved(qtbot, wins, tmp_path, monkeypatch) -> None:
    """Ctrl+S on the shown policy run: the engine writes its trace (with when each entry was evicted), the
    file lands here, and it reads back as the local window's file does."""
    from PySide6.QtWidgets import QFileDialog

    paths = [tmp_path / "local.safetensors", tmp_path / "remote.safetensors"]
    for w, path in zip(wins, paths):
        monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, p=path, **k: (str(p), ""))
        w.activateWindow()
        qtbot.waitUntil(w.isActiveWindow, timeout=5000)
        press(qtbot, w, Qt.Key.Key_S, Qt.KeyboardModifier.ControlModifier)
        qtbot.waitUntil(lambda: w.statusBar().currentMessage().startswith(f"Saved trace to {path}"), timeout=30000)
    a, b = (gi.load_trace(p) for p in paths)
    t = a.cache_length
    assert a.tokens == b.tokens and t == b.cache_length and a.kv_policy.name == b.kv_policy.name
    for layer in range(a.n_layers):
        assert torch.equal(a.attention_rows(layer, 0, t), b.attention_rows(layer, 0, t))
        assert torch.equal(a.kv_policy.evicted(layer, t), b.kv_policy.evicted(layer, t))
    assert a.kv_cache_bytes() == b.kv_cache_bytes() and b.kv_policy.evicted(0, t).any()


def _journey(qtbot, wins, no_dialogs, r) -> None:
    def each(act) -> None:
        for w in wins:
            act(w)

    def click(name: str) -> None:
        for w in wins:
            button = getattr(w.kvlab_panel, name)
            qtbot.waitUntil(button.isEnabled, timeout=30000)
            qtbot.mouseClick(button, Qt.MouseButton.LeftButton)

    def lab_steps(n: int) -> None:  # the lab's plot and table, and the window's run, after a lab step or back
        for w in wins:
            p = w.kvlab_panel
            qtbot.waitUntil(lambda: p.view is not None and len(p.view.steps) == n and not p.job.running, timeout=60000)
        a, b = (w.kvlab_panel.view for w in wins)
        assert [s.to_json() for s in a.steps] == [s.to_json() for s in b.steps]

    def key(k, mod=Qt.KeyboardModifier.NoModifier) -> None:
        for w in wins:  # two windows: the one pressed into is the active one, as a user's is
            w.activateWindow()
            qtbot.waitUntil(w.isActiveWindow, timeout=5000)
            w.score_matrix.setFocus()
            press(qtbot, w, k, mod)
            wait(qtbot, w)

    def run_steps(n: int) -> None:
        for w in wins:
            qtbot.waitUntil(lambda: w.snapshot is not None and w.snapshot.n_steps == n and not w.busy, timeout=60000)
            wait(qtbot, w)

    for w in wins:
        p = w.kvlab_panel
        w.raise_panel(p)
        qtbot.waitUntil(p.run_button.isEnabled, timeout=10000)
        _type(qtbot, p.budget, "4")
        _type(qtbot, p.steps, "5")
        assert p.settings() == ("h2o", 4, 5, False)
    click("run_button")
    lab_steps(5)
    click("show_button")
    for w in wins:
        qtbot.waitUntil(lambda: "KV lab policy run" in w.windowTitle() and not w.kvlab_panel.job.running,
                        timeout=30000)  # fmt: skip
    run_steps(5)
    snap = wins[1].snapshot
    assert not snap.read_only and wins[1].acts.step.isEnabled() and "on engine" in wins[1].windowTitle()
    _same_on_screen(wins)
    # the policy evicted rows, and the score matrix masks their columns below the diagonal
    t = snap.T
    assert snap.kv.kv_evicted.any() and not snap.scores.allowed[np.tril_indices(t)].all()
    key(Qt.Key.Key_BracketRight)  # the next head, then the next layer: read from the policy run
    key(Qt.Key.Key_PageDown)
    assert wins[1].snapshot.selection.layer == 1 and wins[1].snapshot.selection.head == 1
    _same_on_screen(wins)

    key(Qt.Key.Key_F10)  # the window steps the policy run on its own: the policy keeps evicting
    run_steps(6)
    _same_on_screen(wins)
    sent = []  # what the remote window asks of the engine (the policy run's requests go over r's link)
    call = r._call_t

    def logged(op, _job=None, **args):
        sent.append((op, args))
        return call(op, _job, **args)

    r._call_t = logged
    key(Qt.Key.Key_F10)
    run_steps(7)
    r._call_t = call
    # one round trip: the step's reply carried the last repaint's reads moved on, the evicted rows among them
    assert [op for op, _ in sent if op != "recipe"] == ["step"], sent
    assert sent[0][1]["policy_run"] == wins[1].kvlab_panel.lab.id
    assert {"op": "policy_rows", "args": {"layer": 1}} in sent[0][1]["then"]
    _same_on_screen(wins)
    click("step_button")  # ...and the lab's own Step says why not, in the same words on both
    for w in wins:
        qtbot.waitUntil(lambda: "outside the lab" in w.kvlab_panel.status.text(), timeout=30000)
    assert [t for t, _ in no_dialogs] == ["Cannot run the KV cache lab"] * 2
    no_dialogs.clear()
    for w in wins:
        w.errors.clear()

    for n in (6, 5):  # back to the lab's last step: the lab as it was
        key(Qt.Key.Key_F10, Qt.KeyboardModifier.ShiftModifier)
        run_steps(n)
    key(Qt.Key.Key_F10, Qt.KeyboardModifier.ShiftModifier)  # one more: a lab step undone, the panel follows
    run_steps(4)
    lab_steps(4)
    _same_on_screen(wins)
    click("step_button")  # the lab steps again from there, and the window shows its run step with it
    lab_steps(5)
    run_steps(5)
    _same_on_screen(wins)
    click("back_button")
    lab_steps(4)
    run_steps(4)
    _same_on_screen(wins)
    assert not no_dialogs and not any(w.errors for w in wins)


def test_a_quantized_policy_runs_row_error_and_a_replaced_lab(server, local_lm):
    with gi.connect(server.url, prompt=PROMPT) as r:
        lab = r.remote_kvlab("int4", None, 12)
        run = lab.policy_run()
        assert lab.policy_run() is run  # shown twice: the same run
        local = KVLab(local_lm, policy=make("int4"), prompt_ids=list(r.prompt_ids))
        local.run_steps(12)
        assert run.tokens == local.run.tokens and run.cache_length == local.run.cache_length
        for layer in range(local_lm.n_layers):
            (ev, err), (lev, lerr) = policy_rows(run, layer), policy_rows(local.run, layer)
            assert err.dtype == lerr.dtype == np.float32 and np.array_equal(err, lerr) and err.max() > 0
            assert np.array_equal(ev, lev) and not ev.any()  # a quantized cache evicts nothing
            assert torch.equal(run.allowed_rows(layer, 0, run.cache_length),
                               local.run.allowed_rows(layer, 0, local.run.cache_length))  # fmt: skip
        assert run.kv_cache_bytes() == local.run.kv_cache_bytes()  # the quantized store's bytes
        assert dict(run.live.refused) == dict(local.run.live.refused) and not run.live.can("probe")
        assert save_refusal(run) == save_refusal(local.run) is not None  # a quantizing policy's run is not saved
        with pytest.raises(InspectorError, match="not available on a KV cache policy's run"):
            run.set_mask_edits([gi.MaskEdit(query=5, key=2)])
        with pytest.raises(InspectorError, match="not served for this run"):
            run._call("assisted_back")  # an op the policy run does not take never reaches the live session
        # Compare and Run with the policy run shown start from its prompt, as they do locally
        got = run.remote_compare(max_new_tokens=3, num_beams=2)
        want = compare(local_lm, prompt_ids=list(local.run.prompt_ids), max_new_tokens=3, num_beams=2)
        assert _no_seconds(got.to_json()) == _no_seconds(want.to_json())
        assert got.beam_view(0).tokens == want.beam_view(0).tokens  # its beams are read over the session's link
        again = run.remote_kvlab("h2o", 4, 2)
        twin = KVLab(local_lm, policy=make("h2o", 4), prompt_ids=list(r.prompt_ids))
        twin.run_steps(2)
        assert [s.to_json() for s in again.history] == [s.to_json() for s in twin.history]
        with pytest.raises(InspectorError, match="no longer on the engine"):  # that Run replaced this run's lab
            run.attention_rows(0, 0, 2)
        assert r.n_steps == 0  # the live session was never touched


@pytest.mark.parametrize(
    "op, args, words",
    [
        ("state", {"policy_run": "LAB+1"}, "no longer on the engine"),
        ("state", {"policy_run": -1}, "must lie in"),
        ("state", {"policy_run": [0]}, "must be an integer"),
        ("state", {"policy_run": "LAB", "beam": [0, 0]}, "names one run"),
        ("policy_rows", {"layer": 0}, "name it (policy_run)"),
        ("policy_rows", {"layer": 9, "policy_run": "LAB"}, "layer"),
        ("open", {"prompt": "x", "policy_run": "LAB"}, "unknown argument 'policy_run'"),
        ("kvlab_step", {"lab": "LAB", "policy_run": "LAB"}, "unknown argument 'policy_run'"),
        (
            "step",
            {"policy_run": "LAB", "then": [{"op": "policy_rows", "args": {"layer": 0, "policy_run": "LAB"}}]},
            "unknown argument 'policy_run'",
        ),  # a read after a step reads the run that stepped  # fmt: skip
        ("set_head_edits", {"edits": [{"layer": 0, "head": 1}], "policy_run": "LAB"}, "KV cache policy's run"),
    ],
)
def test_malformed_policy_run_requests_are_refused_in_one_line(server, op, args, words):
    with _ws(server.url) as ws:
        ws.send(wire.request("open", 1, {"prompt": PROMPT}))
        assert _answer(ws)["ok"]
        ws.send(wire.request("kvlab_run", 2, {"policy": "h2o", "budget": 4, "steps": 2}))
        data = ws.recv(timeout=60)
        while wire.check_note(data, 2) is not None:  # a job's progress notes come before its reply
            data = ws.recv(timeout=60)
        head, metas = wire.check_reply(data, 2)
        for meta in metas:
            wire.tensor_from(ws.recv(timeout=60), *meta)
        assert head["ok"]
        lab = head["result"]["lab"]
        named = {"LAB": lab, "LAB+1": lab + 1}

        def put(v):
            if isinstance(v, dict):
                return {k: put(x) for k, x in v.items()}
            if isinstance(v, list):
                return [put(x) for x in v]
            return named.get(v, v) if isinstance(v, str) else v

        ws.send(wire.request(op, 3, put(args)))
        head = _answer(ws)
        assert not head["ok"] and words in head["error"], head["error"]
        ws.send(wire.request("state", 4, {"policy_run": lab}))  # the lab's run is still there, as it was
        head = _answer(ws)
        assert head["ok"] and head["result"]["n_steps"] == 2
        _still_serving(ws)
