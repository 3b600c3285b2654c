"""Autosave files: never torn, private, one per window, gone after a clean quit."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import gpt_inspector as gi
from gpt_inspector.gui import autosave


@pytest.fixture
def base(tmp_path, monkeypatch):
    p = tmp_path / "state" / "autosave.json"
    monkeypatch.setenv(autosave.ENV, str(p))
    return p


def _recipe(writer: int, i: int) -> dict:
    # big enough that a torn write would be visible (several pages)
    return {
        "format": "gpt-inspector-recipe/1",
        "writer": writer,
        "i": i,
        "ops": [{"op": "step"}] * 2000,
        "prompt": "a",
        "prompt_ids": [1],
        "seed": 0,
        "initial_decoding": {"temperature": 0.0, "top_k": None, "top_p": None},
    }


def _check_whole(p: Path, seen: list) -> None:
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return
    data = json.loads(text)  # a torn file raises here
    assert len(data["ops"]) == 2000
    seen.append((data["writer"], data["i"]))


def test_two_writer_threads_never_tear_a_shared_file(base):
    stop = threading.Event()
    seen: list = []
    errors: list = []

    def reader():
        while not stop.is_set():
            try:
                _check_whole(base, seen)
            except Exception as e:  # noqa: BLE001 - any failure is the finding
                errors.append(e)
                return

    def writer(n):
        for i in range(200):
            autosave.write(_recipe(n, i))  # both on the same file: the worst case

    r = threading.Thread(target=reader)
    r.start()
    ws = [threading.Thread(target=writer, args=(n,)) for n in (1, 2)]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    stop.set()
    r.join()
    assert not errors, errors[0]
    assert seen
    assert not [p for p in base.parent.iterdir() if p.name.endswith(".tmp")]


_WRITER = """
import sys
from gpt_inspector.gui import autosave
n = int(sys.argv[1])
for i in range(200):
    autosave.write({"format": "gpt-inspector-recipe/1", "writer": n, "i": i, "ops": [{"op": "step"}] * 2000})
