"""`gpt-inspector trace`: step a model N tokens and save everything it computed."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import InspectorError
from . import common

NAME = "trace"
HELP = "step a model N tokens with full capture and save a trace file"


def add_arguments(p):
    common.add_model_args(p)
    common.add_connect_arg(p)
    common.add_prompt_args(p, "the text the session starts from")
    p.add_argument("--steps", type=int, required=True, help="steps to run (each feeds one token, chooses the next)")
    common.add_decoding_args(p)
    common.add_assisted_args(p)
    p.add_argument("--out", required=True, type=common.user_path, help="FILE.safetensors")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument(
        "--derived",
        action="store_true",
        help="also store the score and probability matrices (H x T x T per layer) for plain-numpy readers",
    )
    p.add_argument("--json", action="store_true", help="print tokens, text and each step's top-5 as JSON")


def run(args) -> int:
    from ..core import validate

    validate.count(args.steps, "--steps")
    common.check_run_args(args)
    common.check_assisted_args(args, args.temperature)
    out = Path(args.out)
    if out.suffix != ".safetensors":
        raise InspectorError(f"--out must end in .safetensors, got {args.out}")
    # check the destination before the model runs, so a typo costs nothing
    common.check_out(out)
    if out.exists() and not args.force:
        raise InspectorError(f"--out {args.out} already exists; pass --force to overwrite it")
    s = common.session(args)
    try:
        return _trace_on(args, s, out)
    finally:
        common.release(s)  # a remote engine's one client slot is free at once


def _trace_on(args, s, out):
    from ..core.kv_layout import human_bytes

    a = common.assisted(args, s, args.steps) if common.assisted_given(args) else None
    if a is not None:
        a.run()
        steps = list(s.steps_done)
    else:
        steps = s.run(args.steps)
    path = s.save_trace(out, derived=args.derived)
    # the cache as it really is (bytes, and how it is laid out where that is not per-head K and V)
    real, per_head, kept = s.kv_cache_bytes(), s.kv_per_head_bytes(), s.kv_kept_bytes()
    note = s.kv_layout.describe() if s.kv_layout is not None else getattr(s, "kv_note", "")
    if args.json:
        out = {
            "model": s.model_name,
            "tokens": s.tokens,
            "prompt_length": len(s.prompt_ids),
            "text": s.text,
            "finished": s.finished,
            "steps": [
                {
                    "step": st.index + 1,  # counted from 1, as the window and every command count steps
                    "token_id": st.token_id,
                    "text": st.token_text,
                    "prob": st.prob,
                    "entropy": st.entropy,
                    "top5": [{"token_id": e.token_id, "text": e.label, "prob": e.prob} for e in st.top[:5]],
                }
                for st in steps
            ],
            "trace": str(path),
            "kv_cache_bytes": real,
            "kv_per_head_bytes": per_head,
            "kv_kept_bytes": kept,
            "kv_cache": note,
            "note": s.lm.note
            if s.lm is not None
            else s.note,  # which of the model's computations the numbers are, where it has two that differ
            "attention_layers": list(s.attention_layers),
        }
        if a is not None:
            out["assisted"] = {**a.summary(), "rounds": [r.to_json() for r in a.rounds]}
        common.print_json(out)
    else:
        # the summary goes with the text: stderr is for errors only, so a script can tell success by it
        print(s.text)
        print(f"{len(steps)} steps, {s.cache_length} positions cached; trace saved to {path}")
        text = f"KV cache: {human_bytes(real)}"
        if per_head != real:
            text += f" (per-head K and V would take {human_bytes(per_head)})"
        if kept > real:  # sliding-window layers: the model's cache holds their window, the trace every position
            text += f", kept for inspection {human_bytes(kept)}"
        print(f"{text}; {note}" if note else text)
        if a is not None:
            rate = a.acceptance_rate
            print(f"assisted ({a.mode}): {len(a.rounds)} rounds, {a.accepted} of {a.proposed} proposed tokens "
                  f"accepted" + ("" if rate is None else f" ({rate:.0%})"))  # fmt: skip
    return 0
