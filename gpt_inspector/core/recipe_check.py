"""Check a session recipe whole before anything replays it (a saved file is input from outside),
and compact it, so a long session replays in as few model runs as give the very same state.

A hostile or damaged autosave must be refused in one line before a window or a model is touched,
not halfway through a replay (or never, when it asks for a billion steps). Only what the recipe
says about itself is checked here; what depends on the model (token ids below the vocabulary,
mask positions inside the context) is checked by the replay itself, which refuses as cleanly.
"""

from __future__ import annotations

import contextlib

from . import decoding, validate
from .chat import check_messages
from .edits import HeadEdit, MaskEdit
from .errors import InspectorError

RECIPE_FORMAT = "gpt-inspector-recipe/1"
# far beyond any real session (the step ops at most the context length, after step/back cycles
# collapse), and small enough that checking and replaying one cannot exhaust memory or time
MAX_OPS = 200_000
MAX_RECOMPUTES = 2_000  # mask and head edit ops left after compaction: each re-runs the whole sequence
# mask and head edit ops as written: a session of the old format kept every [edit, clear] cycle
MAX_EDIT_OPS = 40_000
MAX_IDS = 1_000_000  # prompt ids, tokens, a patch source's ids
MAX_EDITS = 100_000  # mask or head edits in one op
MAX_TEXT = 10_000_000
MAX_ID = 2**31 - 1


def _int(v, what: str, low: int = 0, high: int = MAX_ID) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise InspectorError(f"{what} must be an integer in [{low}, {high}], got {_short(v)}")
    return v


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _list(v, what: str, limit: int) -> list:
    if not isinstance(v, list):
        raise InspectorError(f"{what} must be a list, got {_short(v)}")
    if len(v) > limit:
        raise InspectorError(f"{what} has {len(v)} entries; at most {limit} are accepted")
    return v


def _ids(v, what: str) -> None:
    for i in _list(v, what, MAX_IDS):
        _int(i, f"{what} entries")


def _opt_int(d: dict, key: str, what: str) -> None:
    if d.get(key) is not None:
        _int(d[key], what)


def _decoding(d, what: str) -> None:
    """Settings as ``Decoding.to_json`` writes them (an op adds "op" and "redecide")."""
    if not isinstance(d, dict):
        raise InspectorError(f"{what} must be an object with temperature, top_k and top_p, got {_short(d)}")
    settings = {k: v for k, v in d.items() if k not in ("op", "redecide")}
    for k, v in settings.items():
        # numbers as JSON numbers: text that float() would take is not what a recipe writes
        if k in ("suppress_tokens", "bad_words_ids"):
            for w in _list(v, f"{what}: {k}", MAX_IDS):
                if k == "bad_words_ids":
                    _list(w, f"{what}: {k} entries", MAX_IDS)
        elif v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise InspectorError(f"{what}: {k} must be a number, got {_short(v)}")
    try:
        decoding.Decoding.from_json(settings)
    except InspectorError as e:
        raise InspectorError(f"{what}: {e}") from None


def _mask_edits(v, what: str) -> None:
    for e in _list(v, what, MAX_EDITS):
        if not isinstance(e, dict):
            raise InspectorError(f"{what} entries must be objects, got {_short(e)}")
        _int(e.get("query"), f"{what}: query")
        _int(e.get("key"), f"{what}: key")
        _opt_int(e, "layer", f"{what}: layer")
        _opt_int(e, "head", f"{what}: head")
        if not isinstance(e.get("blocked", True), bool):
            raise InspectorError(f"{what}: blocked must be true or false, got {_short(e.get('blocked'))}")


def _head_edits(v, what: str) -> None:
    for e in _list(v, what, MAX_EDITS):
        if not isinstance(e, dict):
            raise InspectorError(f"{what} entries must be objects, got {_short(e)}")
        _int(e.get("layer"), f"{what}: layer")
        _opt_int(e, "head", f"{what}: head")
        if e.get("patch_from") is not None:
            _ids(e["patch_from"], f"{what}: patch_from")


