"""Check a session recipe whole before anything replays it: a saved file is input from outside.

A hostile or damaged autosave must be refused in one line before a window or a model is touched,
not halfway through a replay (or never, when it asks for a billion steps). Only what the recipe
says about itself is checked here; what depends on the model (token ids below the vocabulary,
mask positions inside the context) is checked by the replay itself, which refuses as cleanly.
"""

from __future__ import annotations

from . import decoding, validate
from .errors import InspectorError

RECIPE_FORMAT = "gpt-inspector-recipe/1"
# far beyond any real session (the step ops at most the context length, after step/back cycles
# collapse), and small enough that checking and replaying one cannot exhaust memory or time
MAX_OPS = 200_000
MAX_RECOMPUTES = 2_000  # mask and head edit ops: each re-runs the whole sequence
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
            if recomputes > MAX_RECOMPUTES:
                raise InspectorError(f"more than {MAX_RECOMPUTES} mask or head edit operations")
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
    _load(recipe.get("load"))
    return recipe
