"""`gpt-inspector export`: attention heatmaps to PNG, SVG or PDF, from a trace file or a fresh run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..core.attention import KIND_TITLES
from ..core.errors import InspectorError
from . import common

NAME = "export"
HELP = "render attention heatmaps (one head, a layer's heads or the whole model) to PNG, SVG or PDF"
EXPORT_KINDS = ("probs", "masked_scores", "scores", "raw")  # core/attention.py KINDS, most used first


def _index_or_all(text: str):
    if text.strip().lower() == "all":
        return "all"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'all', got {text!r}") from None


def add_arguments(p):
    src = p.add_argument_group("source (a trace file, or a model run now)")
    src.add_argument(
        "--trace",
        default=None,
        type=common.user_path,
        help="FILE.safetensors saved by `gpt-inspector trace` or the window",
    )
    common.add_model_args(p)
    common.add_connect_arg(p)
    p.add_argument("--prompt", default=None, help="without --trace: the prompt to run")
    p.add_argument("--steps", type=int, default=None, help="without --trace: steps to run first")
    common.add_decoding_args(p)
    what = p.add_argument_group("what to draw")
    what.add_argument("--layer", type=_index_or_all, required=True, help="layer index, or 'all' for every layer x head")
    what.add_argument("--head", type=_index_or_all, default=None,
                      help="head index, or 'all' for every head of --layer in one image")  # fmt: skip
    what.add_argument("--kind", choices=EXPORT_KINDS, default="probs",
                      help="stage of the attention equation, named as in the window: "
                      + ", ".join(f"{k} = {KIND_TITLES[k]}" for k in EXPORT_KINDS) + " (default probs)")  # fmt: skip
    p.add_argument("--out", required=True, type=common.user_path, help="PATH.png, PATH.svg or PATH.pdf")
    p.add_argument("--scale", type=float, default=None,
                   help="PNG pixels per unit, 1 = 100 dpi (default 2 for one head, 1 for grids); ignored for SVG and PDF")  # fmt: skip
    p.add_argument("--full-resolution", action="store_true",
                   help="one head only: draw every query x key cell unpooled (by default cells narrower than a pixel are "
                   "max-pooled). A PNG then gets whole pixels per cell, about T pixels a side at long T; an SVG or PDF "
                   "embeds the T x T image at the usual page size. Past 16,384 positions it pools and the subtitle "
                   "gives the block size")  # fmt: skip


def _check(args) -> None:
    from ..core import validate
    from ..export import check_format, check_scale

    check_format(args.out)
    common.check_out(args.out)
    if args.scale is not None:
        check_scale(args.scale)
    if args.trace is not None:
        given = [
            f for f, v in (("--model", args.model), ("--prompt", args.prompt), ("--steps", args.steps)) if v is not None
        ]
        if given:
            raise InspectorError(f"--trace replays a saved run; drop {', '.join(given)}")
    else:
        if args.prompt is None or args.steps is None:
            raise InspectorError("give --trace FILE, or --prompt and --steps to run a model now")
        validate.count(args.steps)
    if args.layer == "all":
        if args.head not in (None, "all"):
            raise InspectorError("--layer all draws every head of every layer; drop --head")
    elif args.head is None:
        raise InspectorError("give --head N, or --head all for every head of the layer")
    if args.full_resolution and (args.layer == "all" or args.head == "all"):
        raise InspectorError("--full-resolution draws one head: give --layer N --head N (grids are always pooled)")


def _check_range(args, source) -> None:
    if args.layer != "all" and not 0 <= args.layer < source.n_layers:
        raise InspectorError(f"--layer must be in [0, {source.n_layers}) or 'all', got {args.layer}")
    if isinstance(args.head, int) and not 0 <= args.head < source.n_heads:
        raise InspectorError(f"--head must be in [0, {source.n_heads}) or 'all', got {args.head}")


def run(args) -> int:
    from .. import export  # matplotlib without Qt: needs no display

    _check(args)
    from ..core.trace import load_trace

    source = load_trace(args.trace) if args.trace is not None else common.session(args)
    _check_range(args, source)  # before spending time on the steps
    if args.trace is None:
        source.run(args.steps)
    out = Path(args.out)
    kw = {} if args.scale is None else {"scale": args.scale}
    if args.layer == "all":
        path = export.render_grid(source, None, args.kind, out, **kw)
        what = f"all {source.n_layers} layers x {source.n_heads} heads"
    elif args.head == "all":
        path = export.render_grid(source, args.layer, args.kind, out, **kw)
        what = f"layer {args.layer}, all {source.n_heads} heads"
    else:
        path = export.render_heatmap(
            source, args.layer, args.head, args.kind, out, full_resolution=args.full_resolution, **kw
        )
        what = f"layer {args.layer} head {args.head}" + (" (--full-resolution)" if args.full_resolution else "")
    print(f"{what} ({args.kind}, {source.cache_length} positions) written to {path}", file=sys.stderr)
    return 0