def _ops(ops) -> None:
    depth = recomputes = 0  # steps in force: a step back or a force needs one
    for n, op in enumerate(_list(ops, "ops", MAX_OPS)):
        where = f"ops[{n}]"
        if not isinstance(op, dict):
            raise InspectorError(f"{where} must be an object, got {_short(op)}")
        kind = op.get("op")
        if kind == "step":
            depth += 1
        elif kind == "step_back":
            if depth == 0:
                raise InspectorError(f"{where} steps back with no step taken")
            depth -= 1
        elif kind == "force":
            if depth == 0:
                raise InspectorError(f"{where} forces a token with no step taken")
            _int(op.get("token_id"), f"{where}: token_id")
        elif kind == "decoding":
            _decoding(op, where)
            if not isinstance(op.get("redecide", False), bool):
                raise InspectorError(f"{where}: redecide must be true or false, got {_short(op.get('redecide'))}")
        elif kind in ("mask", "heads"):
            recomputes += 1
            if recomputes > MAX_EDIT_OPS:
                raise InspectorError(f"more than {MAX_EDIT_OPS} mask or head edit operations")
            (_mask_edits if kind == "mask" else _head_edits)(op.get("edits"), f"{where}: edits")
        else:
            raise InspectorError(f"{where}: unknown recipe operation {_short(kind)}")


def _load(v) -> None:
    if v is None:
        return
    if not isinstance(v, dict):
        raise InspectorError(f"load must be an object, got {_short(v)}")
    for key in ("device", "dtype", "offload_folder"):
        if v.get(key) is not None and not isinstance(v[key], str):
            raise InspectorError(f"load: {key} must be text, got {_short(v[key])}")
    if v.get("device_map") is not None and not isinstance(v["device_map"], (str, dict)):
        raise InspectorError(f"load: device_map must be text or an object, got {_short(v['device_map'])}")
    if v.get("max_memory") is not None and not isinstance(v["max_memory"], (str, dict)):
        raise InspectorError(f"load: max_memory must be text or an object, got {_short(v['max_memory'])}")


def check_recipe(recipe) -> dict:
    """``recipe`` if it is a whole, well-formed session recipe; else InspectorError saying what is wrong."""
    if not isinstance(recipe, dict) or recipe.get("format") != RECIPE_FORMAT:
        raise InspectorError("not a gpt-inspector session recipe")
    for key in ("prompt", "prompt_ids", "seed", "initial_decoding", "ops"):
        if key not in recipe:
            raise InspectorError(f"the recipe has no {key!r}")
    if recipe.get("model") is not None and not isinstance(recipe["model"], str):
        raise InspectorError(f"model must be text, got {_short(recipe['model'])}")
    if not isinstance(recipe["prompt"], str) or len(recipe["prompt"]) > MAX_TEXT:
        raise InspectorError(f"prompt must be text of at most {MAX_TEXT} characters")
    validate.text(recipe["prompt"])
    _ids(recipe["prompt_ids"], "prompt_ids")
    if not recipe["prompt_ids"]:
        raise InspectorError("prompt_ids is empty")
    validate.seed(recipe["seed"])
    _decoding(recipe["initial_decoding"], "initial_decoding")
    _ops(recipe["ops"])
    # the fields repeated for readers: shown before the replay (the restore question, the controls)
    if "decoding" in recipe:
        _decoding(recipe["decoding"], "decoding")
    if "mask_edits" in recipe:
        _mask_edits(recipe["mask_edits"], "mask_edits")
    if "head_edits" in recipe:
        _head_edits(recipe["head_edits"], "head_edits")
    if "tokens" in recipe:
        _ids(recipe["tokens"], "tokens")
    if "forced" in recipe and not isinstance(recipe["forced"], dict):
        raise InspectorError(f"forced must be an object, got {_short(recipe['forced'])}")
    if "chat" in recipe:
        c = recipe["chat"]
        if not isinstance(c, dict) or not isinstance(c.get("add_generation_prompt"), bool):
            raise InspectorError('chat must be an object with "messages" and a true/false "add_generation_prompt"')
        check_messages(c.get("messages"))
    _load(recipe.get("load"))
    return recipe


# ------------------------------------------------------------------ compaction
# A recipe lists every change as it happened; replaying it whole repeats every model run, 314 s after
# a 10,000-cycle session. The rules below drop what a later change makes moot, and only where the
# shorter list leaves the very same numbers: a recompute runs from the earliest changed position in
# chunks, and a forward over other chunks rounds differently, so an edit is dropped only when a later
# one recomputes, from no later a position, everything it touched.

