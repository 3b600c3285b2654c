"""`gpt-inspector compare`: greedy vs beam search (vs a seeded sample) on one prompt, side by side."""

from __future__ import annotations

import shutil
import sys
import unicodedata

from ..core.errors import InspectorError
from . import common

NAME = "compare"
HELP = "compare greedy decoding, beam search (identical to generate) and seeded samples on one prompt"


def add_arguments(p):
    common.add_model_args(p)
    common.add_connect_arg(p)
    common.add_prompt_args(p, "the text to continue")
    g = p.add_argument_group("length (give exactly one)")
    g.add_argument(
        "--max-length", type=int, default=None, help="total length, prompt included, as generate's max_length"
    )
    g.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate after the prompt")
    b = p.add_argument_group("beam search")
    b.add_argument("--num-beams", type=int, default=2, help="beams kept at each step (default 2)")
    b.add_argument(
        "--num-return-sequences",
        type=int,
        default=1,
        help="finished hypotheses to show, best first (default 1, at most --num-beams)",
    )
    b.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        help="hypothesis score = sum of log-probs / generated_length ** this (default 1.0)",
    )
    b.add_argument(
        "--early-stopping",
        nargs="?",
        const="true",
        default="false",
        metavar="{true,false,never}",
        help="stop as soon as num_beams hypotheses are finished (bare flag = true); 'never' = exhaustive",
    )
    s = p.add_argument_group("sampling (with --sample or --samples)")
    s.add_argument("--sample", action="store_true", help="also show one seeded sample (= --samples 1)")
    s.add_argument("--samples", type=int, default=None, metavar="N",
                   help="N seeded samples at each temperature, seeds --seed, --seed + 1, ...")  # fmt: skip
    s.add_argument("--temperatures", default=None, metavar="T,T,...",
                   help="sample at each of these temperatures (with --samples; default: --temperature)")  # fmt: skip
    common.add_decoding_args(p, s, temperature=(None, "default 1.0"), max_new_tokens=False)
    common.add_assisted_args(p)
    p.add_argument("--json", action="store_true", help="print the comparison as one JSON object")


def _check(args) -> None:
    """Refuse bad settings before the (slow) model load."""
    from ..core import validate

    common.check_run_args(args)
    common.check_assisted_args(args)
    validate.length_penalty(args.length_penalty, 2)  # finite; the bound for the model's context follows the load
    if (args.max_length is None) == (args.max_new_tokens is None):
        raise InspectorError("give exactly one of --max-length or --max-new-tokens")
    validate.integer("--num-beams", args.num_beams, 1)
    validate.integer("--num-return-sequences", args.num_return_sequences, 1)
    if args.num_return_sequences > args.num_beams:
        raise InspectorError(
            f"--num-return-sequences ({args.num_return_sequences}) cannot exceed --num-beams ({args.num_beams})"
        )
    if args.max_new_tokens is not None:
        validate.integer("--max-new-tokens", args.max_new_tokens, 1)
    if args.max_length is not None:
        validate.integer("--max-length", args.max_length, 1)
    validate.early_stopping(args.early_stopping)
    if args.samples is not None:
        validate.integer("--samples", args.samples, 1)
    if args.temperatures is not None:
        if args.samples is None:
            raise InspectorError("--temperatures only applies with --samples")
        if args.temperature is not None:
            raise InspectorError("give --temperature or --temperatures, not both")
        args.temperatures = _temperatures(args.temperatures, "--temperatures")
    if not args.sample and args.samples is None:
        given = [n for n in ("temperature", "top_k", "top_p", *common.SAMPLER_FLAGS, "suppress_tokens", "bad_words_ids",
                             "bad_words") if getattr(args, n) is not None]  # fmt: skip
        if given:
            raise InspectorError(f"--{given[0].replace('_', '-')} only applies with --sample or --samples")


def _temperatures(text: str, what: str) -> list[float]:
    import math

    out = common.number_list(text, what, float)
    if not all(math.isfinite(t) and t > 0 for t in out):
        raise InspectorError(f"{what}: every temperature must be a finite number > 0, got {text!r}")
    return out


def run(args) -> int:
    from ..core import validate
    from ..core.compare import compare

    _check(args)
    if args.connect:
        out = _remote(args)
        for w in out.get("warnings", []):
            print(f"gpt-inspector: warning: {w}", file=sys.stderr)
        return _print(args, out)
    lm = common.load(args)
    draft = common.load_assistant(args, lm)
    result = compare(
        lm, **common.prompt_args(args), max_length=args.max_length, max_new_tokens=args.max_new_tokens, num_beams=args.num_beams,
        num_return_sequences=args.num_return_sequences, length_penalty=args.length_penalty,
        early_stopping=validate.early_stopping(args.early_stopping), sample=args.sample,
        temperature=1.0 if args.temperature is None else args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, sampler=common.settings_for(args, lm), samples=args.samples, temperatures=args.temperatures,
        assistant=draft, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        num_assistant_tokens=args.num_assistant_tokens, assistant_confidence_threshold=args.assistant_confidence_threshold,
    )  # fmt: skip
    out = result.to_json()
    for w in result.warnings:
        print(f"gpt-inspector: warning: {w}", file=sys.stderr)
    return _print(args, out)


