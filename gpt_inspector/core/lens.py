"""Where the prediction forms, and which heads push it there, for the current step.

- **Logit lens:** the residual stream after every layer, at the current position only, through the
  model's own final norm and unembedding (and its final logit soft-cap, if any). The last layer's
  lens is the model's logits.
- **Direct logit attribution per head:** each head's attention output through its slice of the
  output projection, through the final norm with its scale *frozen at the value observed* on this
  position (the norm is linear once its statistics are fixed), projected on the unembedding row of
  the chosen token. What the heads do not explain (embeddings, MLPs, biases, the norm's offset) is
  reported as one remainder, so the parts add up to the chosen token's logit. Where a layer
  normalises its attention block's output before the residual (Gemma 2 / 3, OLMo 2, GLM-4), that
  norm's scale is frozen at the block's observed output as well.

The residual is recorded by forward hooks on the decoder layers during the session's own forward,
one vector per layer for the newest position (nothing T x D is kept). After a step back or on
another session, the current position is recomputed once, without touching the session.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import capture
from .errors import Cancelled, InspectorError
from .step import TopEntry, top_rows

_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm")
_OUT_PROJ = ("o_proj", "c_proj", "dense", "out_proj")
_SLICE = 4096  # vocabulary rows per slice of the unembedding: ~2 ms on GPT-2-small shapes


@dataclass(frozen=True)
class LensLayer:
    layer: int
    top: list[TopEntry]  # the lens distribution's best tokens
    prob: float  # the chosen token's probability through this layer's lens
    logit: float


@dataclass(frozen=True)
class LensResult:
    step: int
    position: int
    token_id: int
    label: str
    layers: list[LensLayer]
    # (L, H) each head's direct contribution to the chosen token's logit, norm scales frozen (the final
    # norm's, and the attention block's own output norm where there is one: Gemma 2's sandwich norms)
    attribution: np.ndarray | None = field(repr=False)
    remainder: float | None  # logit minus the heads' sum: embeddings, MLPs, biases, norm offset
    logit: float  # the model's logit for the chosen token (before any final soft-cap)
    note: str = ""

    def to_json(self) -> dict:
        return {
            "step": self.step, "position": self.position, "token_id": self.token_id, "token": self.label,
            "logit": self.logit,
            "layers": [{"layer": x.layer, "prob": x.prob, "logit": x.logit,
                        "top": [{"token_id": e.token_id, "token": e.label, "prob": e.prob} for e in x.top]}
                       for x in self.layers],
            "attribution": None if self.attribution is None else self.attribution.tolist(),
            "remainder": self.remainder, "note": self.note,
        }  # fmt: skip


# ---------------------------------------------------------------------------------------------- parts
def _parts(model) -> tuple:
    base = model.base_model
    layers = next((c for c in base.children() if isinstance(c, torch.nn.ModuleList)), None)
    norm = next((getattr(base, n) for n in _FINAL_NORMS if hasattr(base, n)), None)
    head = model.get_output_embeddings()
    if layers is None or norm is None or head is None:
        raise InspectorError(f"the logit lens does not know this architecture ({type(model).__name__})")
    return layers, norm, head


def _install_hooks(model) -> None:
    """Record each decoder layer's output at the newest position into the active recorder."""
    if getattr(model, "_gpt_inspector_lens", False):
        return
    layers, _, _ = _parts(model)
    n = len(layers)

    def hook(index):
        def record(_module, _inputs, output):
            rec = capture.current_recorder()
            if rec is None:
                return
            h = output[0] if isinstance(output, tuple) else output  # (B, n, D)
            # runs stepped as one batch (the KV lab's pair): each row is its own run's
            recs = rec.rows if isinstance(rec, capture.RowRecorders) else [rec]
            for r, one in enumerate(recs):
                rows = h if len(recs) == 1 else h[r : r + 1]  # (B, n, D)
                one.residual[index] = rows[:, -1].detach().to("cpu", torch.float32, copy=True)
                if index == n - 1:
                    one.residual_length = one.length  # the positions this residual belongs to

        return record

    for i, layer in enumerate(layers):
        layer.register_forward_hook(hook(i))
    model._gpt_inspector_lens = True


def enable(lm) -> None:
    """Start recording the residual stream for the lens (one vector per layer per forward)."""
    _install_hooks(lm.model)


