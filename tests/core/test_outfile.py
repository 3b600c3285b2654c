"""The one writer (core.outfile) on the real file system: every failure is one line, keeps the old file, leaves
no temporary; what is not a regular file is never replaced or written through."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from writing import full_disk, read_only

import gpt_inspector as gi
from gpt_inspector.core import outfile
from gpt_inspector.core.errors import InspectorError

OLD = b"\x89PNG old file " * 430  # ~6,000 bytes, as in the report


def _only(folder, *names):
    assert sorted(os.listdir(folder)) == sorted(names)


def _one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text and text.startswith(("cannot write", "cannot use")), text
    return text


def test_writes_replaces_and_keeps_the_old_permissions(tmp_path):
    p = tmp_path / "a.png"
    assert outfile.write_bytes(p, b"one") == p
    mask = os.umask(0)
    os.umask(mask)
    assert p.read_bytes() == b"one" and p.stat().st_mode & 0o777 == 0o666 & ~mask
    p.chmod(0o640)
    outfile.write_bytes(p, b"two" * 10_000_000)  # several chunks
    assert p.read_bytes() == b"two" * 10_000_000 and p.stat().st_mode & 0o777 == 0o640
    outfile.write_text(p, "é", mode=0o600)
    assert p.read_text(encoding="utf-8") == "é" and p.stat().st_mode & 0o777 == 0o600
    _only(tmp_path, "a.png")


def test_full_disk_keeps_the_old_file_byte_for_byte(tmp_path, monkeypatch):
    p = tmp_path / "a.png"
    p.write_bytes(OLD)
    with full_disk(tmp_path, monkeypatch, after=8192), pytest.raises(InspectorError) as e:
        outfile.write_bytes(p, b"new" * 100_000)
    assert "No space left on device" in _one_line(e)
    assert p.read_bytes() == OLD
    _only(tmp_path, "a.png")


def test_read_only_folder_is_one_line_and_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "a.json"
    p.write_bytes(OLD)
    with read_only(tmp_path, monkeypatch):
        for call in (lambda: outfile.check_writable(p), lambda: outfile.write_text(p, "{}")):
            with pytest.raises(InspectorError) as e:
                call()
            assert "Read-only file system" in _one_line(e) or "Permission denied" in _one_line(e)
    assert p.read_bytes() == OLD
    _only(tmp_path, "a.json")


def test_a_fifo_or_folder_at_the_name_is_refused_not_replaced(tmp_path):
    fifo = tmp_path / "null"
    os.mkfifo(fifo)  # stands in for /dev/null: renaming over it would replace it, opening it would block
    (tmp_path / "d.json").mkdir()
    for target, word in ((fifo, "pipe"), (tmp_path / "d.json", "folder")):
        for call in (outfile.check_writable, lambda t: outfile.write_text(t, "{}")):
            with pytest.raises(InspectorError) as e:
                call(target)
            assert word in _one_line(e)
    assert fifo.is_fifo() and (tmp_path / "d.json").is_dir()
    _only(tmp_path, "null", "d.json")


def test_a_device_is_refused_before_anything_is_written():
    # /dev/null is only looked at: the refusal comes before any temporary or rename
    with pytest.raises(InspectorError, match="device"):
        outfile.check_target("/dev/null")


def test_a_symlink_at_the_name_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "elsewhere.png"
    target.write_bytes(OLD)
    link = tmp_path / "out.png"
    link.symlink_to(target)
    with pytest.raises(InspectorError) as e:
        outfile.write_bytes(link, b"new")
    assert "symbolic link" in _one_line(e) and str(target) in str(e.value)
    assert target.read_bytes() == OLD and link.is_symlink()
    _only(tmp_path, "elsewhere.png", "out.png")


def test_missing_folder_long_name_and_unknown_user(tmp_path):
    cases = ((tmp_path / "nope" / "a.png", "does not exist"), (tmp_path / ("x" * 300 + ".png"), "too long"),
             (tmp_path / "f.txt" / "a.png", "not a folder"))  # fmt: skip
    (tmp_path / "f.txt").write_text("a file where a folder should be")
    for path, word in cases:
        for call in (outfile.check_writable, lambda t: outfile.write_bytes(t, b"x")):
            with pytest.raises(InspectorError) as e:
                call(path)
            assert word in _one_line(e)
    _only(tmp_path, "f.txt")
    with pytest.raises(InspectorError) as e:
        outfile.expand("~nosuchuser-gpt-inspector/a.png")  # pathlib's own error here is a RuntimeError
    assert "no user named 'nosuchuser-gpt-inspector'" in _one_line(e)
    assert outfile.expand("~/a.png") == Path.home() / "a.png"


def test_a_name_near_the_limit_still_gets_its_temporary(tmp_path):
    p = tmp_path / ("y" * 250 + ".png")  # 254 bytes: the temporary could not be .NAME.tmp
    outfile.write_bytes(p, b"ok")
    assert p.read_bytes() == b"ok"
    _only(tmp_path, p.name)


def test_an_error_inside_the_fill_keeps_the_old_file_and_ctrl_c_goes_on_up(tmp_path):
    p = tmp_path / "t.bin"
    p.write_bytes(OLD)

    def broken(tmp):
        Path(tmp).write_bytes(b"half")
        raise RuntimeError("encoder broke\nsecond line")

    with pytest.raises(InspectorError) as e:
        outfile.write_with(p, broken)
    assert "encoder broke second line" in _one_line(e)

    def interrupted(tmp):
        Path(tmp).write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        outfile.write_with(p, interrupted)
    assert p.read_bytes() == OLD
    _only(tmp_path, "t.bin")


def test_a_killed_writers_temporary_is_removed_at_the_next_write(tmp_path):
    # a real kill -9 in the middle of a write: the child creates its temporary, writes half, and dies
    code = ("import os, signal, sys; from pathlib import Path; from gpt_inspector.core import outfile\n"
            "p = Path(sys.argv[1]); fd, tmp = outfile._create_temp(p, p); os.write(fd, b'half' * 1000)\n"
            "os.kill(os.getpid(), signal.SIGKILL)")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(Path(gi.__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t.safetensors")], env=env, timeout=120)
    assert r.returncode == -9
    left = [n for n in os.listdir(tmp_path) if outfile.MARK in n]
    assert len(left) == 1 and left[0].startswith(".t.safetensors.") and left[0].endswith(".tmp")
    # a live writer's temporary (this process's parent, alive) is not touched
    alive = tmp_path / f".x.png{outfile.MARK}{os.getppid()}-0123abcd.tmp"
    alive.write_bytes(b"in progress")
    unrelated = tmp_path / ".notes.tmp"
    unrelated.write_bytes(b"someone else's")
    outfile.write_bytes(tmp_path / "other.png", b"new")
    _only(tmp_path, "other.png", alive.name, unrelated.name)


def test_check_writable_leaves_nothing_behind(tmp_path):
    assert outfile.check_writable(tmp_path / "a.png") == tmp_path / "a.png"
    _only(tmp_path)


def test_check_writable_finds_a_full_disk_before_the_work(tmp_path, monkeypatch):
    real = os.statvfs(tmp_path)
    full = os.statvfs_result((*real[:3], 0, 0, *real[5:]))  # no free blocks, for anyone

    monkeypatch.setattr(os, "statvfs", lambda p: full if os.path.samefile(p, tmp_path) else real)
    with pytest.raises(InspectorError) as e:
        outfile.check_writable(tmp_path / "a.json")
    assert "No space left on device" in _one_line(e)
    _only(tmp_path)
