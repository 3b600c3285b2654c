"""The KV cache lab and Compare on a remote engine (a real ``serve`` process): the window's panels
driven by clicks and keys, ``kv-lab`` / ``compare --connect``, a cancel, and malformed requests.
Every number is the local session's on the same checkpoint (the server runs one torch thread, as the
tests do: the same bits)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from on_device import DEVICE
from test_remote_fuzz import _answer, _still_serving, _ws

import gpt_inspector as gi
from gpt_inspector.core.compare import compare
from gpt_inspector.core.errors import Cancelled
from gpt_inspector.core.kvlab import KVLab, make
from gpt_inspector.core.kvlab.lab import final_rows
from gpt_inspector.remote import wire

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402
from test_remote_window import PROMPT, no_dialogs, window  # noqa: E402, F401  (their fixtures)


def _no_seconds(d):
    """A comparison's JSON without the assisted rounds' wall-clock times (the only numbers not computed)."""
    for row in [d.get("assisted") or {}, *d["rows"]]:
        for r in row.get("rounds", []):
            r.pop("seconds", None)  # the assisted row and its entry in rows share their rounds
    return d


def _type(qtbot, box, text: str) -> None:
    """Replace a spin box's or line edit's text the way a user does: select all, type, Enter."""
    box.setFocus()
    qtbot.keyClick(box, Qt.Key.Key_A, Qt.KeyboardModifier.ControlModifier)
    qtbot.keyClicks(box, text)
    qtbot.keyClick(box, Qt.Key.Key_Return)


def _same_steps(remote, local) -> None:
    assert len(remote) == len(local)
    for a, b in zip(remote, local):
        assert a.to_json() == b.to_json()
        assert a.lost_mass.dtype == b.lost_mass.dtype and np.array_equal(a.lost_mass, b.lost_mass, equal_nan=True)


def test_the_kv_lab_panel_runs_on_the_engine_with_the_local_numbers(server, window, local_lm, qtbot, no_dialogs):  # noqa: F811 (the fixtures imported above)
    win, r = window(server.url)
    panel = win.kvlab_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.run_button.isEnabled, timeout=10000)
    _type(qtbot, panel.budget, "4")
    _type(qtbot, panel.steps, "5")
    panel.policy.setFocus()
    qtbot.keyClicks(panel.policy, "h2o")  # the picker: typed, as a user picks an item
    assert panel.settings() == ("h2o", 4, 5, False)
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.view is not None and not panel.job.running, timeout=60000)
    local = KVLab(local_lm, policy=make("h2o", 4, **panel.options()), prompt_ids=list(r.prompt_ids))
    local.run_steps(5)
    _same_steps(panel.view.steps, local.history)
    last = local.history[-1]
    assert panel.table.rowCount() == local_lm.n_layers
    assert panel.table.item(1, 1).text() == f"{last.bytes_policy[1]:,}"  # the bytes table on screen
    assert panel.table.item(1, 3).text() == str(last.evicted_now[1])
    assert f"{len(local.history)} steps" in panel.status.text()
    assert panel.show_button.isEnabled()  # the policy run is read on the engine (test_remote_policy_run.py)

    qtbot.mouseClick(panel.step_button, Qt.MouseButton.LeftButton)  # one more step, then back: the same lab
    local.step()
    qtbot.waitUntil(lambda: len(panel.view.steps) == 6 and not panel.job.running, timeout=30000)
    _same_steps(panel.view.steps, local.history)
    qtbot.mouseClick(panel.back_button, Qt.MouseButton.LeftButton)
    local.step_back()
    qtbot.waitUntil(lambda: len(panel.view.steps) == 5 and not panel.job.running, timeout=30000)
    _same_steps(panel.view.steps, local.history)
    qtbot.mouseClick(panel.probe_button, Qt.MouseButton.LeftButton)
    want = local.probe()
    qtbot.waitUntil(lambda: "recovered" in panel.privacy_label.text(), timeout=60000)
    assert f"{want.recovered} of {want.prompt_tokens} prompt tokens recovered ({want.held} still held)" in (
        panel.privacy_label.text()
    )
    assert not no_dialogs and not win.errors


def test_the_compare_panel_runs_on_the_engine_with_the_local_numbers(server, window, local_lm, qtbot, no_dialogs):  # noqa: F811 (the fixtures imported above)
    win, r = window(server.url)
    panel = win.compare_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.run_button.isEnabled, timeout=10000)
    _type(qtbot, panel.beams, "3")
    _type(qtbot, panel.new_tokens, "5")
    _type(qtbot, panel.samples, "2")
    _type(qtbot, panel.temperatures, "0.7, 1.3")
    _type(qtbot, panel.lookup, "2")
    settings = panel.settings()
    assert settings["samples"] == 2 and settings["temperatures"] == [0.7, 1.3] and settings["num_beams"] == 3
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.result is not None and not panel.job.running, timeout=60000)
    want = compare(local_lm, prompt_ids=list(r.prompt_ids), **settings)
    assert _no_seconds(panel.result.to_json()) == _no_seconds(want.to_json())
    names = [row["name"] for row in want.rows]  # greedy, 2 beams, 4 samples, assisted: each a row on screen
    assert panel.row_names == names and panel.table.rowCount() == len(names)
    first = want.rows[1]  # beam 1's first token, its label and probability as the cell shows them
    assert panel.table.item(1, 0).text() == f"{first['tokens'][0]}\n{first['probs'][0]:.2f}"
    assert panel.inspect_button.isEnabled()  # its beams are read on the engine (test_remote_compare_rest.py)
    assert not no_dialogs and not win.errors


def test_stop_cancels_a_long_comparison_on_the_engine_and_it_keeps_serving(server, window, qtbot, no_dialogs):  # noqa: F811 (the fixtures imported above)
    win, r = window(server.url)
    panel = win.compare_panel
    win.raise_panel(panel)
    qtbot.waitUntil(panel.run_button.isEnabled, timeout=10000)
    _type(qtbot, panel.new_tokens, "30")
    _type(qtbot, panel.samples, "64")  # 64 samples at 16 temperatures of 30 tokens: minutes, unless stopped
    _type(qtbot, panel.temperatures, ", ".join(f"{0.5 + i / 10:g}" for i in range(16)))
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "sample: token" in panel.summary.text(), timeout=60000)  # the engine's progress notes
    assert panel.stop_button.isEnabled()
    qtbot.mouseClick(panel.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not panel.job.running, timeout=20000)
    assert "cancelled" in panel.summary.text() and panel.result is None
    _type(qtbot, panel.samples, "0")  # the link and the engine go on: a small comparison runs at once
    qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.result is not None and not panel.job.running, timeout=60000)
    assert r.link_alive and not win.errors


def test_a_cancelled_lab_run_keeps_its_steps_and_goes_on_as_the_local_lab(server, local_lm):
    notes = []
    with gi.connect(server.url, prompt=PROMPT, temperature=0.8, seed=3) as r:
        lab = r.remote_kvlab("streaming", 6, 40, options={"schedule": "2", "page": 2}, progress=lambda *a: notes.append(a),
                             cancelled=lambda: len(notes) >= 3)  # fmt: skip
        n = len(lab.history)
        assert lab.stopped and 2 <= n < 40 and notes[0] == ("streaming", 0, 40)
        local = KVLab(local_lm, policy=make("streaming", 6, schedule=2, page=2), prompt_ids=list(r.prompt_ids),
                      temperature=0.8, seed=3)  # fmt: skip
        local.run_steps(n + 1)
        lab.step()  # the engine's lab goes on from the steps it made
        _same_steps(lab.history, local.history)
        assert lab.summary() == local.summary() and lab.final_rows() == final_rows(local)
        with pytest.raises(Cancelled):
            r.remote_compare(max_new_tokens=20, samples=64, temperatures=[1.0, 2.0], cancelled=lambda: True)
        assert r.step().token_id == gi.Session(local_lm, PROMPT, temperature=0.8, seed=3).step().token_id


def test_kv_lab_and_compare_take_connect_and_print_what_a_local_run_prints(server, tiny_llama, capsys):
    from gpt_inspector.cli import main

    lab = ["kv-lab", "--prompt", PROMPT, "--policy", "h2o", "--budget", "4", "--steps", "4", "--probe", "--json"]
    cmp = ["compare", "--prompt", PROMPT, "--max-new-tokens", "5", "--num-beams", "3", "--num-return-sequences", "2",
           "--samples", "2", "--temperatures", "0.7,1.3", "--prompt-lookup-num-tokens", "2", "--json"]  # fmt: skip
    local = ["--model", str(tiny_llama), "--device", DEVICE]
    for argv, clean in ((lab, lambda d: d), (cmp, _no_seconds)):
        outs = []
        for where in (["--connect", server.url], local):
            assert main([*argv, *where]) == 0
            outs.append(clean(json.loads(capsys.readouterr().out)))
        assert outs[0] == outs[1], argv[0]


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"op": "kvlab_run", "id": 1, "args": {"policy": "nope", "steps": 2}}', "must be one of"),
        ('{"op": "kvlab_run", "id": 1, "args": {"policy": "h2o", "steps": -1}}', "must lie in"),
        (
            '{"op": "kvlab_run", "id": 1, "args": {"policy": "int4", "steps": 1, "options": {"page": 2}}}',
            "does not take page",
        ),
        (
            '{"op": "kvlab_run", "id": 1, "args": {"policy": "h2o", "steps": 1, "options": {"schedule": "soon"}}}',
            "schedule must be",
        ),
        (
            '{"op": "kvlab_run", "id": 1, "args": {"policy": "h2o", "steps": 1, "options": {"window": "8"}}}',
            "must be an integer",
        ),
        ('{"op": "kvlab_step", "id": 1, "args": {"lab": 987654}}', "no longer on the engine"),
        ('{"op": "kvlab_probe", "id": 1, "args": {}}', "missing argument"),
        ('{"op": "compare", "id": 1, "args": {"temperatures": [1, "x"]}}', "must be a finite number"),
        ('{"op": "compare", "id": 1, "args": {"temperatures": [' + "1," * 64 + "1]}}", "at most 64"),
        ('{"op": "compare", "id": 1, "args": {"early_stopping": true}}', "must be one of"),
        ('{"op": "compare", "id": 1, "args": {"num_beams": 100000}}', "must lie in"),
        ('{"op": "compare", "id": 1, "args": {"max_new_tokens": 9999, "samples": 1}}', "context"),
        ('{"op": "cancel", "id": 1, "args": {"job": 3}}', "unknown argument"),
    ],
)
def test_malformed_lab_and_compare_requests_are_refused_in_one_line(server, text, words):
    with _ws(server.url) as ws:
        ws.send(wire.request("open", 1, {"prompt": PROMPT}))
        assert _answer(ws)["ok"]
        ws.send(text)
        head = _answer(ws)
        assert not head["ok"] and words in head["error"], head["error"]
        _still_serving(ws)


def test_a_request_sent_during_a_job_is_refused_and_a_cancel_stops_it(server):
    with _ws(server.url) as ws:
        ws.send(wire.request("open", 1, {"prompt": PROMPT}))
        assert _answer(ws)["ok"]
        ws.send(wire.request("compare", 2, {"max_new_tokens": 20, "samples": 64, "temperatures": [1.0, 2.0]}))
        first = ws.recv(timeout=60)
        assert wire.check_note(first, 2) is not None  # the job has begun: its progress notes come
        ws.send(wire.request("step", 3, {}))
        ws.send(wire.request("cancel", 4, {}))
        got = {}
        while 2 not in got:
            data = ws.recv(timeout=60)
            if wire.check_note(data, 2) is None:
                head = json.loads(data)
                got[head["id"]] = head
        assert not got[3]["ok"] and "still running" in got[3]["error"]
        assert got[4]["ok"] and got[4]["result"] is True
        assert not got[2]["ok"] and "cancelled" in got[2]["error"]
        _still_serving(ws)
