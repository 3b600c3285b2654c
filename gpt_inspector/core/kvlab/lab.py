"""The lab: a session under a cache policy, in lockstep with the full-cache reference.

    >>> lab = KVLab(lm, "The cat sat", make("h2o", budget=16))
    >>> for st in lab.steps(20): print(st.index, st.kl, st.agree, st.bytes_ratio)
    >>> lab.first_divergence, lab.probe().recovered
    >>> lab.step_back()  # both runs and the policy's own state go back; step again: the same numbers

Two sessions run the same prompt. Teacher-forced (the default), the reference chooses every
token and the policy run is fed the same one, so each step compares two next-token distributions
over the same context; free-running, each run chooses its own tokens and ``parted_at`` says where
the texts part.

What the policy run's records hold: the K/V as its last forward's attention read them (the
dequantized entries of a quantized cache, every position of an evicted one), and its attention
reads (``lab.run.attention(...)``) mask each evicted entry from the query where it was evicted
on. The model's own cache under the policy run keeps the full-precision entries: that is what
``row_error`` compares against. A quantized entry's value changes when it leaves the residual
window, so earlier rows re-derived from the records show how the current cache is read; the
newest row is exactly what attention computed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..capture import Recorder, Unpairable
from ..errors import InspectorError, StepFailed
from ..session import Session, interrupts_deferred
from .pair import PairStepper
from .policy import Policy


@dataclass
class LabStep:
    """What one lockstep step compared."""

    index: int
    position: int  # the query position whose logits were compared
    reference_token: int  # the reference's choice
    policy_token: int  # the policy run's own choice (before teacher forcing)
    fed_token: int  # what the policy run is fed next
    kl: float  # KL(reference || policy) of the next-token distribution, in nats
    agree: bool  # the two most likely tokens are the same
    bytes_policy: list[int]  # per layer, what the policy's cache holds after the step
    bytes_full: list[int]  # per layer, the model's own full cache (sliding-window layers: their window)
    lost_mass: np.ndarray  # (L, H): the reference's attention on entries the policy run could not see
    evicted_now: list[int]  # per layer, entries (summed over KV heads) the policy no longer holds
    reference_label: str = ""
    policy_label: str = ""
    # per layer, what the inspector keeps of the reference (every position): more than bytes_full on windowed layers
    bytes_kept: list[int] = field(default_factory=list)
    # per layer, as a paged cache would allocate them (the policy's page size; None: a quantized store)
    bytes_paged: list[int] | None = None
    bytes_full_paged: list[int] | None = None
    page: int = 1

    @property
    def bytes_ratio(self) -> float:
        full = sum(self.bytes_full)
        return sum(self.bytes_policy) / full if full else 1.0

    def to_json(self) -> dict:
        return {
            "index": self.index, "position": self.position,
            "reference_token": self.reference_token, "reference_label": self.reference_label,
            "policy_token": self.policy_token, "policy_label": self.policy_label, "fed_token": self.fed_token,
            "kl": self.kl, "agree": self.agree,
            "bytes_policy": sum(self.bytes_policy), "bytes_full": sum(self.bytes_full),
            "bytes_policy_per_layer": list(self.bytes_policy), "bytes_full_per_layer": list(self.bytes_full),
            "bytes_kept": sum(self.bytes_kept),
            "lost_mass_max": None if np.isnan(self.lost_mass).any() else float(self.lost_mass.max()),
            "lost_mass": None if np.isnan(self.lost_mass).any() else self.lost_mass.round(6).tolist(),
            "evicted_per_layer": list(self.evicted_now),
            "page": self.page,
            "bytes_paged": None if self.bytes_paged is None else sum(self.bytes_paged),
            "bytes_full_paged": None if self.bytes_full_paged is None else sum(self.bytes_full_paged),
        }  # fmt: skip


@dataclass
class PrivacyResult:
    """The cache probe run on the policy's cache, over the prompt's positions."""

    prompt_tokens: int
    held: int  # prompt positions layer 0 still holds in at least one KV head
    recovered: int  # of those, how many the probe reads back as the right token
    text: str = ""
    positions: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "held": self.held, "recovered": self.recovered, "text": self.text}


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) in nats of the softmax distributions of two (V,) logit vectors, in float64."""
    lp = torch.log_softmax(p_logits.double(), -1)
    lq = torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum().clamp_min(0.0))


