"""Beam search one step at a time, the same search as transformers' ``generate(num_beams=...)``.

``BeamSearch`` ports transformers 5.x ``GenerationMixin._beam_search`` for one prompt (batch 1)
operation for operation: the same top-k calls on the same tensors, the same ``-1e9`` penalties
added in the same order. That is the only way to get the same tokens: ties between candidates
(and the ``-1e9 + x`` scores of dummy beams, which round to ``-1e9``) are broken by ``torch.topk``,
so any reformulation, however equivalent on paper, can pick a different sequence.

How HF's search works, and so ours:

- every step, each of the ``num_beams`` running beams proposes every token; the best
  ``K = max(2, 1 + n_eos) * num_beams`` continuations by cumulative log-probability are kept;
- a continuation that hits a stop (an EOS token, or ``max_length``) and ranks in the top
  ``num_beams`` of those K becomes a candidate hypothesis, scored by ``sum_logprobs /
  generated_length ** length_penalty`` (generated length counts the new tokens, EOS included,
  not the prompt); the ``num_beams`` best hypotheses so far are kept;
- the best ``num_beams`` continuations that did not stop become the next running beams;
- the loop ends when no running beam can still beat the worst kept hypothesis (a heuristic
  that depends on ``early_stopping``), when ``early_stopping=True`` and ``num_beams`` hypotheses
  exist, or when every continuation hit a stop;
- the ``num_return_sequences`` best hypotheses are returned, cut to the longest of them and
  padded with the pad token (``pad_token_id``, else the first EOS).

``num_beams=1`` is greedy decoding in ``generate`` (it never runs beam search), so it is greedy
here too; ``generate`` gives no ``sequences_scores`` then and ours are computed the beam way.

Logits processors configured in the model's ``generation_config`` (repetition penalty,
no-repeat n-grams, ...) are not applied; ``BeamSearch.unmirrored`` names any that ``generate``
would apply so front ends can say so.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .. import decoding, validate
from ..errors import InspectorError, check_index
from ..forward import Run, crop_cache, forward_with_rollback, interrupts_deferred
from ..models import LoadedModel
from ..step import Step, top_entries
from ..tokens import token_label
from . import tree as beam_tree
from .tree import BeamNode, BeamResult, BeamStep, Hypothesis
from .view import BeamView, _Rows

_NEG = -1.0e9  # HF's "impossible" score; the same constant, so rounding is the same
_DEFAULT = object()

# generation_config fields that make generate() add a logits processor to beam search
_PROCESSOR_FIELDS = {
    "sequence_bias": lambda v: v is not None,
    "encoder_repetition_penalty": lambda v: v is not None and v != 1.0,
    "repetition_penalty": lambda v: v is not None and v != 1.0,
    "no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "encoder_no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "bad_words_ids": lambda v: v is not None,
    "min_length": lambda v: v is not None and v > 0,
    "min_new_tokens": lambda v: v is not None and v > 0,
    "forced_bos_token_id": lambda v: v is not None,
    "forced_eos_token_id": lambda v: v is not None,
    "remove_invalid_values": lambda v: v is True,
    "exponential_decay_length_penalty": lambda v: v is not None,
    "suppress_tokens": lambda v: v is not None,
    "begin_suppress_tokens": lambda v: v is not None,
    "guidance_scale": lambda v: v is not None and v != 1,
    "renormalize_logits": lambda v: v is True,
}


# ---------------------------------------------------------------------------------------------
# the search


def resolve_max_length(prompt_length: int, context_length: int, max_length, max_new_tokens) -> int:
    """The total length (prompt included) generation may reach, from exactly one of the two limits."""
    if (max_length is None) == (max_new_tokens is None):
        raise InspectorError("give exactly one of max_length or max_new_tokens")
    if max_new_tokens is not None:
        total = prompt_length + validate.integer("max_new_tokens", max_new_tokens, 1)
    else:
        total = validate.integer("max_length", max_length, 1)
        if total <= prompt_length:
            raise InspectorError(
                f"max_length {total} leaves no room to generate: the prompt is {prompt_length} tokens; "
                "raise it or use max_new_tokens"
            )
    if total > context_length:
        raise InspectorError(
            f"generation would reach {total} tokens; the model's context is {context_length}; lower the limit"
        )
    return total


class BeamSearch(Run):
    """Step a beam search, one token per running beam per step, recording every beam's attention.

    ``BeamSearch(lm, prompt, num_beams=2, num_return_sequences=1, max_length=None,
    max_new_tokens=None, length_penalty=1.0, early_stopping=False)``; give exactly one of
    ``max_length`` (prompt included) or ``max_new_tokens``. ``eos_token_id`` and ``pad_token_id``
    default to the model's generation config, as in ``generate``.
    """

    def __init__(
        self,
        lm: LoadedModel,
        prompt: str = "",
        num_beams: int = 2,
        num_return_sequences: int = 1,
        max_length: int | None = None,
        max_new_tokens: int | None = None,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        *,
        prompt_ids: list[int] | None = None,
        eos_token_id=_DEFAULT,
        pad_token_id=_DEFAULT,
    ):
        self.lm = lm
        self.num_beams = validate.integer("num_beams", num_beams, 1)
        self.num_return_sequences = validate.integer("num_return_sequences", num_return_sequences, 1)
        if self.num_return_sequences > self.num_beams:
            raise InspectorError(
                f"num_return_sequences ({self.num_return_sequences}) cannot exceed num_beams ({self.num_beams})"
            )
        self.length_penalty = validate.length_penalty(length_penalty, lm.context_length)
        self.early_stopping = validate.early_stopping(early_stopping)
        self.prompt_ids = validate.prompt_ids(lm, prompt, prompt_ids)
        self.prompt = prompt if prompt_ids is None else lm.tokenizer.decode(self.prompt_ids)
        self.max_length = resolve_max_length(len(self.prompt_ids), lm.context_length, max_length, max_new_tokens)
        validate.beams(lm, self.num_beams, self.max_length, len(self.prompt_ids))

        gc = getattr(lm.model, "generation_config", None)
        if eos_token_id is _DEFAULT:
            eos_token_id = gc.eos_token_id if gc is not None else list(lm.eos_token_ids) or None
        if pad_token_id is _DEFAULT:
            pad_token_id = gc.pad_token_id if gc is not None else None
        eos = [] if eos_token_id is None else [int(e) for e in np.atleast_1d(np.asarray(eos_token_id)).tolist()]
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        if pad_token_id is None and eos:
            pad_token_id = eos[0]
        self.pad_token_id = None if pad_token_id is None else int(pad_token_id)
        # generate's fill value: `pad or eos[0] if eos is not None else -1`, a pad id of 0 included
        self.fill_token_id = (self.pad_token_id or eos[0]) if eos else -1
        self.unmirrored = [n for n, bad in _PROCESSOR_FIELDS.items() if gc is not None and bad(getattr(gc, n, None))]

        dev = lm.device
        nb, p, ml = self.num_beams, len(self.prompt_ids), self.max_length
        self.device = dev
        self.greedy = nb == 1
        self._beams_to_keep = max(2, 1 + len(eos)) * nb
        self._top_num_beam_mask = torch.cat(
            (torch.ones(nb, dtype=torch.bool), torch.zeros(self._beams_to_keep - nb, dtype=torch.bool))
        ).to(dev)
        self._eos_t = torch.tensor(eos, dtype=torch.long, device=dev) if eos else None
        prompt_t = torch.tensor(self.prompt_ids, dtype=torch.long, device=dev)
        # the state of HF's loop, batch size 1 kept as a dimension so the ops are literally the same
        self._running_sequences = torch.full((1, nb, ml), self.fill_token_id, dtype=torch.int64, device=dev)
        self._running_sequences[:, :, :p] = prompt_t
        self._sequences = self._running_sequences.detach().clone()
        self._running_beam_scores = torch.zeros((1, nb), dtype=torch.float, device=dev)
        self._running_beam_scores[:, 1:] = _NEG
        self._beam_scores = torch.full((1, nb), _NEG, dtype=torch.float, device=dev)
        self._is_sent_finished = torch.zeros((1, nb), dtype=torch.bool, device=dev)
        self._is_early_stop_heuristic_unsatisfied = torch.ones((1, 1), dtype=torch.bool, device=dev)
        self._next_token_hits_stopping_criteria = torch.zeros((1, nb), dtype=torch.bool, device=dev)
        self._running_beam_indices = torch.full((1, nb, ml - p), -1, dtype=torch.int32, device=dev)
        self._beam_indices = self._running_beam_indices.detach().clone()
        self.cur_len = p
        self.done = False

        super().__init__(lm)  # the cache, the records, no step yet
        root_text = "".join(token_label(lm.tokenizer, i) for i in self.prompt_ids)
        self.nodes: list[BeamNode] = [BeamNode(0, None, -1, None, root_text, 0.0, 0.0, fate="beam", status="alive")]
        self._row_nodes: list[int] = [0] * nb  # tree node at the end of each running beam
        self._slot_nodes: list[int | None] = [None] * nb  # tree node of each kept hypothesis (None: empty)
        self._slot_rows: list[_Rows | None] = [None] * nb  # their records

    # ------------------------------------------------------------------ state
    @property
    def ended(self) -> bool:
        return self.done

    @property
    def n_steps(self) -> int:
        return len(self.steps_done)

    @property
    def current(self) -> BeamStep | None:
        return self.steps_done[-1] if self.steps_done else None

    @property
    def beams(self) -> list[list[int]]:
        """Token ids of each running beam, prompt included (the last token not yet fed)."""
        return self._running_sequences[0, :, : self.cur_len].tolist()

    @property
    def hypotheses(self) -> list[Hypothesis]:
        """The kept finished hypotheses, best first."""
        return [self._hypothesis(j) for j, node in enumerate(self._finished_slots()) if node is not None]

    def _finished_slots(self) -> list[int | None]:
        """The tree node of each hypothesis slot holding a finished hypothesis, else None."""
        return [
            n if n is not None and bool(self._is_sent_finished[0, j]) else None for j, n in enumerate(self._slot_nodes)
        ]

    def _hypothesis(self, slot: int) -> Hypothesis:
        node_id = self._slot_nodes[slot]
        assert node_id is not None, f"hypothesis slot {slot} is empty"
        n = self.nodes[node_id]
        length = len(self.prompt_ids) + n.step + 1
        toks = self._sequences[0, slot, :length].tolist()
        return Hypothesis(n.id, toks, float(self._beam_scores[0, slot]), n.score, n.step)

    def _cache_slots(self, layer: int | None) -> list[tuple[int, object]]:
        if layer is None:
            return list(enumerate(self.cache.layers))
        i = check_index(layer, self.lm.n_layers, "layer")
        # a KV-sharing layer keeps no cache of its own (and may have no slot in it)
        return [(i, self.cache.layers[i])] if i < len(self.cache.layers) and self.lm.cache_layer(i) == i else []

    def kv_cache_bytes(self, layer: int | None = None) -> int:
        """Bytes the model's own KV cache would hold now, every beam together: on a sliding-window or
        chunked layer only its window (the search's cache keeps every position, ``kv_kept_bytes``)."""
        lay = self.lm.kv_layout
        total = 0
        for i, cl in self._cache_slots(layer):
            n, held = _slot_bytes(cl)
            lk = None if lay is None or i >= len(lay.layers) else lay.layers[i]
            # every position takes the same bytes: the window's share of the real tensors
            total += held if lk is None or n == 0 else held // n * lk.held(n)
        return total

    def kv_kept_bytes(self, layer: int | None = None) -> int:
        """Bytes the search's cache really holds now, every beam together and every position."""
        return sum(_slot_bytes(cl)[1] for _, cl in self._cache_slots(layer))

    # ------------------------------------------------------------------ stepping
    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` (num_beams, n) after the cache; logits of the last position (num_beams, V) float32."""
        return forward_with_rollback(
            self.lm, self.cache, self.recorder, ids, 1,
            # as generate copies them: float32, on the model's device
            lambda logits: logits[:, -1, :].to(copy=True, dtype=torch.float32, device=self.device),  # (B, V)
            "out of memory: try fewer beams, --device cpu or a smaller dtype",
            "the search is back at its last good step",
        )  # fmt: skip

    def step(self) -> BeamStep:
        """Grow every running beam by one token and update the kept hypotheses."""
        if self.done:
            raise InspectorError("beam search has finished; read result() or start a new search")
        t0 = time.perf_counter()
        p = len(self.prompt_ids)
        cur = self.cur_len
        if cur == p:
            ids = self._running_sequences[0, :, :p]  # (B, P): the prompt in every row, as generate expands it
        else:
            ids = self._running_sequences[0, :, cur - 1 : cur]  # (B, 1)
        start = self.cache.get_seq_length()
        updating = False
        try:
            logits = self._forward(ids)  # (B, V)
            # the update after the forward reorders the cache and the beams: quick, and never left half done
            with interrupts_deferred():
                updating = True
                parent_scores = self._running_beam_scores[0].tolist()
                log_probs = torch.nn.functional.log_softmax(logits, dim=-1)  # (B, V)
                if self.greedy:
                    st = self._greedy_step(logits, log_probs)
                else:
                    st = self._beam_step(log_probs)
                st.time_s = time.perf_counter() - t0
                st.logits = logits.detach().to("cpu")
                st.parent_scores = parent_scores
                self.steps_done.append(st)
        except BaseException:
            if not updating:  # Ctrl+C between the forward and the update: the cache grew alone
                with interrupts_deferred():
                    crop_cache(self.cache, start)
                    self.recorder.crop(start)
            raise
        self._emit("beam_step", st)
        return st

    def _candidate_nodes(self, log_probs, parents, tokens, scores, hits, step) -> list[BeamNode]:
        """The step's kept continuations as new tree nodes (ids follow the nodes so far), best first."""
        first = len(self.nodes)
        self.nodes += [
            BeamNode(first + rank, parent=self._row_nodes[b], step=step, token_id=tok, text=token_label(self.lm.tokenizer, tok),
                     logprob=float(log_probs[b, tok]), score=sc, rank=rank, parent_beam=b, stopped=hit)
            for rank, (b, tok, sc, hit) in enumerate(zip(parents, tokens, scores, hits))
        ]  # fmt: skip
        return self.nodes[first:]

    def _row_records(self, row: int, length: int, clone: bool) -> _Rows:
        rec, nl = self.recorder, self.lm.n_layers
        lay = self.lm.kv_layout
        att = range(nl) if lay is None else lay.attention_layers  # a hybrid's state-space layers record nothing
        q: list[torch.Tensor | None] = [None] * nl
        out: list[torch.Tensor | None] = [None] * nl
        k: list[torch.Tensor | None] = [None] * nl
        v: list[torch.Tensor | None] = [None] * nl
        for i in att:
            q[i] = rec.q[i].view(length)[row]  # (H, T, d)
            out[i] = rec.out[i].view(length)[row]
            k[i], v[i] = self._kv_rows(i, length, row)  # (H_kv, T, d)
        bias = [rec.score_bias(i, length, row) for i in range(nl)]  # None for most models
        # this row's own masks where the model masks per row and head (doge's top-k); usually none
        masks = [{p: m[row].clone() for p, m in rec.mask_rows[i].items() if m.dim() == 3 and p < length}
                 for i in range(nl)]  # fmt: skip
        if clone:
            # a finished hypothesis outlives its row, which the next reorder hands to another beam
            q, out, k, v = ([None if t is None else t.detach().clone() for t in ts] for ts in (q, out, k, v))
            bias = [None if b is None else b.cloned() for b in bias]
        return _Rows(q, out, k, v, bias, masks)

    def _greedy_step(self, logits: torch.Tensor, log_probs: torch.Tensor) -> BeamStep:
        # generate's greedy decoding: the argmax of the (unprocessed) logits, stop at EOS or max_length
        p, cur, step = len(self.prompt_ids), self.cur_len, len(self.steps_done)
        tok = int(torch.argmax(logits[0], dim=-1))
        hit = (tok in self.eos_token_ids) or cur + 1 >= self.max_length
        lp = float(log_probs[0, tok])
        score = float(self._running_beam_scores[0, 0]) + lp
        # show the runner-up too, so the tree has the road not taken
        top = torch.topk(log_probs[0], k=min(2, log_probs.shape[-1])).indices.tolist()
        others = [t for t in top if t != tok][:1]
        toks = [tok, *others]
        scores = [score] + [float(self._running_beam_scores[0, 0] + log_probs[0, t]) for t in others]
        hits = [hit] + [(t in self.eos_token_ids) or cur + 1 >= self.max_length for t in others]
        cands = self._candidate_nodes(log_probs, [0] * len(toks), toks, scores, hits, step)
        chosen = cands[0]
        self._running_sequences[0, 0, cur] = tok
        self._running_beam_indices[0, 0, cur - p] = 0
        self._running_beam_scores[0, 0] = score
        if hit:
            gen = cur + 1 - p
            chosen.normalized = score / (gen**self.length_penalty)
            chosen.fate = "finished"
            self._sequences = self._running_sequences.clone()
            self._beam_indices = self._running_beam_indices.clone()
            self._beam_scores[0, 0] = chosen.normalized
            self._is_sent_finished[0, 0] = True
            self._slot_nodes[0] = chosen.id
            self._slot_rows[0] = self._row_records(0, cur, clone=True)
            self.done = True
        else:
            chosen.fate, chosen.beam = "beam", 0
        for c in cands[1:]:
            if c.stopped:
                c.normalized = c.score / ((cur + 1 - p) ** self.length_penalty)
        self._row_nodes[0] = chosen.id
        self.cur_len = cur + 1
        self._refresh_status()
        return BeamStep(step, cur, cands, [chosen.id], [score], self.hypotheses, self.done)

    def _beam_step(self, log_probs: torch.Tensor) -> BeamStep:
        """One iteration of HF's ``_beam_search`` loop body (b. to g.), batch size 1."""
        nb, k_keep, p, cur = self.num_beams, self._beams_to_keep, len(self.prompt_ids), self.cur_len
        lp, es, ml = self.length_penalty, self.early_stopping, self.max_length
        step = len(self.steps_done)
        vocab = log_probs.shape[-1]

        # b. accumulate
        acc = log_probs[None] + self._running_beam_scores[:, :, None]  # (1, B, V)
        acc = torch.reshape(acc, (1, -1))  # (1, B*V)

        # c. top-K continuations
        topk_log_probs, topk_indices = torch.topk(acc, k=k_keep)  # (1, K)
        topk_current_beam_indices = topk_indices // vocab
        topk_running_beam_indices = _gather_beams(self._running_beam_indices, topk_current_beam_indices)
        topk_running_sequences = _gather_beams(self._running_sequences, topk_current_beam_indices)
        topk_ids = topk_indices % vocab
        topk_running_sequences[:, :, cur] = topk_ids
        topk_running_beam_indices[:, :, cur - p] = topk_current_beam_indices  # batch offset is 0

        # d. which continuations stop: EOS or max_length (generate's stopping criteria)
        hits = torch.full((1, k_keep), cur + 1 >= ml, dtype=torch.bool, device=self.device)
        if self._eos_t is not None:
            hits = hits | torch.isin(topk_ids, self._eos_t)
        self._next_token_hits_stopping_criteria = hits

        # e. the next running beams: the best K continuations that did not stop
        topk_running_log_probs = topk_log_probs + hits.to(torch.float32) * _NEG
        next_topk_indices = torch.topk(topk_running_log_probs, k=nb)[1]  # (1, B)
        self._running_sequences = _gather_beams(topk_running_sequences, next_topk_indices)
        self._running_beam_scores = _gather_beams(topk_running_log_probs, next_topk_indices)
        self._running_beam_indices = _gather_beams(topk_running_beam_indices, next_topk_indices)

        # f. kept hypotheses: merge the newly stopped ones among the top num_beams
        did_top_num_beams_just_finished = hits & self._top_num_beam_mask[None, :]
        fin_log_probs = topk_log_probs / ((cur + 1 - p) ** lp)
        beams_in_batch_are_full = torch.all(self._is_sent_finished, dim=-1, keepdim=True) & (es is True)
        fin_log_probs += beams_in_batch_are_full.to(torch.float32) * _NEG
        fin_log_probs += (~self._is_early_stop_heuristic_unsatisfied).to(torch.float32) * _NEG
        fin_log_probs += (~did_top_num_beams_just_finished) * _NEG
        merged_sequences = torch.cat((self._sequences, topk_running_sequences), dim=1)
        merged_scores = torch.cat((self._beam_scores, fin_log_probs), dim=1)
        merged_beam_indices = torch.cat((self._beam_indices, topk_running_beam_indices), dim=1)
        merged_is_sent_finished = torch.cat((self._is_sent_finished, did_top_num_beams_just_finished), dim=1)
        topk_merged_indices = torch.topk(merged_scores, k=nb)[1]  # (1, B)
        self._sequences = _gather_beams(merged_sequences, topk_merged_indices)
        self._beam_scores = _gather_beams(merged_scores, topk_merged_indices)
        self._beam_indices = _gather_beams(merged_beam_indices, topk_merged_indices)
        self._is_sent_finished = _gather_beams(merged_is_sent_finished, topk_merged_indices)

        # what happened, for the views (read before the cache is reordered: rows are still the parents')
        parents = topk_current_beam_indices[0].tolist()
        cands = self._candidate_nodes(
            log_probs, parents, topk_ids[0].tolist(), topk_log_probs[0].tolist(), hits[0].tolist(), step
        )
        norm = (topk_log_probs[0] / ((cur + 1 - p) ** lp)).tolist()
        did = did_top_num_beams_just_finished[0].tolist()
        for c, n in zip(cands, norm):
            if c.stopped:
                c.normalized = n
                c.fate = "dropped"
        nxt = next_topk_indices[0].tolist()
        for row, kk in enumerate(nxt):
            if not cands[kk].stopped:
                cands[kk].fate, cands[kk].beam = "beam", row
        merged_nodes = self._slot_nodes + [c.id if did[kk] else None for kk, c in enumerate(cands)]
        merged_rows: list[_Rows | None] = list(self._slot_rows) + [None] * k_keep
        sel = topk_merged_indices[0].tolist()
        for idx in sel:
            if idx >= nb and did[idx - nb]:
                c = cands[idx - nb]
                c.fate = "finished"
                merged_rows[idx] = self._row_records(c.parent_beam, cur, clone=True)
        self._slot_nodes = [merged_nodes[i] for i in sel]
        self._slot_rows = [merged_rows[i] for i in sel]
        self._row_nodes = [cands[kk].id for kk in nxt]

        # g. reorder the cache (and our records) to the surviving beams, then the stopping condition
        beam_idx = self._running_beam_indices[0, :, cur - p].to(torch.long)  # (B,)
        self.cache.reorder_cache(beam_idx)
        self.recorder.reorder(beam_idx)
        self.cur_len = cur = cur + 1
        self._is_early_stop_heuristic_unsatisfied = self._check_early_stop_heuristic(cur)
        improvement_possible = torch.any(self._is_early_stop_heuristic_unsatisfied)
        exists_open_beam = ~(torch.all(self._is_sent_finished) & (es is True))
        valid_continuations = ~torch.all(self._next_token_hits_stopping_criteria)
        self.done = not bool(improvement_possible & exists_open_beam & valid_continuations)

        self._refresh_status()
        return BeamStep(
            step, cur - 1, cands, list(self._row_nodes), self._running_beam_scores[0].tolist(), self.hypotheses,
            self.done,
        )  # fmt: skip

    def _check_early_stop_heuristic(self, cur_len: int) -> torch.Tensor:
        p, lp = len(self.prompt_ids), self.length_penalty
        if self.early_stopping == "never" and lp > 0.0:
            best_hypothetical_length = self.max_length - p
        else:
            best_hypothetical_length = cur_len - p
        best_possible_running_score = self._running_beam_scores[:, :1] / (best_hypothetical_length**lp)
        worst_finished_score = torch.where(
            self._is_sent_finished, torch.min(self._beam_scores, dim=1, keepdim=True)[0], -1.0e9
        )
        return self._is_early_stop_heuristic_unsatisfied & torch.any(
            best_possible_running_score > worst_finished_score, dim=-1, keepdim=True
        )

    def run(self, n: int | None = None) -> list[BeamStep]:
        """Run ``n`` steps, or to the end."""
        return list(self.steps(n))

    # ------------------------------------------------------------------ results
    def result(self) -> BeamResult:
        """generate's output: the best ``num_return_sequences`` hypotheses, padded as generate pads."""
        if not self.done:
            raise InspectorError("beam search has not finished; run() it first")
        nrs, p = self.num_return_sequences, len(self.prompt_ids)
        sequences = self._sequences[0, :nrs, :]  # (R, max_length)
        scores = self._beam_scores[0, :nrs]
        beam_indices = self._beam_indices[0, :nrs, :]
        # generate crops to the longest returned hypothesis, counted by its recorded beam indices
        max_generated_length = int(((beam_indices + 1).bool()).sum(dim=1).max())
        sequences = sequences[:, : p + max_generated_length]
        hyps = [self._hypothesis(j) for j in range(nrs)]
        return BeamResult(sequences.tolist(), scores.tolist(), [len(h.token_ids) for h in hyps], hyps)

    # ------------------------------------------------------------------ views
    def beam_view(self, i: int) -> BeamView:
        """Running beam ``i`` now, with the Session's accessors."""
        i = check_index(i, self.num_beams, "beam")
        length = self.cur_len - 1 if self.steps_done else 0
        rows = self._row_records(i, length, clone=False) if self.steps_done else None
        tokens = self._running_sequences[0, i, : self.cur_len].tolist()
        return BeamView(self, rows, length, tokens, self._row_nodes[i], f"beam {i + 1}")

    def hypothesis_view(self, j: int) -> BeamView:
        """Kept hypothesis ``j`` (0 = best; after the search, the first num_return_sequences are returned)."""
        j = check_index(j, self.num_beams, "hypothesis")
        hyps = self.hypotheses
        if j >= len(hyps):
            raise InspectorError(f"only {len(hyps)} finished hypotheses so far; no hypothesis {j}")
        h = hyps[j]
        return BeamView(self, self._slot_rows[j], len(h.token_ids) - 1, h.token_ids, h.node, f"hypothesis {j + 1}")

    def result_view(self, r: int) -> BeamView:
        """Returned sequence ``r`` (as ``result().sequences[r]``, without padding)."""
        if not self.done:
            raise InspectorError("beam search has not finished; run() it first")
        check_index(r, self.num_return_sequences, "returned sequence")
        return self.hypothesis_view(r)

    def _path_steps(self, node: int) -> list[Step]:
        """Session-style steps along the path to ``node`` (what each beam saw when it chose)."""
        tok = self.lm.tokenizer
        p = len(self.prompt_ids)
        steps = []
        for n in beam_tree.path(self.nodes, node):
            logits = self.steps_done[n.step].logits[n.parent_beam]  # (V,)
            probs = torch.softmax(logits, dim=-1)
            top = top_entries(probs, logits, lambda i: token_label(tok, i))
            tid = n.token_id
            assert tid is not None  # only the root has no token, and a path starts below it
            reason = None if not n.stopped else "eos" if tid in self.eos_token_ids else "length"
            steps.append(
                Step(n.step, p - 1 + n.step, tid, tok.decode([tid]), logits, probs, top,
                     decoding.entropy(probs), False, 0.0, reason, label=token_label(tok, tid))
            )  # fmt: skip
        return steps

    # ------------------------------------------------------------------ the tree
    def _refresh_status(self) -> None:
        running = [] if self.done else self._row_nodes
        beam_tree.refresh_status(
            self.nodes, running, self._finished_slots(), self.num_return_sequences if self.done else 0
        )

    def tree(self) -> list[BeamNode]:
        """Every token any beam proposed and kept among the K best, as nodes (0 = the prompt)."""
        return list(self.nodes)

    def tree_json(self) -> list[dict]:
        return [n.to_json() for n in self.nodes]


def _gather_beams(tensor: torch.Tensor, beam_indices: torch.Tensor) -> torch.Tensor:
    # HF's _gather_beams: take along the beam dimension
    while len(beam_indices.shape) < len(tensor.shape):
        beam_indices = beam_indices.unsqueeze(-1)
    return torch.take_along_dim(input=tensor, indices=beam_indices, dim=1)


def _slot_bytes(cl) -> tuple[int, int]:
    """(positions, bytes) of one cache layer's keys and values; (0, 0) where it holds none."""
    if not getattr(cl, "is_initialized", False) or getattr(cl, "keys", None) is None:
        return 0, 0
    n = cl.keys.shape[-2] if cl.keys.dim() >= 2 else 0  # a lazy 1-D placeholder holds no position
    return n, sum(t.numel() * t.element_size() for t in (cl.keys, cl.values))
