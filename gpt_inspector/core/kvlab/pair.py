"""The lab's two runs stepped by one forward, a batch of two: the model's weights are read once.

A decode step of a small model on a CPU is bound by reading its weights, so two runs of one model
in one batch cost far less than two forwards (about 1.5x one, against 2x). Each row's attention is
computed and recorded as its own run's would be (``capture.RowRecorders``), the policy applying to
its row only. The two runs keep their own caches: after each paired forward they hold views of
the pair's batch rows, and the pair is rebuilt from them whenever either was changed on its own
(a step back, a recompute).
"""

from __future__ import annotations

import time

import torch

from ..capture import RowRecorders, Unpairable
from ..errors import StepFailed
from ..forward import forward_with_rollback, interrupts_deferred
from ..hf import DynamicCache, DynamicLayer
from ..session import Session
from ..step import Step


class _Growing(DynamicLayer):
    """A cache layer that appends in place into spare capacity, where DynamicLayer concatenates.

    DynamicLayer copies the whole cache on every step (``torch.cat``): for the pair at T = 512 on
    GPT-2-small that is 75 MB a step, a sixth of the forward. Rows past the current length are
    never viewed by anyone (each run holds a view of at most the length the pair had), so writing
    there is safe; a pair whose runs changed on their own is rebuilt, never written into.
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t, n = self.get_seq_length(), key_states.shape[-2]
        buf = getattr(self, "_buf", None)
        if buf is None or t + n > buf[0].shape[-2] or buf[0].shape[:2] != key_states.shape[:2]:
            cap = t + n + max(64, (t + n) // 4)
            buf = tuple(
                x.new_empty((*x.shape[:2], cap, x.shape[-1])) for x in (key_states, value_states)
            )  # (B, H, cap, d)
            if t:
                buf[0][:, :, :t].copy_(self.keys)
                buf[1][:, :, :t].copy_(self.values)
            self._buf = buf
        buf[0][:, :, t : t + n].copy_(key_states)
        buf[1][:, :, t : t + n].copy_(value_states)
        self.keys, self.values = buf[0][:, :, : t + n], buf[1][:, :, : t + n]  # (B, H, T, d) views
        return self.keys, self.values


def _plain(cache) -> bool:
    return type(cache) is DynamicCache and all(type(layer) is DynamicLayer for layer in cache.layers)


class PairStepper:
    """Step sessions ``a`` and ``b`` of one model together, when their caches are plain and level."""

    def __init__(self, a: Session, b: Session):
        self.a, self.b = a, b
        self._cache: DynamicCache | None = None
        self._views: list | None = None  # the layer tensors the runs held after the last paired forward

    def ready(self) -> bool:
        a, b = self.a, self.b
        return a.lm is b.lm and a.cache_length == b.cache_length and _plain(a.cache) and _plain(b.cache)

    def _held(self) -> list:
        return [
            t for x, y in zip(self.a.cache.layers, self.b.cache.layers) for t in (x.keys, x.values, y.keys, y.values)
        ]

    def _pair_cache(self) -> DynamicCache:
        held = self._held()
        if self._views is not None and len(held) == len(self._views) and all(x is y for x, y in zip(held, self._views)):
            assert self._cache is not None  # set with the views it was built from (_adopt)
            return self._cache
        cache = DynamicCache()
        cache.layer_class_to_replicate = _Growing  # the first forward's layers too
        with torch.inference_mode():  # the runs' cache tensors are inference tensors
            for x, y in zip(self.a.cache.layers, self.b.cache.layers):
                layer = _Growing()
                if x.is_initialized and x.keys.numel():
                    layer.update(torch.cat([x.keys, y.keys]), torch.cat([x.values, y.values]))  # (2, Hkv, T, d)
                cache.layers.append(layer)
        return cache

    def _adopt(self, cache: DynamicCache) -> None:
        """Each run's cache becomes its row of the pair's (views: no copy)."""
        for r, s in enumerate((self.a, self.b)):
            while len(s.cache.layers) < len(cache.layers):
                s.cache.layers.append(DynamicLayer())
            for own, pair in zip(s.cache.layers, cache.layers):
                # both are DynamicLayers: ready() checked the runs' caches, _pair_cache built this one
                assert isinstance(own, DynamicLayer) and isinstance(pair, DynamicLayer)
                if not pair.is_initialized:
                    continue
                assert pair.keys is not None and pair.values is not None  # an initialized layer holds both
                if not own.is_initialized:
                    own.lazy_initialization(pair.keys, pair.values)
                own.keys, own.values = pair.keys[r : r + 1], pair.values[r : r + 1]  # (1, Hkv, T, d)
        self._cache, self._views = cache, self._held()

    def step(self) -> tuple[Step, Step]:
        """One step of each run from one forward. On any failure both are where they were, and
        ``Unpairable`` says the model cannot be stepped this way (step the runs one by one)."""
        a, b = self.a, self.b
        (ids_a, start, rng_a), (ids_b, _, rng_b) = a.next_input(), b.next_input()
        if len(ids_a) != len(ids_b):
            raise Unpairable("the runs feed different lengths")
        lm = a.lm
        x = torch.tensor([ids_a, ids_b], dtype=torch.long, device=lm.device)  # (2, n)
        cache = self._pair_cache()
        self._cache = self._views = None  # until the forward is adopted, the pair is rebuilt from the runs
        done = a.n_steps, b.n_steps
        t0 = time.perf_counter()
        try:
            logits = forward_with_rollback(
                lm, cache, RowRecorders([a.recorder, b.recorder]), x, 1,
                lambda out: out[:, -1].float().to("cpu"),  # (2, V)
                "out of memory: the lab holds two runs; try a shorter prompt or a smaller dtype",
                "both runs are back at their last good step",
            )  # fmt: skip
            seconds = time.perf_counter() - t0
            self._adopt(cache)
            got_a = a.commit_step(logits[0], seconds)
            return got_a, b.commit_step(logits[1], seconds)
        except BaseException as e:
            # whatever stopped it (a fault, Ctrl+C anywhere up to a commit): a run that did not commit
            # is put back (so the pair is rebuilt); one that did is the caller's to step back
            with interrupts_deferred():
                for s, n, rng in ((a, done[0], rng_a), (b, done[1], rng_b)):
                    if s.n_steps == n:
                        s.undo_forward(start, rng)
            if isinstance(e, StepFailed) and isinstance(e.__cause__, Unpairable):
                raise e.__cause__ from None
            raise