# ---------------------------------------------------------------------------------------------- norm
def _norm_affine(norm: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The final norm at ``x`` as ``y = center(x) * gain + offset`` with its statistics frozen.

    Returns (gain (D,), offset (D,), centers). Checked against the norm itself, so an unknown
    norm is refused instead of being linearised wrongly.
    """
    w = getattr(norm, "weight", None)
    b = getattr(norm, "bias", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if w is None or eps is None:
        raise InspectorError(f"per-head attribution does not know the final norm {type(norm).__name__}")
    back, w_dtype = x.device, w.dtype
    w, x = w.detach().float(), x.to(w.device).float()  # checked where the norm lives, given back where x was
    if isinstance(norm, torch.nn.LayerNorm):
        scale = torch.sqrt(x.var(unbiased=False) + eps)
        gain, centers = w / scale, True
    else:  # RMS norms; Gemma's multiply by (1 + weight)
        scale = torch.sqrt((x * x).mean() + eps)
        gain, centers = (1.0 + w if type(norm).__name__.startswith("Gemma") else w) / scale, False
    offset = torch.zeros_like(x) if b is None else b.detach().float()
    with torch.no_grad():
        want = norm(x.to(w_dtype)).float()
    got = ((x - x.mean()) if centers else x) * gain + offset
    if not torch.allclose(got, want, atol=1e-4 * max(1.0, float(want.abs().max()))):
        raise InspectorError(f"per-head attribution cannot linearise the final norm {type(norm).__name__}")
    return gain.to(back), offset.to(back), centers


# ---------------------------------------------------------------------------------------------- the lens
def _residuals(session) -> torch.Tensor:
    """(L, D) float32: the residual after every layer at the current position."""
    lm = session.lm
    _install_hooks(lm.model)
    rec = session.recorder
    store = rec.residual
    L = lm.n_layers
    if len(store) != L or rec.residual_length != session.cache_length:
        # recompute the current position from scratch, with the session's mask and head edits
        store = capture.scratch_forward(lm, session.tokens[: session.cache_length], like=rec).residual
    return torch.stack([store[i][0] for i in range(L)])  # (L, D)


def _attn_out_norm(layer: Any) -> Any:
    """The norm a layer applies to its attention output before adding it to the residual, if any."""
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 2 / 3 sandwich norms
        return layer.post_attention_layernorm
    if hasattr(layer, "post_self_attn_layernorm"):  # GLM-4
        return layer.post_self_attn_layernorm
    if hasattr(layer, "post_attention_layernorm") and not hasattr(layer, "input_layernorm"):  # OLMo 2: norms after only
        return layer.post_attention_layernorm
    return None


def _out_bias(layer: torch.nn.Module, w: torch.Tensor) -> torch.Tensor:
    """(D,) the bias of the output projection ``w`` (H*d, D), or zeros beside it."""
    width = w.shape[1]
    for mod in layer.modules():
        for name in _OUT_PROJ:
            proj = getattr(mod, name, None)
            if proj is not None and getattr(proj, "bias", None) is not None and proj.bias.shape[-1] == width:
                return proj.bias.detach().float()  # (D,)
    return w.new_zeros(width)


def _out_proj(layer: torch.nn.Module) -> torch.Tensor | None:
    """The layer's attention output projection as (H*d, D), or None if it is not a plain one."""
    for mod in layer.modules():
        if getattr(mod, "layer_idx", None) is None and not hasattr(mod, "num_heads") and not hasattr(mod, "head_dim"):
            continue
        for name in _OUT_PROJ:
            proj = getattr(mod, name, None)
            if isinstance(proj, torch.nn.Linear):
                return proj.weight.detach().float().T  # (H*d, D)
            if proj is not None and type(proj).__name__ == "Conv1D":
                return proj.weight.detach().float()  # (H*d, D): GPT-2 multiplies x @ W
    return None


def _check(stop) -> None:
    if stop is not None and stop():
        raise Cancelled("the logit lens gave way to a newer command")


def _unembed(head, x: torch.Tensor, stop) -> torch.Tensor:
    """head(x) (n, V); a plain linear head as ``W @ x.T``, in slices of the vocabulary with ``stop``.

    ``W @ x.T`` rather than ``linear(x, W)``: for a few rows against a (V, D) matrix, MKL runs the
    first about twice as fast (the same dot products; the last bit may differ from one product of
    another shape, as HF's one-row product does anyway). The slices give every logit bit for bit as
    the whole product does, and let a window give the worker back to a step within a few
    milliseconds (raise Cancelled).
    """
    if type(head) is not torch.nn.Linear:
        return head(x)
    w, b = head.weight, head.bias  # (V, D), (V,)
    xt = x.T  # (D, n)
    step = w.shape[0] if stop is None else _SLICE
    out = []
    for v0 in range(0, w.shape[0], step):
        _check(stop)
        part = w[v0 : v0 + step] @ xt  # (slice, n)
        out.append(part if b is None else part + b[v0 : v0 + step, None])
    return (out[0] if len(out) == 1 else torch.cat(out)).T  # (n, V)


def lens(session, top_k: int = 5, stop=None) -> LensResult:
    """The logit lens and per-head attribution for the session's current step.

    ``stop``: a callable asked now and then; when it says True the computation ends with
    Cancelled (the window computes the lens while its worker is idle, and gives way to a step).
    """
    if getattr(session, "engine", None) is not None:  # the model is on a remote engine: it runs this code there
        return session.remote_lens(top_k)
    cur = session.current
    if cur is None:
        raise InspectorError("no step yet: run a step first")
    lm = session.lm
    model = lm.model
    layers, norm, head = _parts(model)
    resid = _residuals(session).to(lm.device)  # (L, D)
    if resid.dim() != 2:  # gemma3n's AltUp carries several residual streams per layer
        raise InspectorError(f"the logit lens reads one residual stream per layer; {lm.name} carries several (AltUp)")
    cap = getattr(model.config, "final_logit_softcapping", None)
    with torch.inference_mode():
        # the last layer's lens is the model's output: show the logits the model computed for this step
        # (ours would differ in the last bit only, from a matmul of another shape), and skip its unembedding
        logits = _unembed(head, norm(resid[:-1].to(lm.dtype)), stop).float()  # (L-1, V)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        logits = torch.cat([logits, cur.logits.float()[None].to(logits.device)])  # (L, V)
    _check(stop)  # what follows (top tokens, attribution) is another third of the time
    # every layer's best tokens in one top-k where the logits are, and only those copied back: on a
    # GPU the (L, V) matrix stays there, and on the CPU one batched top-k replaces one per layer
    probs = torch.softmax(logits, dim=-1)  # (L, V)
    tok = cur.token_id
    tops = top_rows(probs, logits, session.label, top_k)
    chosen_p, chosen_l = probs[:, tok].tolist(), logits[:, tok].tolist()  # (L,)
    rows = [LensLayer(i, tops[i], chosen_p[i], chosen_l[i]) for i in range(lm.n_layers)]

    note = "final-norm scale frozen at the value observed on this position"
    if any(_attn_out_norm(layer) is not None for layer in layers):
        note = "final-norm and attention-output-norm scales frozen at the values observed on this position"
    attribution, remainder = None, None
    # computed where the weights are (on a GPU, copying each output projection to the CPU cost more
    # than the whole attribution); each layer's (H,) comes back once, at the end
    u = head.weight.detach()[tok].float().to(resid.device)  # (D,) the chosen token's unembedding row, beside the gains
    logit = float(cur.logits[tok]) if not cap else float(head(norm(resid[-1:].to(lm.dtype))).float()[0, tok])
    try:
        gain, _, centers = _norm_affine(norm, resid[-1])
        shares = []
        pos = session.cache_length - 1
        z = gain * u  # (D,) what one unit of residual adds to the chosen logit, final norm frozen
        if centers:
            z = z - z.mean()  # centring is linear: (c - mean c) . z == c . (z - mean z)
        for i, layer in enumerate(layers):
            _check(stop)  # a step asked for waits at most one layer's share, not the whole attribution
            w = _out_proj(layer)
            if w is None:
                raise InspectorError("the attention output projection of this architecture is not a plain linear map")
            out = session.head_output_row(i, pos).to(w.device, torch.float32)  # (H, d)
            h, d = out.shape
            zi = z.to(w.device)
            post = _attn_out_norm(layer)
            if post is not None:
                # the block's output is normalised before the residual: freeze that norm's scale at the
                # block's observed output too, which makes each head's share linear again
                block = out.reshape(-1) @ w + _out_bias(layer, w)  # (D,) what the norm received
                g, _, cen = _norm_affine(post, block)
                zi = g * zi
                if cen:
                    zi = zi - zi.mean()
            # head h's write is out[h] @ w[h]; its share of the logit is that write . zi
            shares.append((out * (w @ zi).reshape(h, d)).double().sum(dim=-1))  # (H,)
        attr = torch.stack([x.cpu() for x in shares]).numpy()  # (L, H) float64
        attribution, remainder = attr, logit - float(attr.sum())
    except Cancelled:
        raise
    except InspectorError as e:
        note = f"no per-head attribution: {e}"
    return LensResult(cur.index, cur.position, tok, cur.label, rows, attribution, remainder,
                      logit if math.isfinite(logit) else float("nan"), note)  # fmt: skip
