"""Failing file systems for tests: a read-only folder and a disk that fills up part-way through a write.

Root writes into a 0555 folder anyway, so where the tests run as root a read-only folder is simulated
at the system call the writer makes (``os.open`` of a new file there fails with EROFS, as a read-only
mount does). A full disk is ``os.write`` taking part of a chunk into a file in that folder, then ENOSPC.
"""

from __future__ import annotations

import contextlib
import errno
import os

ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _in(fd_or_path, folder) -> bool:
    try:
        where = os.readlink(f"/proc/self/fd/{fd_or_path}") if isinstance(fd_or_path, int) else os.fspath(fd_or_path)
    except OSError:
        return False
    return os.path.dirname(os.path.abspath(where)) == os.path.abspath(folder)


@contextlib.contextmanager
def read_only(folder, monkeypatch):
    """``folder`` takes no new file inside the block: really (chmod 0555) or, as root, at ``os.open``."""
    if not ROOT:
        os.chmod(folder, 0o555)
        try:
            yield
        finally:
            os.chmod(folder, 0o755)
        return
    real = os.open

    def open_(path, flags, *a, **k):
        if flags & os.O_CREAT and _in(path, folder):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", open_)
    try:
        yield
    finally:
        monkeypatch.setattr(os, "open", real)


@contextlib.contextmanager
def full_disk(folder, monkeypatch, after: int = 4096):
    """Writes into ``folder`` stop with ENOSPC once ``after`` bytes went in (the first ones do land)."""
    real = os.write
    written = {"n": 0}

    def write(fd, data):
        if not _in(fd, folder):
            return real(fd, data)
        room = after - written["n"]
        if room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, bytes(data[:room]))
        written["n"] += n
        return n

    monkeypatch.setattr(os, "write", write)
    try:
        yield
    finally:
        monkeypatch.setattr(os, "write", real)
