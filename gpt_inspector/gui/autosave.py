"""The session recipe, saved after every change so a crash or a closed window loses nothing.

One JSON file per window (``Session.recipe()`` plus how the model was loaded), so two windows never
overwrite each other's session; a clean quit removes the window's file, a crash leaves it for the
next start to offer. Each window holds an flock on a lock file beside its file while it lives (the OS
frees it when the process dies, however it dies), so a start offers only files whose owner is gone,
and never a second window's live session. The files live next to the settings file when ``GPT_INSPECTOR_SETTINGS``
points at one (tests), else in the user's data folder; ``GPT_INSPECTOR_AUTOSAVE`` names the base
file instead. Recipes hold prompts, so the folder is 0700 and the files 0600.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from pathlib import Path

from ..core import outfile
from ..core.errors import InspectorError
from .settings import ENV as SETTINGS_ENV

ENV = "GPT_INSPECTOR_AUTOSAVE"
MAX_BYTES = 64 * 1024 * 1024  # a 200,000-op recipe is about 4 MB
_next = itertools.count()
# owner -> fd of its flock'ed lock file: this process's live windows and the file a start has claimed;
# flock (not lockf) because its locks belong to the open file, so two windows of one process exclude each other
_held: dict[str | None, int] = {}
_held_guard = threading.Lock()


def new_owner() -> str:
    """A name for one window's autosave file, unique across processes and windows."""
    return f"{os.getpid()}-{next(_next)}"


def path(owner: str | None = None) -> Path:
    """The base file (``owner=None``, where older versions wrote) or one window's file beside it."""
    if os.environ.get(ENV):
        base = Path(os.environ[ENV])
    elif os.environ.get(SETTINGS_ENV):
        base = Path(os.environ[SETTINGS_ENV]).with_name("autosave.json")
    else:
        from PySide6.QtCore import QStandardPaths

        folder = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppDataLocation)
        base = Path(folder or Path.home() / ".gpt-inspector") / "autosave.json"
    return base if owner is None else base.with_name(f"{base.stem}-{owner}{base.suffix}")


def _lock_path(owner: str | None) -> Path:
    p = path(owner)
    return p.with_name(p.name + ".lock")


def _take(owner: str | None) -> bool:
    """Take ``owner``'s lock without waiting; True when this process holds it now (or already did)."""
    import fcntl

    with _held_guard:
        if owner in _held:
            return True
        lp = _lock_path(owner)
        for _ in range(3):
            try:
                fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # a releaser unlinks the lock file before it unlocks: a lock on an unlinked inode guards nothing
                same = os.fstat(fd).st_ino == os.stat(lp).st_ino
            except OSError:
                os.close(fd)
                return False
            if same:
                _held[owner] = fd
                return True
            os.close(fd)
        return False


def release(owner: str | None) -> None:
    """Give up ``owner``'s lock (its window stopped); the file stays for a later start to offer."""
    with _held_guard:
        fd = _held.pop(owner, None)
        if fd is None:
            return
        with contextlib.suppress(OSError):
            _lock_path(owner).unlink()  # while still locked, so no one locks a file that is about to go
        os.close(fd)


def owned(owner: str | None) -> bool:
    """Whether this process holds ``owner``'s lock (a live window of its own, or a file it claimed)."""
    with _held_guard:
        return owner in _held


def _all_files() -> list[tuple[str | None, Path]]:
    base = path()
    found: list[tuple[str | None, Path]] = [(None, base)] if base.is_file() else []
    with contextlib.suppress(OSError):
        for p in base.parent.glob(f"{base.stem}-*{base.suffix}"):
            found.append((p.name[len(base.stem) + 1 : -len(base.suffix) or None], p))
    return found


def write(recipe: dict, owner: str | None = None) -> None:
    """Through the one writer (core.outfile): a reader sees the old or the new file, whole; 0600, prompts are private.

    Raises InspectorError (one line) when it cannot be written.
    """
    p = path(owner)
    folder = p.parent
    if not folder.is_dir():
        try:
            folder.mkdir(parents=True, mode=0o700, exist_ok=True)
            os.chmod(folder, 0o700)  # mkdir's mode is filtered by the umask
        except OSError as e:
            raise InspectorError(f"cannot write {p}: {e.strerror or e} (creating the folder {folder})") from None
    # the lock before the first byte: no start may see the file without its owner; the base file
    # (owner None) is where versions before the locks wrote, and it is never a live window's
    if owner is not None and not _take(owner):
        raise InspectorError(f"cannot write {p}: another window owns it")
    outfile.write_text(p, json.dumps(recipe), mode=0o600)