def _remote(args) -> dict:
    """The comparison run by the engine at ``--connect`` on ``--prompt``: its JSON, as a local one's."""
    s = common.remote_session(args)
    try:  # --assistant-model names a folder on the engine's machine: the draft is loaded there
        result = s.remote_compare(
            max_length=args.max_length, max_new_tokens=args.max_new_tokens, num_beams=args.num_beams,
            num_return_sequences=args.num_return_sequences, length_penalty=args.length_penalty,
            early_stopping=_early(args.early_stopping), sample=args.sample,
            temperature=1.0 if args.temperature is None else args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed, sampler=common.sampler_settings(args) or None, samples=args.samples,
            temperatures=args.temperatures, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
            assistant=args.assistant_model, num_assistant_tokens=args.num_assistant_tokens,
            assistant_confidence_threshold=args.assistant_confidence_threshold,
        )  # fmt: skip
    finally:
        common.release(s)  # the engine's one client slot is free at once
    return result.to_json()


def _early(text):
    from ..core import validate

    return validate.early_stopping(text)


def _print(args, out: dict) -> int:
    if args.json:
        common.print_json(out)
    else:
        sys.stdout.write(render_text(out, width=shutil.get_terminal_size((120, 24)).columns))
    return 0


# ---------------------------------------------------------------------------------------------- text


def _width(s: str) -> int:
    # terminal columns: CJK and emoji take two, combining marks none
    return sum(
        0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in s
    )


def _pad(s: str, n: int) -> str:
    return s + " " * max(0, n - _width(s))


def render_text(out: dict, width: int = 120) -> str:
    """The outputs as aligned columns, one per generated position, the first token that differs
    from greedy marked ``»tok«`` and each token's probability under it."""
    p = out["prompt_length"]
    rows = [(r["name"], r) for r in out["rows"]]
    n_cols = max(len(r["tokens"]) for _, r in rows)
    name_w = max(_width(name) for name, _ in rows) + 2

    def cell(r: dict, i: int) -> tuple[str, str]:  # (token, its probability) of column i
        if i >= len(r["tokens"]):
            return "", ""
        tok = r["tokens"][i]
        return (f"»{tok}«" if p + i == r.get("diverges_at") else tok), f"{r['probs'][i]:.2f}"

    cells = [[cell(r, i) for i in range(n_cols)] for _, r in rows]
    col_w = [max(max(_width(c[i][0]), _width(c[i][1])) for c in cells) + 1 for i in range(n_cols)]

    s = out["settings"]
    lines = [
        f"prompt: {out['prompt']!r} ({p} tokens), up to {out['max_length']} tokens in all",
        f"beam search: {s['num_beams']} beams, length_penalty {s['length_penalty']:g}, "
        f"early_stopping {s['early_stopping']}",
        "",
    ]
    # wrap the columns into blocks that fit the terminal
    start = 0
    while start < n_cols or start == 0:
        used, end = name_w, start
        while end < n_cols and (end == start or used + col_w[end] <= width):
            used += col_w[end]
            end += 1
        lines.append(_pad("", name_w) + "".join(_pad(str(p + i), col_w[i]) for i in range(start, end)).rstrip())
        for (name, _), line in zip(rows, cells):
            lines.append(_pad(name, name_w) + "".join(_pad(line[i][0], col_w[i]) for i in range(start, end)).rstrip())
            lines.append(_pad("", name_w) + "".join(_pad(line[i][1], col_w[i]) for i in range(start, end)).rstrip())
        lines.append("")
        if end >= n_cols:
            break
        start = end

    for name, r in rows:
        extra = []
        if "score" in r:
            extra.append(f"score {r['score']:.4f}")
        div = r.get("diverges_at")
        if "rounds" in r:
            a = r["assisted"]
            rate = "" if a["acceptance_rate"] is None else f" ({a['acceptance_rate']:.0%})"
            extra.append(
                f"{a['mode']}: {a['rounds']} rounds, {a['accepted']} of {a['proposed']} proposed accepted{rate}"
            )
        if "seed" in r:
            extra.append(f"seed {r['seed']}, T {r['temperature']:g}")
        if name != "greedy":
            extra.append("same as greedy" if div is None else f"parts from greedy at token {div}")
        lines.append(f"{_pad(name, name_w)}{r['text']!r}" + (f"  ({', '.join(extra)})" if extra else ""))
    return "\n".join(lines) + "\n"
