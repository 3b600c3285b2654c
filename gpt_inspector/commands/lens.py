"""`gpt-inspector lens`: where the prediction forms (logit lens) and which heads push it (attribution)."""

from __future__ import annotations

from ..core.errors import InspectorError
from . import common

NAME = "lens"
HELP = "the logit lens after every layer and each head's direct contribution to the chosen token"


def add_arguments(p):
    common.add_model_args(p)
    common.add_connect_arg(p)
    common.add_prompt_args(p, "the text to start from")
    p.add_argument("--steps", type=int, default=1, help="steps to run; the lens shows the last one (default 1)")
    common.add_decoding_args(p)
    p.add_argument("--top", type=int, default=5, help="tokens listed per layer (default 5)")
    p.add_argument(
        "--knock-out",
        action="append",
        default=[],
        metavar="L[.H]",
        help="zero head H of layer L (or the whole layer's attention) before the lens; repeatable; "
        "the run is recomputed with the chosen tokens kept",
    )
    p.add_argument(
        "--out",
        default=None,
        type=common.user_path,
        help="also draw the lens and the head map to a .png, .svg or .pdf file",
    )
    p.add_argument("--json", action="store_true", help="print the full result as JSON")


def run(args) -> int:
    from ..core import validate

    validate.count(args.steps)
    top = validate.integer("--top", args.top, 1)
    knocks = [_knock(text) for text in args.knock_out]
    if args.out is not None:
        from ..figures import check_format

        check_format(args.out)  # before the model runs
        common.check_out(args.out)
    s = common.session(args)
    try:
        return _lens_on(args, s, knocks, top)
    finally:
        common.release(s)  # a remote engine's one client slot is free at once


def _lens_on(args, s, knocks, top):
    from ..core.lens import lens

    s.run(args.steps)
    before = None
    if knocks:
        before = s.current
        report = s.set_head_edits(knocks)
        before = {"token_id": before.token_id, "prob_before": float(report.before[before.token_id]),
                  "prob_after": float(report.after[before.token_id]), "total_variation": report.total_variation}  # fmt: skip
    r = lens(s, top_k=min(top, 50))
    if args.out is not None:
        common.save_figure(
            lambda figures: figures.lens_figure(r, s.model_name, unverified=s.unverified), args.out, "lens figure"
        )
    if args.json:
        out = {"model": s.model_name, "text": s.text, **r.to_json()}
        if knocks:
            out["knock_out"] = {"edits": [e.to_json() for e in knocks], **before}
        common.print_json(out)
        return 0
    print(f"step {r.step + 1} (position {r.position}) chose {r.label!r}; logit {r.logit:.4f}")
    if knocks:
        print(
            f"knocked out {', '.join(args.knock_out)}: p({r.label!r}) {before['prob_before']:.4f} -> "
            f"{before['prob_after']:.4f} (tokens kept as chosen; total variation {before['total_variation']:.4f})"
        )
    print(f"{'layer':>5}  {'p(chosen)':>9}  top tokens")
    for x in r.layers:
        tops = "  ".join(f"{e.label}:{e.prob:.3f}" for e in x.top)
        print(f"{x.layer:>5}  {x.prob:>9.4f}  {tops}")
    if r.attribution is None:
        print(r.note)
    else:
        flat = sorted(
            ((v, i, h) for i, row in enumerate(r.attribution.tolist()) for h, v in enumerate(row)), reverse=True
        )
        best = ", ".join(f"L{i}.H{h} {v:+.3f}" for v, i, h in flat[:5])
        worst = ", ".join(f"L{i}.H{h} {v:+.3f}" for v, i, h in flat[::-1][:3])
        print(f"heads pushing it most: {best}; against: {worst}; everything else {r.remainder:+.3f} ({r.note})")
    return 0


def _knock(text: str):
    from ..core.capture import HeadEdit

    layer, _, head = str(text).partition(".")
    try:
        return HeadEdit(int(layer), int(head) if head else None)
    except ValueError:
        raise InspectorError(f"--knock-out takes L or L.H (layer, head), got {text!r}") from None
