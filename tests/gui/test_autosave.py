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


def test_one_file_per_window_and_the_newest_is_offered(base):
    a, b = autosave.new_owner(), autosave.new_owner()
    assert autosave.path(a) != autosave.path(b)
    autosave.write(_recipe(1, 0), a)
    autosave.write(_recipe(2, 0), b)
    os.utime(autosave.path(a), (1, 1))  # a is older
    recipe, owner = autosave.read_with_owner()
    assert recipe["writer"] == 2 and owner == b
    autosave.clear(b)  # b quit cleanly: a's session is still there
    recipe, owner = autosave.read_with_owner()
    assert recipe["writer"] == 1 and owner == a
    autosave.clear()  # the user declined: everything goes
    assert autosave.read() is None


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