def load(p: Path) -> dict:
    """The recipe in ``p``, checked whole; InspectorError (one line) if it cannot be restored."""
    from ..core.errors import InspectorError
    from ..core.recipe_check import check_recipe

    try:
        if p.stat().st_size > MAX_BYTES:  # before reading: a huge file must not fill memory
            raise InspectorError(f"the file is {p.stat().st_size:,} bytes; an autosave is at most {MAX_BYTES:,}")
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise InspectorError(f"unreadable: {type(e).__name__}: {str(e)[:120]}") from None
    check_recipe(data)
    remote = data.get("remote")
    if remote is not None and not (isinstance(remote, dict) and all(isinstance(remote.get(k), str) for k in
                                                                    ("url", "engine", "model"))):  # fmt: skip
        raise InspectorError("remote must name the engine's url, engine and model as text")
    if remote is not None and not remote["url"].startswith(("ws://", "wss://")):
        raise InspectorError("remote's url is not a ws:// URL")
    return data


def move_aside(p: Path) -> Path:
    """Rename a file that cannot be restored so no later start offers it again; it is kept for the user."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count():
        target = p.with_name(f"{p.name}.rejected-{stamp}" + (f"-{n}" if n else ""))
        if not target.exists():  # never over an earlier rejected file: each is kept
            os.replace(p, target)
            return target
    raise AssertionError("unreachable")


def _newest_first() -> list[tuple[str | None, Path]]:
    found = []
    for owner, p in _all_files():
        with contextlib.suppress(OSError):
            found.append((p.stat().st_mtime, owner, p))
    return [(owner, p) for _, owner, p in sorted(found, key=lambda f: f[0], reverse=True)]


def _claim(owner: str | None) -> bool:
    """Take the lock of a file whose owner is gone; False while a window (here or in another process) lives."""
    return not owned(owner) and _take(owner)


def read_with_owner(rejected: list[str] | None = None, remote: bool | None = None) -> tuple[dict, str | None] | None:
    """The newest orphaned recipe worth restoring (at least one step) and whose file it is, else None.

    Only files whose owner is gone count, and the one returned is claimed: this process holds its
    lock, so a window that adopts it owns it at once and no other start offers it too. Files that
    fail the check are moved aside, and one line for each (naming where it is kept) goes to
    ``rejected``: the window starts clean, and the next start does not meet them again. ``remote``:
    True for a remote engine's sessions only, False for local ones only.
    """
    for owner, p in _newest_first():
        if not _claim(owner):
            continue
        try:
            data = load(p)
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, the file must not stop the start
            try:
                kept = f"kept as {move_aside(p)}"
            except OSError as err:
                kept = f"and could not be moved aside ({err.strerror or err})"
            release(owner)
            if rejected is not None:
                rejected.append(f"the autosaved session {p} cannot be restored ({e}); {kept}")
            continue
        if data["ops"] and (remote is None or remote == ("remote" in data)):
            return data, owner
        release(owner)
    return None


def read() -> dict | None:
    """The newest saved recipe with a step, whoever owns it: for looking at, never for restoring."""
    for _, p in _newest_first():
        with contextlib.suppress(Exception):
            data = load(p)
            if data["ops"]:
                return data
    return None


def clear(owner: str | None = ...) -> None:  # type: ignore[assignment]
    """Remove one window's file (``owner``; a clean quit), or with no argument every file whose owner
    is gone (the user declined the restore); a live window's file is never touched."""
    owners = [o for o, _ in _all_files() if _claim(o)] if owner is ... else [owner]
    for o in owners:
        # a window's own file after its worker released the lock: taken back for the removal, unless
        # a start claimed it in between (then that start owns it)
        if not _take(o):
            continue
        with contextlib.suppress(OSError):
            path(o).unlink()
        release(o)


def summary(recipe: dict) -> str:
    steps = sum(1 for op in recipe.get("ops", []) if isinstance(op, dict) and op.get("op") == "step")
    prompt = str(recipe.get("prompt", ""))
    prompt = prompt if len(prompt) <= 60 else prompt[:57] + "…"
    edits = len(recipe.get("mask_edits") or [])
    extra = f", {edits} mask edit{'s' * (edits != 1)}" if edits else ""
    remote = recipe.get("remote")
    where = "" if remote is None else f" on the engine at {remote['engine']}"  # never the URL: it holds the token
    return f"model {recipe.get('model')}{where}\nprompt “{prompt}”\n{steps} steps{extra}"