Shape = tuple[int, int, int, int]  # layers, heads, context, vocabulary: what an edit's scope expands to
WINDOW = 256  # ops a new edit looks back over: a peephole, so compacting stays linear
_NEVER = 1 << 62  # the reach of an edit that changes no position


def edit_shape(lm) -> Shape | None:
    """What compacting a recipe's edits needs to know of the model ``lm``; None where edits cannot
    recompute (a hybrid's state-space layers): its edit ops are then all kept, and refused as before."""
    layout = getattr(lm, "kv_layout", None)
    if layout is not None and layout.state_layers:
        return None
    return lm.n_layers, lm.n_heads, lm.context_length, lm.vocab_size


def push_op(ops: list[dict], op: dict, shape: Shape | None = None) -> list[dict]:
    """``ops`` with ``op`` after them, as a new list (the old one is left as it was, for an atomic swap)."""
    out = list(ops)
    _push(out, op, shape, {})
    return out


def compact_ops(ops: list[dict], shape: Shape | None = None) -> list[dict]:
    """A recipe's operations with every cancelled or superseded change taken out (see ``_push``).

    Without the model's ``shape`` mask and head edits are kept as they are."""
    out: list[dict] = []
    memo: dict = {}  # states already worked out, so compacting stays about linear in the ops
    for op in ops:
        _push(out, op, shape, memo)
    return out


def _push(ops: list[dict], op: dict, shape: Shape | None, memo: dict) -> None:
    """Append ``op`` to ``ops``, cancelling what an undo made moot and what ``op`` supersedes.

    A step back removes its step together with the forces and decoding changes made on that step
    (the last decoding change stays, as a plain one); a decoding change replaces a plain one just
    before it, and a redecide any one (it chooses again from the step's own sampler state); a force
    replaces a force just before it. A mask or head edit replaces the edits and step/back groups
    before it whose recomputes it recomputes again (``_wash``). Replaying the result gives the very
    state the whole list gives, in fewer forwards. Only the end of ``ops`` ever changes.
    """
    kind = op.get("op")
    last = ops[-1].get("op") if ops else None
    if kind == "step_back":
        for i in range(len(ops) - 1, -1, -1):
            k = ops[i].get("op")
            if k == "step":
                decided = [o for o in ops[i + 1 :] if o.get("op") == "decoding"]
                del ops[i:]
                if decided:
                    _push(ops, {**decided[-1], "redecide": False}, shape, memo)
                return
            if k not in ("force", "decoding"):
                break
    elif kind == "decoding" and last == "decoding" and (op.get("redecide") or not ops[-1].get("redecide")):
        ops.pop()
    elif kind == "force" and last == "force":
        ops.pop()
    elif kind in ("mask", "heads") and shape is not None:
        with contextlib.suppress(InspectorError):  # an edit the replay will refuse: kept, and refused as before
            _wash(ops, op, shape, memo)
    ops.append(op)


def _wash(ops: list[dict], x: dict, shape: Shape, memo: dict) -> None:
    """Take out of ``ops`` the tail that edit ``x``, about to follow, makes moot.

    ``x`` recomputes every position from its reach (the earliest it changes) on. A tail of edits and
    whole step ... step-back groups (forces inside them) changes nothing else that lasts but the edits
    in force; if none of its edits reached below ``x``'s reach, ``x`` overwrites all it computed, and
    the tail can become the last mask op and the last head op in it (where they changed the edits):
    those reach no lower than the tail did, so ``x`` overwrites them too and reaches as far as before.
    """
    cuts, edits, depth, low = [], [], 0, len(ops)  # where a tail may start: no step of it left standing
    for i in range(len(ops) - 1, max(-1, len(ops) - 1 - WINDOW), -1):
        k = ops[i].get("op")
        if k == "step_back":
            depth += 1
        elif k == "step" and depth:
            depth -= 1
        elif k in ("mask", "heads"):
            edits.append(i)
        elif not (k == "force" and depth):
            break  # a step or force that stays, or a decoding change (its setting stays)
        low = i
        if depth == 0:
            cuts.append(i)
    if not cuts:
        return

    def before(n: int, kind: str) -> tuple:  # the edits of ``kind`` in force before ops[edits[n]] (or at ``low``)
        j = next((j for j in edits[n:] if j < (edits[n - 1] if n else len(ops)) and ops[j]["op"] == kind), None)
        return _state_of(ops[j], shape, memo) if j is not None else _state_before(ops, low, kind, shape, memo)

    mine = _reach(x["op"], before(0, x["op"]), _state_of(x, shape, memo))
    bound = -1  # walking back: the last edit that reached below x; the tail starts after it
    for n, i in enumerate(edits):
        k = ops[i]["op"]
        if _reach(k, before(n + 1, k), _state_of(ops[i], shape, memo)) < mine:
            bound = i
            break
    cut = min((c for c in cuts if c > bound), default=len(ops))
    if cut == len(ops):
        return
    first_left = next((n for n, i in enumerate(edits) if i < cut), len(edits))  # edits[first_left:] stay
    kept = []
    for k in ("mask", "heads"):
        last = next((i for i in edits if ops[i]["op"] == k), None)
        if last is not None and last >= cut and _state_of(ops[last], shape, memo)[0] != before(first_left, k)[0]:
            kept.append(last)
    ops[cut:] = [ops[i] for i in sorted(kept)]


