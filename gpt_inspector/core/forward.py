"""One forward over a cache with recording on, and the rollback that keeps a run at its last good step.

Shared by the session and the beam search: both must leave the cache and the records exactly as they
were when anything (an error, Ctrl+C) stops a forward halfway. ``Run`` is what else they share.
"""

from __future__ import annotations

import _signal
import contextlib
import functools
import inspect
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from . import capture, hf, validate
from .capture import Recorder
from .errors import StepFailed

if TYPE_CHECKING:
    from .models import LoadedModel


class Run:
    """What a session and a beam search share: the model's cache and our records of it, the steps
    taken, listeners, and stepping on to the end. The subclass keeps ``lm``, has ``step()`` and ``ended``."""

    if TYPE_CHECKING:  # what the subclass provides (above), typed for the methods here
        lm: LoadedModel

        @property
        def ended(self) -> bool: ...
        def step(self) -> object: ...

    def __init__(self, lm):
        # full length even for sliding-window layers: every position stays inspectable, and the
        # model's own sliding mask (recorded as mask rows) hides what the window drops
        self.cache = lm.new_cache()
        # K/V are read from the cache where it holds them (no copy); mirrored on accelerators (every GPU
        # a device map uses, even with the input on the CPU), and where the cache holds something else
        # (see core.kv_layout)
        self.recorder = Recorder(
            lm.n_layers, mirror_kv=lm.device.type != "cpu" or bool(lm.cuda_devices) or lm.mirror_kv
        )
        self.steps_done: list = []
        self._listeners: list[Callable[[str, object], None]] = []

    def subscribe(self, callback: Callable[[str, object], None]) -> None:
        """``callback(event, payload)`` after every change: a session's step, step_back, decoding, force,
        mask and fault; a beam search's beam_step (with its BeamStep)."""
        self._listeners.append(callback)

    def _emit(self, event: str, payload: object) -> None:
        for cb in list(self._listeners):
            cb(event, payload)

    @property
    def cache_length(self) -> int:
        return self.cache.get_seq_length()

    def _kv_rows(self, layer: int, length: int, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V, (H_kv, length, d) each, of batch row ``row``: our mirror, else the cache itself."""
        rec = self.recorder
        if rec.mirror_kv:
            return rec.k[layer].view(length)[row], rec.v[layer].view(length)[row]
        cl = self.cache.layers[self.lm.cache_layer(layer)]  # a KV-sharing layer reads another's
        return cl.keys[row, :, :length], cl.values[row, :, :length]

    def steps(self, max_steps: int | None = None) -> Iterator:
        """Step until the run ends (EOS or the context limit; a search: done) or ``max_steps``; front ends
        may stop iterating any time."""
        if max_steps is not None:
            validate.count(max_steps)
        n = 0
        while not self.ended and (max_steps is None or n < max_steps):
            yield self.step()
            n += 1


def crop_cache(cache: hf.DynamicCache, length: int) -> None:
    # per layer: after a fault mid-forward, layers may hold different lengths; and a Ctrl+C between
    # a layer's two concatenations leaves its keys one longer than its values, so each is cut to
    # the absolute length (the layer's relative crop would cut both by the keys' excess)
    rewind = getattr(cache, "rewind_states", None)  # a hybrid's state-space layers (core.state_cache)
    if rewind is not None:
        rewind(length)
    layer: Any  # any kind of cache layer, a model's own included: read by what it has, below
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or not hasattr(layer, "get_seq_length"):
            continue  # not started, or a state-space layer without K/V (rewound above)
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor):
            # each cut on its own: a Ctrl+C between the two concatenations of a prompt's forward leaves
            # the keys filled and the values still lazy initialisation's empty 1-D placeholder
            if keys.dim() >= 2 and keys.shape[-2] > length:
                layer.keys = keys[..., :length, :]
            if values.dim() >= 2 and values.shape[-2] > length:
                layer.values = values[..., :length, :]
            indexer = getattr(layer, "indexer_keys", None)  # a sparse indexer's own keys (B, T, d): deepseek_v32
            if isinstance(indexer, torch.Tensor) and indexer.dim() == 3 and indexer.shape[1] > length:
                layer.indexer_keys = indexer[:, :length]
            continue
        n = layer.get_seq_length()
        if n > length:
            layer.crop(-(n - length))


def save_state(cache, recorder, start: int):
    """A function that puts the cache and the records back exactly as they are now, or None.

    Used by recomputes from ``start``: a cancel or a fault costs no second forward. A plain
    cache's tensors are kept by reference (a crop makes views and each update a new tensor, so
    they stay as they are); the records from ``start`` on are copied. None for a cache with other
    kinds of layers (a model's own cache may write in place): the caller recomputes instead.
    """
    if not all(type(layer) is hf.DynamicLayer for layer in cache.layers):
        return None
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    saved = recorder.save_from(start)

    def put_back() -> None:
        for layer, (k, v) in zip(cache.layers, kv):
            layer.keys, layer.values = k, v
        with torch.inference_mode():  # the record buffers were made in inference mode
            recorder.restore(saved)

    return put_back


@functools.cache
def _takes_position_ids(cls: type[Any]) -> bool:
    return "position_ids" in inspect.signature(cls.forward).parameters


def position_kwargs(model, start: int, ids: torch.Tensor) -> dict:
    """``position_ids`` for positions start.. where the model's forward takes them, as ``generate``
    passes them: some models decode differently without (bamba's Mamba2 layers by 3 logits)."""
    # a class is hashable; mypy checks a class object against Hashable with type.__hash__ unbound and refuses it
    if not _takes_position_ids(type(model)):  # type: ignore[arg-type]
        return {}
    pos = torch.arange(start, start + ids.shape[1], dtype=torch.long, device=ids.device)  # (n,)
    return {"position_ids": pos[None].expand(ids.shape[0], -1)}  # (B, n)


@contextlib.contextmanager
def interrupts_deferred():
    """Hold Ctrl+C back until the block ends, so a commit or a rollback is never half done.

    Only the main thread receives SIGINT, and only it may install handlers; elsewhere this is a no-op.
    The handler is swapped by one C call (``signal.signal`` runs Python code that Ctrl+C can cut): a
    SIGINT either comes before it, and the block never starts, or is held back until the block ends.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list = []
    try:
        previous = _signal.signal(signal.SIGINT, lambda signum, frame: pending.append((signum, frame)))
    except (ValueError, OSError):
        previous = None
    if previous is None or not callable(previous):  # SIG_IGN/SIG_DFL or a non-Python handler: nothing to defer
        if previous is not None:
            _signal.signal(signal.SIGINT, previous)
        yield
        return
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, previous)
        if pending:
            previous(*pending[0])  # the default handler raises KeyboardInterrupt here, after the block


def undo(fn: Callable[[], None]) -> None:
    """Run the rollback ``fn`` to its end with Ctrl+C held back, even when one lands as it begins.

    ``fn`` must be safe to run again (crops, puts back). Called while an interrupt already unwinds:
    a second Ctrl+C must not skip the rollback, and is raised once the rollback is done.
    """
    again = None
    while True:
        done = False
        try:
            with interrupts_deferred():
                fn()
                done = True
        except KeyboardInterrupt as e:
            again = e
            if not done:
                continue
        break
    if again is not None:
        raise again


def forward_with_rollback(lm, cache, recorder, ids: torch.Tensor, keep: int, take, oom_remedy: str, remedy: str):
    """Run ``ids`` (B, n) after ``cache`` with recording on and return ``take(logits)``.

    Logits are (B, keep, V). Any fault crops the cache and the records back to where they were
    and raises StepFailed with the remedy to try, so callers stay at their last good step. An
    interrupt (Ctrl+C) rolls back the same way and is re-raised as itself: the user asked to stop,
    nothing failed.
    """
    start = cache.get_seq_length()
    begin = getattr(cache, "begin_forward", None)  # a hybrid's cache keeps its states from here (core.state_cache)
    if begin is not None:
        begin(start)
    # an explicit all-ones mask: nothing is padded, even where the pad id is a real token
    seen = torch.ones((ids.shape[0], start + ids.shape[1]), dtype=torch.long, device=ids.device)  # (B, T)
    outer = capture.active_recorder()
    try:
        with torch.inference_mode(), recorder.active():
            out = hf.call(lm.model, cache, input_ids=ids, attention_mask=seen, use_cache=True, logits_to_keep=keep,
                          **position_kwargs(lm.model, start, ids))  # fmt: skip
        logits = take(out.logits)
        for dev in lm.cuda_devices:  # the records were copied asynchronously, from every GPU a layer ran on
            torch.cuda.synchronize(dev)
        return logits
    except BaseException as e:
        # the active recorder too: a Ctrl+C between entering `recorder.active()` and its body skips its exit
        def rollback() -> None:
            crop_cache(cache, start)
            recorder.crop(start)
            capture.make_active(outer)

        undo(rollback)
        if not isinstance(e, Exception):
            raise
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        if lm.device.type == "cuda":
            torch.cuda.empty_cache()
        msg = f"the model failed at position {start}: {type(e).__name__}: {e}"
        raise StepFailed(msg, oom_remedy if oom else remedy) from e
