"""What the window can ask of the worker: one frozen dataclass per command.

The worker dispatches on the command's type through a table, so a misspelt or unhandled
command fails when it is posted (a TypeError on the caller's thread, caught by the tests), not
as a dialog at run time. Qt-free on purpose: the commands are plain data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ..core.breakpoints import Breakpoints
from ..core.capture import HeadEdit, MaskEdit


@dataclass(frozen=True)
class ModelSpec:
    model: str | None = None  # None: the demo model
    device: str = "auto"
    dtype: str | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False
    allow_unverified: bool = False  # load even when the fidelity self-test fails; the window says so
    device_map: str | None = None  # auto / balanced / sequential (accelerate); None: one device
    max_memory: str | None = None  # "0=20GiB,cpu=60GiB"
    offload_folder: str | None = None

    @classmethod
    def of_recipe(cls, recipe: dict) -> ModelSpec:
        """The model a session recipe ran on, placed as it was; pickle and remote code stay off."""
        load = recipe.get("load") or {}
        return cls(recipe.get("model"), load.get("device", "auto"), load.get("dtype"), device_map=load.get("device_map"),
                   max_memory=load.get("max_memory"), offload_folder=load.get("offload_folder"))  # fmt: skip

    def load(self):
        """The model loaded (every other field is one of ``load_model``'s options)."""
        from ..core import load_model

        options = asdict(self)
        return load_model(options.pop("model"), **options)


@dataclass(frozen=True)
class SessionSpec:
    prompt: str = ""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    settings: dict | None = None  # generate's other sampler settings (decoding.Decoding's names)
    # a chat prompt instead of ``prompt``: {"messages": [...], "add_generation_prompt": bool} (core.chat)
    chat: dict | None = None

    def session_kwargs(self) -> dict:
        """``Session``'s keyword arguments for this spec (the model aside)."""
        start = {"prompt": self.prompt} if self.chat is None else dict(self.chat)
        return {**start, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "seed": self.seed, **(self.settings or {})}  # fmt: skip


def _no_bool(owner: str, **values) -> None:
    # QAction.triggered(bool) once leaked checked=False into Run(max_steps) and ran 0 steps
    for name, v in values.items():
        if isinstance(v, bool):
            raise TypeError(f"{owner}.{name} must be an int or None, got {v!r}")


@dataclass(frozen=True)
class Load:
    model: ModelSpec
    session: SessionSpec


@dataclass(frozen=True)
class Restore:
    recipe: dict


@dataclass(frozen=True)
class NewSession:
    session: SessionSpec
    keep_edits: bool = True


@dataclass(frozen=True)
class Restart:
    session: SessionSpec | None = None  # a changed prompt or seed starts a new session


@dataclass(frozen=True)
class Step:
    # the controls' prompt and seed: when they differ from the session's, the step starts a new
    # session from them first (an edited prompt must not be ignored in silence)
    session: SessionSpec | None = None


@dataclass(frozen=True)
class StepBack:
    pass


@dataclass(frozen=True)
class Run:
    """Step up to ``max_steps`` (None: until the context is full), or to step ``target``."""

    max_steps: int | None = None
    breakpoints: Breakpoints | None = None
    target: int | None = None
    session: SessionSpec | None = None  # as for Step

    def __post_init__(self):
        _no_bool("Run", max_steps=self.max_steps, target=self.target)


@dataclass(frozen=True)
class SetDecoding:
    temperature: float
    top_k: int | None = None
    top_p: float | None = None
    redecide: bool = False
    settings: dict | None = None  # generate's other sampler settings; None turns one off, absent keeps it


@dataclass(frozen=True)
class ForceToken:
    token_id: int

    def __post_init__(self):
        _no_bool("ForceToken", token_id=self.token_id)


@dataclass(frozen=True)
class EditCells:
    """Toggle blocks on (query, key) cells of ``layer``/``head``; ``scope``: head, layer or all."""

    cells: tuple[tuple[int, int], ...]
    layer: int
    head: int
    scope: str = "head"
    block: bool | None = None


@dataclass(frozen=True)
class SetMaskEdits:
    edits: tuple[MaskEdit, ...]


@dataclass(frozen=True)
class KnockOut:
    """Knock out head ``head`` of ``layer`` (None: the layer's whole attention); refused if already in force."""

    layer: int
    head: int | None = None

    def __post_init__(self):
        _no_bool("KnockOut", layer=self.layer, head=self.head)


@dataclass(frozen=True)
class PatchHead:
    """Write (layer, head)'s output from a run of ``prompt`` (stepped as far as this run) into this run."""

    layer: int
    head: int
    prompt: str

    def __post_init__(self):
        _no_bool("PatchHead", layer=self.layer, head=self.head)


@dataclass(frozen=True)
class SetHeadEdits:
    """Put exactly these knock-outs and patches in force (an undo: the list without one of them)."""

    edits: tuple[HeadEdit, ...]


@dataclass(frozen=True)
class UndoEdit:
    """Take this one mask edit, knock-out or patch out of force, whatever else is in force by then."""

    edit: MaskEdit | HeadEdit


@dataclass(frozen=True)
class Refresh:
    """Publish a snapshot again (the selection changed)."""


@dataclass(frozen=True)
class SaveTrace:
    path: str


@dataclass(frozen=True)
class OpenTrace:
    path: str


@dataclass(frozen=True)
class Show:
    """Show a run source built elsewhere; a Session belongs to the worker afterwards.

    ``name``: a run of its own beside the others (a beam, a policy run), so named in the switcher.
    None: a source that steps becomes the live session (replacing it); one that cannot is a run of
    its own under its ``source_name``.
    """

    obj: Any
    name: str | None = None


@dataclass(frozen=True)
class SwitchRun:
    """Show the run ``run_id`` (runs.RunInfo.id); every run keeps its state."""

    run_id: int


@dataclass(frozen=True)
class CloseRun:
    """Drop the run ``run_id``; the window asks before it closes the live session."""

    run_id: int


@dataclass(frozen=True)
class Call:
    """Run ``fn(session_or_trace)`` on the worker thread; the result comes back by ``called``.

    ``idle``: work nobody waits for (a panel's follow-up after a step). It runs as
    ``fn(source, waiting)`` and gives way to any command posted after it: skipped if one waits
    when its turn comes, stopped (Cancelled) when ``waiting()`` turns True while it runs.
    """

    fn: Callable[..., Any]
    idle: bool = False


COMMANDS = (Load, Restore, NewSession, Restart, Step, StepBack, Run, SetDecoding, ForceToken, EditCells,
            SetMaskEdits, KnockOut, PatchHead, SetHeadEdits, UndoEdit, Refresh, SaveTrace, OpenTrace, Show, SwitchRun, CloseRun, Call)  # fmt: skip