def _state_before(ops: list[dict], end: int, kind: str, shape: Shape, memo: dict) -> tuple:
    """The edits of ``kind`` in force after ``ops[:end]``. Remembered by the op that ends the prefix
    (the object itself, so its id is never reused, and its place): only the end of ``ops`` changes,
    so while that op sits at that place the prefix before it is the same."""
    key = (kind, id(ops[end - 1]), end) if end else None
    if key in memo and memo[key][0] is ops[end - 1]:
        return memo[key][1]
    state: tuple = ((), frozenset())  # a session starts with no edits
    for i in range(end - 1, -1, -1):
        if ops[i].get("op") == kind:
            state = _state_of(ops[i], shape, memo)
            break
        hit = memo.get((kind, id(ops[i]), i + 1))
        if hit is not None and hit[0] is ops[i]:
            state = hit[1]
            break
    if key is not None:
        memo[key] = (ops[end - 1], state)
    return state


def _state_of(op: dict, shape: Shape, memo: dict) -> tuple:
    """The edits an op leaves in force, as the session keeps them, and the (layer, head, query, key)
    cells they block (mask ops); InspectorError where the live session would refuse the op."""
    hit = memo.get(id(op))
    if hit is not None and hit[0] is op:
        return hit[1]
    state = _edits_of(op, shape)
    memo[id(op)] = (op, state)
    return state


def _edits_of(op: dict, shape: Shape) -> tuple:
    n_layers, n_heads, context, vocab = shape
    if op["op"] == "heads":
        heads = tuple(HeadEdit.from_json(e) for e in op["edits"])
        for h in heads:
            if not 0 <= h.layer < n_layers or not (h.head is None or 0 <= h.head < n_heads):
                raise InspectorError("a head edit outside the model")
            if h.patch_from is not None and (h.head is None or not all(0 <= t < vocab for t in h.patch_from)):
                raise InspectorError("a patch the session refuses")
        return heads, frozenset()
    blocked: dict[tuple, MaskEdit] = {}
    for e in (MaskEdit.from_json(d) for d in op["edits"]):
        if not 0 <= e.key <= e.query < context or not (e.layer is None or 0 <= e.layer < n_layers):
            raise InspectorError("a mask edit outside the model")
        if e.head is not None and not 0 <= e.head < n_heads:
            raise InspectorError("a mask edit outside the model")
        if e.blocked:
            blocked[e.scope()] = e
        else:
            blocked.pop(e.scope(), None)
    cells = frozenset(
        (layer, head, e.query, e.key)
        for e in blocked.values()
        for layer in (range(n_layers) if e.layer is None else [e.layer])
        for head in (range(n_heads) if e.head is None else [e.head])
    )
    rows: dict[tuple, int] = {}
    for layer, head, q, _ in cells:
        rows[layer, head, q] = n = rows.get((layer, head, q), 0) + 1
        if n > q:
            raise InspectorError("a mask edit that leaves a query no key")
    return tuple(blocked.values()), cells


def _reach(kind: str, old: tuple, new: tuple) -> int:
    """The earliest position a change of edits recomputes, as the session computes it: a head edit
    reruns everything while any is in force, a mask edit from its first changed query row."""
    if kind == "heads":
        return 0 if old[0] or new[0] else _NEVER
    return min((c[2] for c in old[1] ^ new[1]), default=_NEVER)
