"""Saving never costs the run: every failed write is one InspectorError and leaves no half file."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from writing import read_only

import gpt_inspector as gi


@pytest.fixture
def session(tiny_lm):
    s = gi.Session(tiny_lm("gpt2"), "She eats an apple")
    s.run(3)
    return s


def _intact(s, tokens):
    assert s.tokens == tokens and s.cache_length == len(tokens) - 1
    s.step()  # still usable


def _no_temp_files(folder):
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]


def test_missing_folder(session, tmp_path):
    tokens = list(session.tokens)
    with pytest.raises(gi.InspectorError, match="does not exist"):
        session.save_trace(tmp_path / "nope" / "t.safetensors")
    _intact(session, tokens)


def test_directory_destination(session, tmp_path):
    (tmp_path / "d.safetensors").mkdir()
    tokens = list(session.tokens)
    with pytest.raises(gi.InspectorError, match="folder"):
        session.save_trace(tmp_path / "d.safetensors")
    _intact(session, tokens)


def test_symlink_destination_refused(session, tmp_path):
    target = tmp_path / "elsewhere.safetensors"
    target.write_bytes(b"keep")
    (tmp_path / "link.safetensors").symlink_to(target)
    with pytest.raises(gi.InspectorError, match="symbolic link"):
        session.save_trace(tmp_path / "link.safetensors")
    assert target.read_bytes() == b"keep"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder(session, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        tokens = list(session.tokens)
        with pytest.raises(gi.InspectorError, match="cannot write"):
            session.save_trace(ro / "t.safetensors")
        _intact(session, tokens)
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o700)


def test_read_only_folder_simulated(session, tmp_path, monkeypatch):
    """The same refusal where the tests run as root: creating the temporary is what a read-only folder fails."""
    tokens = list(session.tokens)
    with (
        read_only(tmp_path, monkeypatch),
        pytest.raises(gi.InspectorError, match="cannot write .*(Read-only|Permission)"),
    ):
        session.save_trace(tmp_path / "t.safetensors")
    _intact(session, tokens)
    assert os.listdir(tmp_path) == []


def test_full_disk_leaves_no_half_file_and_keeps_the_old_one(session, tmp_path, monkeypatch):
    import safetensors.numpy

    dst = tmp_path / "t.safetensors"
    session.save_trace(dst)
    old = dst.read_bytes()
    session.step()
    tokens = list(session.tokens)
    real = safetensors.numpy.save_file

    def full(tensors, name, metadata=None):
        with open(name, "wb") as f:
            f.write(b"half a trace")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    with pytest.raises(gi.InspectorError, match="No space left"):
        session.save_trace(dst)
    assert dst.read_bytes() == old  # the previous trace survives whole
    _no_temp_files(tmp_path)
    monkeypatch.setattr(safetensors.numpy, "save_file", real)
    _intact(session, tokens)
    session.save_trace(dst)
    tr = gi.load_trace(dst)
    assert tr.tokens == session.tokens
    np.testing.assert_array_equal(tr.step_logits[-1], session.current.logits.numpy())


def test_interrupted_write_leaves_no_temp_file(session, tmp_path, monkeypatch):
    import safetensors.numpy

    def interrupted(tensors, name, metadata=None):
        with open(name, "wb") as f:
            f.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.save_trace(tmp_path / "t.safetensors")
    assert os.listdir(tmp_path) == []


def test_saved_file_is_private_whatever_the_umask(session, tmp_path):
    old = os.umask(0o022)  # the usual umask, under which the old code wrote 0644
    try:
        p = session.save_trace(tmp_path / "t.safetensors")
        q = session.save_trace(tmp_path / "t.safetensors")  # over an existing file too
    finally:
        os.umask(old)
    assert p.stat().st_mode & 0o777 == q.stat().st_mode & 0o777 == 0o600
