"""The debugger's state machine: one token per step through the model with its KV cache."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from . import chat, decoding, hf, kv_layout, validate
from .attention import KINDS
from .capture import scratch_forward
from .edits import HeadEdit, MaskEdit
from .errors import Cancelled, InspectorError, StepFailed, check_index
from .forward import Run, crop_cache, forward_with_rollback, interrupts_deferred, undo
from .live import Live
from .models import LoadedModel
from .recipe_check import MAX_RECOMPUTES, RECIPE_FORMAT, check_recipe, compact_ops, edit_shape, push_op
from .recompute import EditingMixin, MaskEditReport
from .source import ModelShape, RunRecords, RunSource, model_refusals
from .step import TOP_N, Step, TopEntry

# head outputs kept for the newest 128 to 256 positions (see Session._window_outputs)
OUTPUT_WINDOW = 128


class _SessionRecords(RunRecords):
    """A session's run-source records: its recorder's rows, K/V from its cache (or our mirror)."""

    def __init__(self, session: Session):
        self._s = session

    @property
    def head_output_start(self) -> int:
        return self._s.recorder.out_floor

    @property
    def edits(self):
        return self._s.recorder.edits

    def queries(self, layer: int) -> torch.Tensor:
        s = self._s
        return s.recorder.q[layer].view(s.cache_length)[0]  # (H, T, d)

    def keys(self, layer: int) -> torch.Tensor:
        return self._s._kv_rows(layer, self._s.cache_length)[0]  # (Hkv, T, d)

    def values(self, layer: int) -> torch.Tensor:
        return self._s._kv_rows(layer, self._s.cache_length)[1]  # (Hkv, T, d)

    def head_outputs(self, layer: int) -> torch.Tensor:
        s, rec = self._s, self._s.recorder
        kept = rec.out[layer].view(s.cache_length - rec.out_from)[0]  # (H, T - out_from, d)
        if rec.out_from <= rec.out_floor:
            return kept
        middle = s._recomputed_outputs(layer)[:, rec.out_floor :]  # (H, out_from - floor, d)
        return torch.cat([middle, kept], dim=1)  # (H, T - floor, d)

    def head_output_row(self, layer: int, position: int) -> torch.Tensor | None:
        # the kept row; the rows between the floor and out_from are recomputed (with every earlier one)
        s, rec = self._s, self._s.recorder
        if position < rec.out_from:
            return None
        return rec.out[layer].view(s.cache_length - rec.out_from)[0, :, position - rec.out_from]  # (H, d)

    def recomputed_head_outputs(self, layer: int) -> torch.Tensor:
        return self._s._recomputed_outputs(layer)[:, : self._s.recorder.out_floor]  # (H, floor, d)

    def mask_rows(self, layer: int) -> dict:
        return self._s.recorder.mask_rows[layer]

    def scaling(self, layer: int) -> float:
        scale = self._s.recorder.scaling[layer]
        assert scale is not None  # recorded by the layer's first forward, before a reader can ask
        return scale

    def softcap(self, layer: int) -> float | None:
        return self._s.recorder.softcap[layer]

    def sink(self, layer: int) -> torch.Tensor | None:
        return self._s.recorder.sinks[layer]

    def score_bias(self, layer: int):
        return self._s.recorder.score_bias(layer, self._s.cache_length)


class Session(EditingMixin, ModelShape, RunSource, Run):
    """Step a loaded model through generation, recording every attention quantity.

    ``Session(model, prompt, temperature=0.0, top_k=None, top_p=None, seed=0, **settings)``, where
    ``settings`` are more of ``generate``'s sampler arguments (``repetition_penalty``, ``min_p``, ...;
    see ``decoding.Decoding``), or ``decoding=Decoding(...)`` for all of them at once. The read
    accessors (``attention``, ``qkv``, ...) come from ``RunSource``; this class keeps the state.
    """

    read_only = False
    # the bases declare these differently (RunSource for any source, the others for a live run); a
    # session's, for the checker: the model always there, its steps a list it appends to
    lm: LoadedModel
    steps_done: list[Step]
    head_edits: list[HeadEdit]

    def __init__(
        self,
        model: LoadedModel,
        prompt: str = "",
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        *,
        prompt_ids: list[int] | None = None,
        decoding: decoding.Decoding | None = None,
        messages: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **settings,
    ):
        self.lm = model
        # the prompt made by the tokenizer's chat template (its ids exactly apply_chat_template's), or None
        self.chat: chat.Chat | None = None
        if messages is not None:
            if prompt or prompt_ids is not None:
                raise InspectorError("give messages or a prompt, not both")
            self.chat = chat.build(model.tokenizer, messages, add_generation_prompt)
            prompt_ids = list(self.chat.ids)
        self.decoding = decoding if decoding is not None else _decoding(temperature, top_k, top_p, **settings)
        # the checkpoint's own generation-config defaults, which generate applies unless overridden
        self.shipped = hf.generation_defaults(model.model)
        self._samplers: dict = {}
        self.seed = validate.seed(seed)
        ids = validate.prompt_ids(model, prompt, prompt_ids)  # before decode: a bad id must not reach the tokenizer
        self.prompt = prompt if prompt_ids is None else self.chat.text if self.chat else model.tokenizer.decode(ids)
        if len(ids) >= model.context_length:
            raise InspectorError(
                f"prompt is {len(ids)} tokens; the model's context is {model.context_length}, "
                "which leaves no room to generate; shorten it"
            )
        self.prompt_ids = ids
        self.tokens: list[int] = list(ids)
        self.sampler()  # the settings checked against this model (token ids in its vocabulary) before any step
        self.finished: str | None = None
        self._blocked: dict[tuple, MaskEdit] = {}
        self._head_edits: list[HeadEdit] = []
        self._patch_sources: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self._initial_decoding = self.decoding
        # every change in order, so a recipe replays exactly (mid-session temperature or mask changes too)
        self._ops: list[dict] = []
        self.generator = torch.Generator().manual_seed(seed)
        Run.__init__(self, model)  # the cache, the records, no step yet
        # head outputs where steps decide tokens (see Recorder.out_from), the newest OUTPUT_WINDOW of them
        self.recorder.out_from = self.recorder.out_floor = len(ids) - 1
        self._early_outputs: tuple | None = None  # the rows before out_from, recomputed on demand
        self.records = _SessionRecords(self)

    # ------------------------------------------------------------------ state
    @property
    def ended(self) -> bool:
        """EOS or the context limit: no step can follow until a step back or a forced token."""
        return bool(self.finished)

    @property
    def mask_edits(self) -> list[MaskEdit]:
        return list(self._blocked.values())

    # ------------------------------------------------------------------ stepping
    def _forward(self, ids: list[int], keep: int) -> torch.Tensor:
        """Run ``ids`` after the cache; returns logits (keep, V) float32 on the CPU.

        On failure the cache and records are put back where they were.
        """
        x = torch.tensor([ids], dtype=torch.long, device=self.lm.device)  # (1, n)
        try:
            return forward_with_rollback(
                self.lm, self.cache, self.recorder, x, keep,
                lambda logits: logits[0].float().to("cpu"),  # (keep, V)
                "out of memory: try --device cpu, a smaller dtype (float16/bfloat16) or a shorter prompt",
                "the session is back at its last good step",
            )  # fmt: skip
        except StepFailed as e:
            self._emit("fault", e.__cause__)
            raise

    def sampler(self, dec: decoding.Decoding | None = None) -> decoding.Sampler:
        """generate's processors for ``dec`` (default: the settings in force) on this model and prompt."""
        dec = dec or self.decoding
        if dec not in self._samplers:
            _check_ids(dec, self.lm.vocab_size)
            if len(self._samplers) > 16:  # a dragged slider makes many; the newest few are what is reused
                self._samplers.clear()
            self._samplers[dec] = decoding.Sampler(dec, self.shipped, self.lm.eos_token_ids, len(self.prompt_ids),
                                                   self.lm.context_length)  # fmt: skip
        return self._samplers[dec]

    def _context(self, index: int) -> list[int]:
        """The tokens before step ``index`` chose (what generate's processors see as input_ids)."""
        return self.tokens[: len(self.prompt_ids) + index]

    def _make_step(self, logits: torch.Tensor, seconds: float) -> Step:
        index = self.n_steps
        rng = self.generator.get_state()
        sampler = self.sampler()
        stages = sampler.stages(logits, self._context(index))
        token = sampler.choose_from(stages[-1].scores, self.generator)
        s = Step(index, len(self.prompt_ids) - 1 + index, token, "", logits, logits, [], 0.0, False, seconds, None, rng)
        self._refresh(s, stages=stages)
        return s

    def _refresh(self, s: Step, dec: decoding.Decoding | None = None, stages=None) -> None:
        s.refresh(self.sampler(dec), self.label, lambda i: self.lm.tokenizer.decode([i]), self._context(s.index),
                  stages)  # fmt: skip
        # the chosen token is fed next, at position P + index; it must fit in the context
        full = len(self.prompt_ids) + s.index + 1 > self.lm.context_length
        s.finish_reason = "eos" if s.token_id in self.lm.eos_token_ids else "context" if full else None

    def step(self) -> Step:
        """Feed one new token (the whole prompt at step 0) and choose the next one."""
        ids, start, rng = self.next_input()
        index, t0 = self.n_steps, time.perf_counter()
        try:
            logits = self._forward(ids, 1)[-1]  # (V,)
            return self.commit_step(logits, time.perf_counter() - t0)
        except BaseException:
            # an error or Ctrl+C anywhere up to the commit: a forward not committed is undone
            if self.n_steps == index:
                self.undo_forward(start, rng)
            raise

    def next_input(self) -> tuple[list[int], int, torch.Tensor]:
        """What the next step feeds (the prompt at step 0, else the last token), and the cache length
        and sampler state to go back to if its forward fails. Raises once generation has finished."""
        if self.finished:
            raise InspectorError(f"generation has finished ({self.finished}); step back, force a token or restart")
        ids = self.prompt_ids if not self.steps_done else [self.tokens[-1]]
        return ids, self.cache_length, self.generator.get_state()

    def undo_forward(self, start: int, rng: torch.Tensor) -> None:
        """Put the cache, the records and the sampler back where ``next_input`` found them."""

        def back():
            crop_cache(self.cache, start)
            self.recorder.crop(start)
            self.generator.set_state(rng)

        undo(back)

    def commit_step(self, logits: torch.Tensor, seconds: float) -> Step:
        """Choose from ``logits`` (V,) of the forward that fed ``next_input`` (its cache and records
        already hold it) and make it the step. If this raises before the step is committed
        (``n_steps`` unchanged), the caller undoes the forward (``undo_forward``)."""
        s = self._make_step(logits, seconds)
        with interrupts_deferred():  # all of the commit or none of it
            self.steps_done.append(s)
            self.tokens.append(s.token_id)
            self.finished = s.finish_reason
            self._ops.append({"op": "step"})
        self._window_outputs()
        self._emit("step", s)
        return s

    def run(self, n: int) -> list[Step]:
        validate.count(n)
        return list(self.steps(n))

    def step_back(self) -> Step:
        """Undo the last step exactly: crop the cache, restore the sampler's state.

        Atomic under Ctrl+C: everything that can take time is computed first, and the state changes
        all at once with SIGINT held back, so an interrupt leaves the step either undone or not.
        """
        if not self.steps_done:
            raise InspectorError("nothing to step back: no step has run")
        s = self.steps_done[-1]
        prev = self.steps_done[-2] if len(self.steps_done) > 1 else None
        # the step now current shows the decoding in force, as after any other change (and a compacted
        # recipe, which moves a decoding change before the step it was made on, then replays exactly)
        shown = self._refreshed(prev) if prev is not None else None
        ops = push_op(self._ops, {"op": "step_back"})
        fed = len(self.prompt_ids) if s.index == 0 else 1
        with interrupts_deferred():
            self._pop_steps(1, fed, s.rng_state)
            if prev is not None:
                vars(prev).update(vars(shown))
            self.finished = prev.finish_reason if prev else None
            self._ops = ops
        self._emit("step_back", s)
        return s

    def restart(self) -> None:
        """Step back to before the first step, all in one: an interrupt leaves every step or none."""
        if not self.steps_done:
            return
        ops = self._ops
        for _ in self.steps_done:
            ops = push_op(ops, {"op": "step_back"})
        gone = self.steps_done[::-1]
        with interrupts_deferred():
            self._pop_steps(len(gone), self.cache_length, self.steps_done[0].rng_state)
            self.finished = None
            self._ops = ops
        for s in gone:
            self._emit("step_back", s)

    def _pop_steps(self, n: int, fed: int, rng: torch.Tensor | None) -> None:
        """Drop the last ``n`` steps and the ``fed`` cache positions they added (call with SIGINT held back)."""
        del self.steps_done[-n:]
        del self.tokens[len(self.tokens) - n :]
        self.cache.crop(-fed)  # the cache's own crop: a hybrid's rewinds its state-space layers too
        self.recorder.crop(self.cache_length)
        if rng is not None:
            self.generator.set_state(rng)

    def _refreshed(self, s: Step, dec: decoding.Decoding | None = None, **changes) -> Step:
        """A copy of ``s`` with ``changes`` and what depends on them recomputed; ``s`` is untouched, so the
        caller can swap the copy in at its commit (``vars(s).update(vars(copy))``)."""
        c = dataclasses.replace(s, **changes)
        self._refresh(c, dec)
        return c

    def force_token(self, token_id: int) -> Step:
        """Replace the current step's choice: the generation branches from here."""
        if not self.steps_done:
            raise InspectorError("no step yet: run a step first")
        s = self.steps_done[-1]
        new = self._refreshed(s, token_id=check_index(token_id, self.lm.vocab_size, "token id"), forced=True)
        ops = push_op(self._ops, {"op": "force", "token_id": new.token_id})
        with interrupts_deferred():  # all of the change or none of it
            vars(s).update(vars(new))
            self.tokens[-1] = s.token_id
            self.finished = s.finish_reason
            self._ops = ops
        self._emit("force", s)
        return s

    # ------------------------------------------------------------------ decoding, live
    _UNSET = object()

    def set_decoding(self, temperature=_UNSET, top_k=_UNSET, top_p=_UNSET, redecide: bool = False, *,
                     decoding: decoding.Decoding | None = None, **settings) -> Step | None:  # fmt: skip
        """Change the decoding settings; the current distribution updates at once, no model run.

        The settings named change (``generate``'s names; None turns one off), the others stay;
        ``decoding`` replaces them all. With ``redecide`` the current token is chosen again from the
        stored logits (sampling from the same generator state the original choice used).
        """
        if decoding is None:
            given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, **settings}
            decoding = self.decoding.replace(**{k: v for k, v in given.items() if v is not self._UNSET})
        new = decoding
        self.sampler(new)  # checked against the model (token ids) before anything changes
        ops = push_op(self._ops, {"op": "decoding", **new.to_json(), "redecide": bool(redecide)})
        s = self.current
        fresh, rng = None, None
        if s is not None:
            token = s.token_id
            if redecide and not s.forced:
                # a generator of its own: the session's is touched only at the commit below
                assert s.rng_state is not None  # every session step keeps the state it chose with (_make_step)
                g = torch.Generator().set_state(s.rng_state)
                token = self.sampler(new).choose(s.logits, self._context(s.index), g)
                rng = g.get_state()
            fresh = self._refreshed(s, new, token_id=token)
        with interrupts_deferred():  # all of the change or none of it
            self.decoding = new
            self._ops = ops
            if s is not None:
                vars(s).update(vars(fresh))
                self.tokens[-1] = s.token_id
                self.finished = s.finish_reason
                if rng is not None:
                    self.generator.set_state(rng)
        self._emit("decoding", s)
        return s

    def set_temperature(self, t: float, redecide: bool = False) -> Step | None:
        return self.set_decoding(temperature=t, redecide=redecide)

    def set_top_k(self, k: int | None, redecide: bool = False) -> Step | None:
        return self.set_decoding(top_k=k, redecide=redecide)

    def set_top_p(self, p: float | None, redecide: bool = False) -> Step | None:
        return self.set_decoding(top_p=p, redecide=redecide)

    # ------------------------------------------------------------------ run-source primitives
    def cached_rows(self, layer: int) -> torch.Tensor | None:
        lay = self.lm.kv_layout
        kv = None if lay is None else lay.layers[self.check_layer(layer)]
        if kv is None or kv.reads is not None or not kv.cached or self.cache_length == 0:
            return None  # the cache holds the per-head K and V the views show (or nothing of its own)
        t, held = self.cache_length, kv_layout.cache_tensors(self.cache.layers[layer])  # (1, h, T, n) each, as stored
        if held is None:
            return None
        return torch.cat([x[0, :, :t].transpose(0, 1).reshape(t, -1) for x in held], dim=1)  # (T, cache numbers)

    @property
    def kv_policy(self):
        return self.recorder.kv_policy

    @property
    def live(self) -> Live:
        """Everything runs on a session; under a KV cache policy (the lab's policy run) what would
        run the model without replaying its evictions is refused."""
        refused = model_refusals(self.lm)
        if self.recorder.kv_policy is not None:
            refused.update(
                probe="the cache probe would read every row back; the policy's cache has dropped some: "
                "use the KV cache lab's Probe, which reads what the policy holds",
                recompute="a policy run keeps every head output it computed; a recompute would not replay "
                "the policy's evictions",
                lens="the logit lens recomputes residuals without the policy's evictions: "
                "run it on the reference session",
            )
        return Live(refused)

    def _window_outputs(self) -> None:
        """Keep the head outputs of the newest OUTPUT_WINDOW to 2 * OUTPUT_WINDOW positions only.

        A fixed buffer instead of a row per generated token (on GQA models q alone is already 2x
        the KV cache); the views read the newest row, older ones are recomputed when asked for.
        A KV policy under study keeps them all: a scratch forward would not replay its evictions.
        """
        rec = self.recorder
        if rec.kv_policy is None and rec.length - rec.out_from > 2 * OUTPUT_WINDOW:
            rec.keep_outputs_from(rec.length - OUTPUT_WINDOW)

    def _recomputed_outputs(self, layer: int) -> torch.Tensor:
        """(H, out_from, d): the rows the recorder does not keep, from the model run again on them.

        The processed tokens as one forward, under the edits in force (teacher-forced, as the
        session ran them); kept until those tokens or the edits change.
        """
        start = self.recorder.out_from
        # the edits objects themselves, not their ids: an id can be reused once the old edits are freed
        key = (tuple(self.tokens[: start + 1]), self.recorder.edits, self.recorder.head_edits)
        old = self._early_outputs
        if old is None or old[0][0] != key[0] or old[0][1] is not key[1] or old[0][2] is not key[2]:
            self._early_outputs = None  # the old rows go before the new forward allocates
            rec = scratch_forward(self.lm, key[0], like=self.recorder)
            old = self._early_outputs = (
                key,
                {i: rec.out[i].view(start + 1)[0, :, :start].clone() for i in self.attention_layers},
            )
        return old[1][layer]

    def record_bytes(self) -> int:
        """Bytes our own records hold beyond the cache (q, attention outputs, KV mirror on GPUs)."""
        return self.recorder.nbytes()

    # ------------------------------------------------------------------ persistence
    def recipe(self) -> dict:
        """Everything needed to replay this session exactly (JSON-safe).

        Model, prompt, seed and the starting decoding, then every change in order; the current
        settings, forced tokens and mask edits are repeated for readers.
        """
        return {
            "format": RECIPE_FORMAT,
            "model": self.lm.name,
            "prompt": self.prompt,
            "prompt_ids": list(self.prompt_ids),
            "seed": self.seed,
            "initial_decoding": self._initial_decoding.to_json(),
            "ops": [dict(op) for op in self._ops],
            "decoding": self.decoding.to_json(),
            "forced": {str(s.index): s.token_id for s in self.steps_done if s.forced},
            "mask_edits": [e.to_json() for e in self.mask_edits],
            "head_edits": [e.to_json() for e in self._head_edits],
            "tokens": list(self.tokens),
            **({} if self.chat is None else {"chat": self.chat.to_json()}),
        }

    @classmethod
    def replay(cls, lm: LoadedModel, recipe: dict, progress: Callable[[int, int], None] | None = None,
               cancelled: Callable[[], bool] | None = None) -> Session:  # fmt: skip
        """Rebuild a session from ``recipe()`` output; the same model gives the same tokens.

        The recipe is checked whole first, and what later operations cancel or supersede is dropped
        (``compact_ops``: the same state in fewer model runs).
        ``progress(done, total)`` hears of each operation replayed; when ``cancelled()`` turns true
        between two, ``Cancelled`` is raised (the half-replayed session is dropped).
        """
        check_recipe(recipe)  # whole, before anything runs: a file from outside
        ops = compact_ops(recipe["ops"], edit_shape(lm))
        if sum(op["op"] in ("mask", "heads") for op in ops) > MAX_RECOMPUTES:
            raise InspectorError(f"more than {MAX_RECOMPUTES} mask or head edit operations")
        dec = decoding.Decoding.from_json(recipe["initial_decoding"])
        if "chat" in recipe:  # the turns again, through the template: the same ids, checked below
            c = recipe["chat"]
            s = cls(lm, seed=recipe["seed"], decoding=dec, messages=c["messages"],
                    add_generation_prompt=c["add_generation_prompt"])  # fmt: skip
            if s.prompt_ids != list(recipe["prompt_ids"]):
                raise InspectorError("this model's chat template makes other tokens of the recipe's messages")
        else:
            s = cls(lm, recipe["prompt"], seed=recipe["seed"], prompt_ids=list(recipe["prompt_ids"]), decoding=dec)
        for n, op in enumerate(ops):
            if cancelled is not None and cancelled():
                raise Cancelled("the restore was cancelled")
            kind = op["op"]
            if kind == "step":
                s.step()
            elif kind == "step_back":
                s.step_back()
            elif kind == "force":
                s.force_token(op["token_id"])
            elif kind == "decoding":
                # every setting the op holds, and none it does not: a setting turned off is absent
                settings = {k: v for k, v in op.items() if k not in ("op", "redecide")}
                s.set_decoding(redecide=bool(op.get("redecide", False)), decoding=decoding.Decoding.from_json(settings))
            elif kind == "mask":
                s.set_mask_edits([MaskEdit.from_json(e) for e in op["edits"]])
            else:  # "heads": check_recipe let nothing else through
                s.set_head_edits([HeadEdit.from_json(e) for e in op["edits"]])
            if progress is not None:
                progress(n + 1, len(ops))
        return s


def _check_ids(dec: decoding.Decoding, vocab: int) -> None:
    ids = [*(dec.suppress_tokens or ()), *(i for w in dec.bad_words_ids or () for i in w)]
    if dec.forced_eos_token_id is not None:
        ids.append(dec.forced_eos_token_id)
    bad = [i for i in ids if i >= vocab]
    if bad:
        raise InspectorError(f"token id {bad[0]} in the decoding settings is outside the vocabulary (size {vocab})")


def _decoding(temperature, top_k, top_p, **settings) -> decoding.Decoding:
    """The settings as given (InspectorError, not TypeError, for a name generate does not take here)."""
    return decoding.Decoding.from_json({"temperature": temperature, "top_k": top_k, "top_p": top_p, **settings})


__all__ = ["Session", "Step", "TopEntry", "MaskEdit", "MaskEditReport", "KINDS", "TOP_N"]