def row_error(session: Session, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Per KV head and row of a policy run: relative L2 error of what attention read (its records)
    against the full-precision entry the model's cache keeps. (keys (Hkv, T), values (Hkv, T)) float32."""
    layer = session.check_layer(layer)
    t = session.require_positions()
    cl = session.cache.layers[layer]
    out = []
    for read, exact in ((session.keys(layer), cl.keys[0, :, :t]), (session.values(layer), cl.values[0, :, :t])):
        e = exact.detach().float().cpu()
        err = (read.float() - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-12)  # (Hkv, T)
        out.append(err.numpy())
    return out[0], out[1]


def policy_rows(source, layer: int) -> tuple[np.ndarray, np.ndarray | None] | None:
    """What a view of a policy run's cache marks, or None for a source under no policy.

    (evicted (Hkv, T) bool: rows the policy's cache no longer holds, for the next query;
    error (2, Hkv, T) float32: keys' and values' relative quantization error per row, or None for
    an eviction policy, whose kept rows are exact).
    """
    policy = source.kv_policy  # a lab's policy run has one
    t = source.cache_length
    if policy is None or t == 0:
        return None
    if hasattr(policy, "rows"):  # a stand-in for a policy on a remote engine, which computed these there
        return policy.rows(layer)
    evicted = policy.evicted(layer, t).numpy()  # (Hkv, T)
    if policy.kind != "quantization" or source.cache_layer_of(layer) != layer:
        # exact rows; or a cache holding something else (a latent, another layer's): no row to compare with
        return evicted, None
    k, v = row_error(source, layer)
    return evicted, np.stack([k, v])


def final_rows(lab) -> dict:
    """After the last step, per layer and KV head: the evicted positions, or each row's quantization
    error (relative L2 of what attention read against the full-precision entry, keys and values)."""
    if not lab.history:
        return {}
    n = lab.lm.n_layers
    if lab.policy.kind == "quantization":
        errs = [lab.row_error(i) for i in range(n)]
        return {"row_error": [{"keys": k.round(6).tolist(), "values": v.round(6).tolist()} for k, v in errs]}
    return {"evicted_rows": [[[int(p) for p in row.nonzero()[0]] for row in lab.evicted(i)] for i in range(n)]}


class KVLab:
    """Run ``policy`` on ``lm`` from ``prompt`` beside the full-cache reference.

    ``reference`` and ``run`` are ordinary Sessions (the run's recorder mirrors K/V, so its
    records hold what the policy's attention read); step only through the lab.
    """

    def __init__(self, lm, prompt: str = "", policy: Policy | None = None, *, free_running: bool = False,
                 prompt_ids: list[int] | None = None, temperature: float = 0.0, top_k=None, top_p=None,
                 seed: int = 0, reference: Session | None = None):  # fmt: skip
        if not isinstance(policy, Policy):
            raise InspectorError(f"policy must come from kvlab.make(...) (or be a Policy), got {policy!r}")
        kw = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed, "prompt_ids": prompt_ids}
        lay = lm.kv_layout
        shapes = (
            list(dict.fromkeys((lk.keys, lk.values) for lk in lay.layers if lk is not None)) if lay is not None else []
        )
        if len(shapes) > 1:  # Gemma 4: its full-attention layers have their own head size (and KV heads)
            shown = ", ".join(f"{k[0]} KV heads of size {k[1]}" for k, _ in shapes)
            raise InspectorError(f"the KV cache lab sizes a policy by one KV-head count and head size for every layer; "
                                 f"{lm.name}'s layers differ ({shown})")  # fmt: skip
        self.lm = lm
        self.policy = policy
        policy.bind(lm.n_layers, lm.n_heads, lm.n_kv_heads, lm.head_dim, lm.context_length,
                    torch.empty((), dtype=lm.dtype).element_size(), lm.device)  # fmt: skip
        policy.layout = lm.kv_layout  # its bytes are of a cache built on the model's own (windows, latents)
        if hasattr(policy, "bind_model"):  # a press reads the model's attention modules and their inputs
            policy.bind_model(lm.model)
        self.run = Session(lm, prompt, **kw)
        if reference is not None and (reference.lm is not lm or reference.prompt_ids != self.run.prompt_ids
                                      or any(s.forced for s in reference.steps_done)):  # fmt: skip
            raise InspectorError("a shared reference must be a session of the same model and prompt, never forced")
        # a shared reference (a sweep runs one per prompt) may already be ahead: its steps are read, not re-run
        self.reference = reference if reference is not None else Session(lm, prompt, **kw)
        rec = Recorder(lm.n_layers, mirror_kv=True)
        self.run.recorder = rec
        policy.attach(rec)
        if hasattr(policy, "exact") and not lm.mirror_kv:
            # the full-precision K/V the run's cache holds, from which a quantizing policy rebuilds an old
            # store after a step back instead of keeping every one (a cache of latents: it keeps them)
            policy.exact = lambda layer: (self.run.cache.layers[lm.cache_layer(layer)].keys,
                                          self.run.cache.layers[lm.cache_layer(layer)].values)  # fmt: skip
        self.free_running = bool(free_running)
        self.history: list[LabStep] = []
        # the policy's state after each step of its run, by cache length: any step back of the run
        # (the lab's, the window's on the shown policy run, lab.run.step_back()) puts it back exactly
        self._states: list[tuple[int, object]] = [(0, policy.snapshot())]
        self._own_reference = reference is None
        self.run.subscribe(self._on_run)
        # the two runs step as one batch of two; a shared reference (a sweep's, read by several labs)
        # steps alone, as do the runs beside it, so a sweep's rows never depend on which lab stepped it
        self._pair: PairStepper | None = PairStepper(self.reference, self.run) if reference is None else None

    def _on_run(self, event: str, payload) -> None:
        if event == "step":
            self._states.append((self.run.cache_length, self.policy.snapshot()))
        elif event in ("step_back", "fault"):
            t = self.run.cache_length
            while len(self._states) > 1 and self._states[-1][0] > t:
                self._states.pop()
            self.policy.restore(self._states[-1][1])
            # a step back past a lab step undoes it, the reference's step with it (a shared reference is only read)
            while len(self.history) > self.run.n_steps:
                self.history.pop()
                if self._own_reference and self.reference.n_steps > len(self.history):
                    self.reference.step_back()

    # ------------------------------------------------------------------ state
    @property
    def finished(self) -> str | None:
        i = len(self.history)
        ref = self.reference.steps_done[i - 1].finish_reason if 0 < i <= self.reference.n_steps else None
        return ref or (self.run.finished if self.free_running else None)

    @property
    def first_divergence(self) -> int | None:
        """The first step where the policy run's most likely token differs from the reference's."""
        return next((s.index for s in self.history if not s.agree), None)

    @property
    def parted_at(self) -> int | None:
        """Free-running: the first step whose chosen tokens differ (the texts part there)."""
        return next((s.index for s in self.history if s.policy_token != s.reference_token), None)

    # ------------------------------------------------------------------ stepping
    def step(self) -> LabStep:
        if self.finished:
            raise InspectorError(f"the lab run has finished ({self.finished})")
        if self.run.n_steps != len(self.history) or self.reference.n_steps < len(self.history):
            raise InspectorError("the lab's runs were stepped outside the lab (in the window?): start a fresh lab")
        snap = self._states[-1][1]  # the policy's state now
        i = len(self.history)
        ref_steps, run_steps = self.reference.n_steps, self.run.n_steps
        try:
            ref, got = self._both_step(i, ref_steps)
            own = got.token_id
            if not self.free_running and own != ref.token_id:
                self.run.force_token(ref.token_id)
            st = self._measure(ref, got, own)
            with interrupts_deferred():
                self.history.append(st)
        except BaseException:
            # all or nothing (Ctrl+C included): both runs and the policy go back to the last lab step
            with interrupts_deferred():
                while self.run.n_steps > run_steps:
                    self.run.step_back()
                self.policy.restore(snap)
                while self.reference.n_steps > ref_steps:
                    self.reference.step_back()
            raise
        return st

    def step_back(self) -> LabStep:
        """Undo the last lab step exactly: both runs and the policy's own state (scores, evictions,
        quantized rows) go back, so stepping again gives the same numbers. Returns the undone step."""
        if not self.history:
            raise InspectorError("nothing to step back: the lab is at its prompt (no lab step has run)")
        last, target = self.history[-1], len(self.history) - 1
        with interrupts_deferred():
            # steps the run took outside the lab since (the window's) go too; the event handler does the rest
            while self.run.n_steps > target:
                self.run.step_back()
        return last

    def _both_step(self, i: int, ref_steps: int):
        """Step the reference (unless it is already ahead) and the policy run: (reference step, run step).

        The two are independent (teacher-forced, the run is fed the token the reference chose one
        step earlier), so where their caches allow they step as one batch of two (``PairStepper``).
        Nothing is undone here: the caller rolls both back on any error.
        """
        try:
            if ref_steps > i:
                return self.reference.steps_done[i], self.run.step()
            if self._pair is not None and self._pair.ready():
                try:
                    return self._pair.step()
                except Unpairable:
                    self._pair = None  # this model's attention takes per-row arguments: one run at a time
                    self.policy.restore(self._states[-1][1])  # layers before the refusal may have scored
            ref = self.reference.step()
            return ref, self.run.step()
        except StepFailed as e:
            # a policy's own error (a scoring function that raised) is the user's to fix: say it plainly
            if isinstance(e.__cause__, InspectorError):
                raise e.__cause__ from None
            raise

    def steps(self, n: int) -> Iterator[LabStep]:
        for _ in range(int(n)):
            if self.finished:
                return
            yield self.step()

    def run_steps(self, n: int) -> list[LabStep]:
        return list(self.steps(n))

    # ------------------------------------------------------------------ measures
    def _measure(self, ref, got, own: int) -> LabStep:
        lm, t = self.lm, self.run.cache_length
        p = t - 1
        same = self.reference.tokens[:t] == self.run.tokens[:t]
        # free-running runs that parted attend over different texts: no mass to compare (NaN)
        lost = (
            np.zeros((lm.n_layers, lm.n_heads), dtype=np.float64)
            if same
            else np.full((lm.n_layers, lm.n_heads), np.nan)
        )
        evicted_now = []
        for layer in range(lm.n_layers):
            ev = self.policy.evicted_rows(layer, p, t, t, lm.n_heads)  # (H, 1, T) what the last query missed
            if ev is not None and same:
                # the reference's own row p (a shared reference may be further on: later keys are causal zeros)
                probs = self.reference.attention_rows(layer, p, p + 1)[:, :, :t]  # (H, 1, T)
                lost[layer] = (probs * ev).sum((1, 2)).double().numpy()
            evicted_now.append(int(self.policy.evicted(layer, t).sum()))
        return LabStep(
            index=ref.index, position=ref.position, reference_token=ref.token_id, policy_token=own,
            fed_token=self.run.tokens[-1], kl=kl_divergence(ref.logits, got.logits),
            agree=int(torch.argmax(ref.logits)) == int(torch.argmax(got.logits)),
            bytes_policy=[self.policy.cache_bytes(i, t) for i in range(lm.n_layers)],
            # a shared reference may be further on: its bytes when it was where the run is
            bytes_full=[self.reference.kv_cache_bytes(i, length=t) for i in range(lm.n_layers)],
            lost_mass=lost, evicted_now=evicted_now, reference_label=self.reference.label(ref.token_id),
            policy_label=self.run.label(own),
            bytes_kept=[self.reference.kv_kept_bytes(i, length=t) for i in range(lm.n_layers)],
            **self._paged(t),
        )  # fmt: skip

    def _paged(self, t: int) -> dict:
        page = getattr(self.policy, "page", 1)
        paged = [self.policy.paged_bytes(i, t) for i in range(self.lm.n_layers)]
        if any(b is None for b in paged):
            return {"page": page}
        full = [self.policy.full_bytes(i, t, page) for i in range(self.lm.n_layers)]
        return {"bytes_paged": paged, "bytes_full_paged": full, "page": page}

    def evicted(self, layer: int) -> np.ndarray:
        """(Hkv, T) bool: the cache rows the policy no longer holds, per KV head."""
        layer = self.run.check_layer(layer)
        return self.policy.evicted(layer, self.run.cache_length).numpy()

    def row_error(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Per KV head and row, relative L2 error of what attention read vs the full-precision entry.

        Returns (keys (Hkv, T), values (Hkv, T)) float32; 0 for rows held in full precision.
        """
        return row_error(self.run, layer)

    def probe(self, progress=None) -> PrivacyResult:
        """The cache probe on layer 0 of the policy's cache, as an attacker holding it would see it.

        Evicted rows are gone (zeros in the K/V handed to the probe); quantized rows are their
        dequantized values. A prompt position counts as recovered when layer 0 still holds it in
        some KV head and the probe names the right token.
        """
        from ..probe import probe_cache

        n = self.run.prompt_length
        if self.run.cache_length < n:
            raise InspectorError("nothing cached yet: run a step first")
        held = ~self.policy.evicted(0, self.run.cache_length)[:, :n]  # (Hkv, P)
        k = self.run.keys(0)[:, :n].detach().float().clone()  # (Hkv, P, d)
        v = self.run.values(0)[:, :n].detach().float().clone()
        k[~held], v[~held] = 0.0, 0.0
        res = probe_cache(self.lm, {0: (k.to(self.lm.dtype), v.to(self.lm.dtype))}, 0,
                          true_tokens=self.run.prompt_ids, progress=progress)  # fmt: skip
        some = held.any(0)  # (P,)
        positions = res.layer(0).positions
        recovered = sum(1 for p in positions if p.correct and bool(some[p.position]))
        return PrivacyResult(n, int(some.sum()), recovered, res.layer(0).text, positions)

    def summary(self) -> dict:
        h = self.history
        return {
            "policy": self.policy.describe(),
            "steps": len(h),
            "free_running": self.free_running,
            "mean_kl": float(np.mean([s.kl for s in h])) if h else 0.0,
            "max_kl": float(max((s.kl for s in h), default=0.0)),
            "agreement": float(np.mean([s.agree for s in h])) if h else 1.0,
            "first_divergence": self.first_divergence,
            "parted_at": self.parted_at if self.free_running else None,
            "bytes_policy": sum(h[-1].bytes_policy) if h else 0,
            "bytes_full": sum(h[-1].bytes_full) if h else 0,
            "bytes_kept": sum(h[-1].bytes_kept) if h else 0,
            "page": getattr(self.policy, "page", 1),
            "bytes_paged": sum(h[-1].bytes_paged) if h and h[-1].bytes_paged is not None else None,
            "bytes_full_paged": sum(h[-1].bytes_full_paged) if h and h[-1].bytes_full_paged is not None else None,
            "settings": self.policy.settings(),
            "reference_text": self.reference.generated_text,
            "policy_text": self.run.generated_text,
        }
