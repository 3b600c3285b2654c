"""The session recipe, saved after every change so a crash or a closed window loses nothing.

One JSON file per window (``Session.recipe()`` plus how the model was loaded), so two windows never
overwrite each other's session; a clean quit removes the window's file, a crash leaves it for the
next start to offer. The files live next to the settings file when ``GPT_INSPECTOR_SETTINGS``
points at one (tests), else in the user's data folder; ``GPT_INSPECTOR_AUTOSAVE`` names the base
file instead. Recipes hold prompts, so the folder is 0700 and the files 0600.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from pathlib import Path

from ..core import outfile
from ..core.errors import InspectorError
from .settings import ENV as SETTINGS_ENV

ENV = "GPT_INSPECTOR_AUTOSAVE"
MAX_BYTES = 64 * 1024 * 1024  # a 200,000-op recipe is about 4 MB
_next = itertools.count()


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
    return check_recipe(data)


def move_aside(p: Path) -> Path:
    """Rename a file that cannot be restored so no later start offers it again; it is kept for the user."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count():
        target = p.with_name(f"{p.name}.rejected-{stamp}" + (f"-{n}" if n else ""))
        if not target.exists():  # never over an earlier rejected file: each is kept
            os.replace(p, target)
            return target
    raise AssertionError("unreachable")


def read_with_owner(rejected: list[str] | None = None) -> tuple[dict, str | None] | None:
    """The newest saved recipe worth restoring (at least one step) and whose file it is, else None.

    Files that fail the check are moved aside, and one line for each (naming where it is kept) goes
    to ``rejected``: the window starts clean, and the next start does not meet them again.
    """
    found = []
    for owner, p in _all_files():
        with contextlib.suppress(OSError):
            found.append((p.stat().st_mtime, owner, p))
    for _, owner, p in sorted(found, key=lambda f: f[0], reverse=True):
        try:
            data = load(p)
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, the file must not stop the start
            try:
                kept = f"kept as {move_aside(p)}"
            except OSError as err:
                kept = f"and could not be moved aside ({err.strerror or err})"
            if rejected is not None:
                rejected.append(f"the autosaved session {p} cannot be restored ({e}); {kept}")
            continue
        if data["ops"]:
            return data, owner
    return None


def read() -> dict | None:
    found = read_with_owner()
    return None if found is None else found[0]


def clear(owner: str | None = ...) -> None:  # type: ignore[assignment]
    """Remove one window's file (``owner``), or with no argument every autosave (the user said no)."""
    targets = [p for _, p in _all_files()] if owner is ... else [path(owner)]
    for p in targets:
        with contextlib.suppress(OSError):
            p.unlink()


def summary(recipe: dict) -> str:
    steps = sum(1 for op in recipe.get("ops", []) if isinstance(op, dict) and op.get("op") == "step")
    prompt = str(recipe.get("prompt", ""))
    prompt = prompt if len(prompt) <= 60 else prompt[:57] + "…"
    edits = len(recipe.get("mask_edits") or [])
    extra = f", {edits} mask edit{'s' * (edits != 1)}" if edits else ""
    return f"model {recipe.get('model')}\nprompt “{prompt}”\n{steps} steps{extra}"