"""


def test_two_writer_processes_never_tear_a_shared_file(base, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(gi.__file__).resolve().parents[1]))
    env[autosave.ENV] = str(base)
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(n)], env=env) for n in (1, 2)]
    seen: list = []
    while any(p.poll() is None for p in procs):
        _check_whole(base, seen)
    assert [p.returncode for p in procs] == [0, 0]
    _check_whole(base, seen)
    assert seen and seen[-1][1] == 199


def test_files_are_private(base):
    autosave.write(_recipe(1, 0), "w1")
    assert stat.S_IMODE(base.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(autosave.path("w1").stat().st_mode) == 0o600


def test_one_file_per_window_and_the_newest_orphan_is_offered(base):
    a, b = autosave.new_owner(), autosave.new_owner()
    assert autosave.path(a) != autosave.path(b)
    autosave.write(_recipe(1, 0), a)
    autosave.write(_recipe(2, 0), b)
    os.utime(autosave.path(a), (1, 1))  # a is older
    assert autosave.read_with_owner() is None  # both owners live: nothing to offer
    autosave.release(a)
    autosave.release(b)  # both windows gone (as a crash leaves them)
    recipe, owner = autosave.read_with_owner()
    assert recipe["writer"] == 2 and owner == b and autosave.owned(b)  # claimed by the offer
    autosave.clear(b)  # b's session was declined and is gone: a's session is still there
    recipe, owner = autosave.read_with_owner()
    assert recipe["writer"] == 1 and owner == a
    autosave.release(a)
    autosave.clear()  # the user declined: every orphan goes
    assert autosave.read() is None and not list(base.parent.glob("*.lock"))


def test_clean_quit_removes_the_window_file_and_two_windows_keep_their_own(make_window, wait_idle, qtbot):
    w1 = make_window("gpt2")
    w2 = make_window("gpt2")
    w1.step()
    w2.run(2)
    wait_idle(w1)
    wait_idle(w2)
    p1, p2 = autosave.path(w1.worker.autosave_owner), autosave.path(w2.worker.autosave_owner)
    assert p1 != p2
    assert len(json.loads(p1.read_text())["ops"]) == 1 and len(json.loads(p2.read_text())["ops"]) == 2
    w1.close()
    assert not p1.exists() and p2.exists()


def test_a_full_disk_is_one_line_and_keeps_the_last_good_autosave(base, monkeypatch):
    from writing import full_disk

    autosave.write(_recipe(0, 1))
    old = base.read_bytes()
    with full_disk(base.parent, monkeypatch, after=100), pytest.raises(gi.InspectorError, match="No space left"):
        autosave.write(_recipe(0, 2))
    assert base.read_bytes() == old and os.listdir(base.parent) == [base.name]
    assert stat.S_IMODE(base.stat().st_mode) == 0o600


def test_a_huge_autosave_is_refused_by_its_size_and_moved_aside(base):
    base.parent.mkdir(parents=True)
    with open(base, "wb") as f:  # sparse: a 1 GiB claim costs no disk, and reading it would cost the memory
        f.truncate(1 << 30)
    rejected: list = []
    assert autosave.read_with_owner(rejected) is None
    assert len(rejected) == 1 and "bytes" in rejected[0] and str(base) in rejected[0]
    assert not base.exists() and len(list(base.parent.glob("autosave.json.rejected-*"))) == 1


def _offer(win, monkeypatch) -> tuple[dict | None, list]:
    from PySide6.QtWidgets import QMessageBox

    from gpt_inspector.gui.app import _offer_restore

    asked: list = []
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: asked.append(a) or QMessageBox.StandardButton.Yes)
    return _offer_restore(win), asked


def test_a_second_window_is_never_offered_a_live_window_session(make_window, wait_idle, monkeypatch):
    a = make_window("gpt2")
    a.run(3)
    wait_idle(a)
    pa = autosave.path(a.worker.autosave_owner)
    assert len(json.loads(pa.read_text())["ops"]) == 3
    b = make_window("gpt2")  # a second window opened while a runs
    recipe, asked = _offer(b, monkeypatch)
    assert recipe is None and not asked  # a is alive: its session is not b's to restore
    assert b.worker.autosave_owner != a.worker.autosave_owner
    b.run(2)
    wait_idle(b)
    pb = autosave.path(b.worker.autosave_owner)
    a.close()  # a clean quit removes a's file only
    assert not pa.exists() and len(json.loads(pb.read_text())["ops"]) == 2
    a.step()  # nothing of a's writes after its quit
    assert not pa.exists()


def test_a_crashed_windows_session_is_adopted_with_its_lock(make_window, wait_idle, monkeypatch):
    a = make_window("gpt2")
    a.run(2)
    wait_idle(a)
    owner = a.worker.autosave_owner
    a.worker.stop()  # a crash: nothing holds a's file now
    b = make_window("gpt2")
    recipe, asked = _offer(b, monkeypatch)
    assert len(asked) == 1 and recipe["ops"] == [{"op": "step"}] * 2
    assert b.worker.autosave_owner == owner and autosave.owned(owner)
    c = make_window("gpt2")  # a third start meanwhile: b owns the file now
    assert _offer(c, monkeypatch) == (None, [])


_HOLDER = """
import sys, time
from gpt_inspector.gui import autosave
autosave.write({"format": "gpt-inspector-recipe/1", "model": None, "prompt": "a", "prompt_ids": [1], "seed": 0,
                "initial_decoding": {"temperature": 0.0, "top_k": None, "top_p": None},
                "ops": [{"op": "step"}] * 7}, "other-process")
print("ready", flush=True)
time.sleep(600)
"""


def test_a_window_in_another_process_keeps_its_session_until_it_dies(make_window, monkeypatch):
    win = make_window("gpt2")
    env = dict(os.environ, PYTHONPATH=str(Path(gi.__file__).resolve().parents[1]))
    env[autosave.ENV] = str(autosave.path())
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        theirs = autosave.path("other-process")
        assert _offer(win, monkeypatch) == (None, [])  # alive in its own process: never offered
        autosave.clear()  # what a declined offer does: their live file is not touched
        assert theirs.is_file()
    finally:
        holder.kill()
        holder.wait()
    recipe, asked = _offer(win, monkeypatch)  # the OS freed the lock with the process
    assert len(asked) == 1 and len(recipe["ops"]) == 7 and win.worker.autosave_owner == "other-process"
