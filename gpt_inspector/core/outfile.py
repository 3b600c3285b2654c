"""The one way gpt-inspector writes a file: figures, traces, JSON tables, screenshots, autosaves.

A write goes to a temporary beside the target (``.NAME.gpt-inspector-PID-XXXXXXXX.tmp``), is fsynced
and renamed over the target, so a reader, a full disk, Ctrl+C or a crash sees the old file or the new
one, whole, never a mix. The target must be a regular file or nothing: a device (``/dev/null``), a
FIFO, a folder or a symbolic link is refused, since renaming over it would replace the thing itself
(and following a link writes wherever it points). Every failure is one InspectorError line; the
temporary is gone and the old file untouched. A temporary left by a killed run is removed at the next
write into its folder, once no process with its pid is alive.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from .errors import InspectorError

MARK = ".gpt-inspector-"
# .NAME.gpt-inspector-PID-RANDOM.tmp: only names of this shape are ever removed as leftovers
_LEFTOVER = re.compile(r"^\..*\.gpt-inspector-(\d+)-[0-9a-f]{8}\.tmp$")
_CHUNK = 1 << 20
_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0  # root may use the blocks reserved for it
# the temporary keeps a prefix of the target's name only, so a name near the limit still gets one
_NAME_PREFIX = 80

_KINDS = ((stat.S_ISDIR, "it is a folder"), (stat.S_ISCHR, "it is a device, not a regular file"),
          (stat.S_ISBLK, "it is a device, not a regular file"), (stat.S_ISFIFO, "it is a pipe (FIFO), not a regular file"),
          (stat.S_ISSOCK, "it is a socket, not a regular file"))  # fmt: skip


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError):
        text = e.strerror or (os.strerror(e.errno) if e.errno else str(e))
        return _one_line(text + (" (the disk is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""))
    return _one_line(f"{type(e).__name__}: {e}")  # a library's own error type (safetensors reports I/O so)


def _fail(path, why: str) -> InspectorError:
    return InspectorError(f"cannot write {_one_line(path)}: {why}")


def expand(path) -> Path:
    """``path`` with ``~`` and ``~user`` expanded; an unknown user is the user's to fix, not a traceback."""
    text = os.fspath(path)
    try:
        return Path(text).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory"
        user = str(text)[1:].split(os.sep, 1)[0] or "~"
        raise InspectorError(
            f"cannot use {_one_line(text)}: no user named {user!r} (a leading ~name means that user's home folder)"
        ) from None


def check_target(path) -> Path:
    """Refuse a destination that cannot take a file (missing folder, folder, device, FIFO, link, too-long name).

    Returns the path made absolute. Does not touch the file system beyond looking. ``~`` is not expanded here,
    as pathlib does not (a file may be named ``~draft.png``): front doors call ``expand`` on what a user typed.
    """
    p = Path(os.path.abspath(path))
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:  # ENAMETOOLONG, ENOTDIR (a file where a folder should be), ELOOP, EACCES
        if e.errno == errno.ENAMETOOLONG:
            raise _fail(path, "the file name is too long") from None
        if e.errno == errno.ENOTDIR:
            raise _fail(path, f"{p.parent} is not a folder") from None
        raise _fail(path, _reason(e)) from None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise _fail(path, f"it is a symbolic link (to {os.readlink(p)}); name the file itself")
        for test, why in _KINDS:
            if test(st.st_mode):
                raise _fail(path, why)
    elif not p.parent.is_dir():
        raise _fail(path, f"folder {p.parent} does not exist")
    return p


def check_writable(path) -> Path:
    """``check_target``, then prove the folder takes a new file by creating and removing a temporary.

    For front doors to call before the work (a long trace, a whole sweep) whose result goes to ``path``.
    """
    p = check_target(path)
    fd, tmp = _create_temp(path, p)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    # an empty file still fits on a full disk (it needs an inode, not a block): ask for the free space too
    try:
        st = os.statvfs(p.parent)
    except (OSError, AttributeError):  # some file systems, and Windows, cannot say
        return p
    if (st.f_bfree if _ROOT else st.f_bavail) == 0:
        raise _fail(path, "No space left on device (the disk is full)")
    return p


def _temp_name(p: Path) -> str:
    return str(p.with_name(f".{p.name[:_NAME_PREFIX]}{MARK}{os.getpid()}-{secrets.token_hex(4)}.tmp"))


def _create_temp(shown, p: Path) -> tuple[int, str]:
    for _ in range(100):
        tmp = _temp_name(p)
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600), tmp
        except FileExistsError:
            continue
        except OSError as e:
            raise _fail(shown, f"{_reason(e)} (creating a file in {p.parent})") from None
    raise _fail(shown, f"no free temporary name in {p.parent}")


def _alive(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":  # Windows' os.kill(pid, 0) would end the process, not ask about it
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def remove_leftovers(folder) -> list[str]:
    """Delete this tool's temporaries in ``folder`` whose writer is dead (kill -9, power cut); their names."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            m = _LEFTOVER.match(name)
            if m and not _alive(int(m.group(1))):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
                    removed.append(name)
    return removed


def _default_mode(p: Path) -> int:
    with contextlib.suppress(OSError):
        return stat.S_IMODE(os.stat(p).st_mode)  # replacing a file keeps what its owner chose
    umask = os.umask(0)  # read, then put back: os has no other way to ask for it
    os.umask(umask)
    return 0o666 & ~umask


def write_with(path, fill: Callable[[str], None], mode: int | None = None) -> Path:
    """``fill(tmp_name)`` writes the content into a temporary beside ``path`` (for writers that take a file name);
    then it is fsynced and renamed over ``path``. Returns the absolute path written."""
    p = check_target(path)
    remove_leftovers(p.parent)
    fd, tmp = _create_temp(path, p)
    os.close(fd)
    try:
        fill(tmp)
        os.chmod(tmp, _default_mode(p) if mode is None else mode)  # the temporary's 0600 is not the file's
        fd = os.open(tmp, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        check_target(path)  # what sits there now, just before the swap: a link or device made meanwhile is refused
        os.replace(tmp, p)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, InspectorError):
            raise
        if isinstance(e, Exception):
            raise _fail(path, _reason(e)) from None
        raise  # Ctrl+C and the like go on up, the target untouched
    _sync_folder(p.parent)
    return p


def write_bytes(path, data: bytes, mode: int | None = None) -> Path:
    """``data`` into ``path`` as described above; ``mode`` sets the permission bits (default: the old file's,
    else 0666 less the umask)."""
    view = memoryview(data)

    def fill(tmp: str) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0))
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done : done + _CHUNK])
        finally:
            os.close(fd)

    return write_with(path, fill, mode)


def write_text(path, text: str, mode: int | None = None) -> Path:
    return write_bytes(path, text.encode("utf-8"), mode)


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable; some file systems cannot open a folder, which costs only that."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
