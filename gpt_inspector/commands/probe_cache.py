"""`gpt-inspector probe-cache`: show that a KV cache gives its prompt away."""

from __future__ import annotations

import sys

from . import common

NAME = "probe-cache"
HELP = "recover every cached token from the KV cache alone (layer 0 by default) and count the hits"


def add_arguments(p):
    common.add_model_args(p)
    common.add_connect_arg(p)
    p.add_argument("--prompt", required=True, help="the text the session starts from")
    p.add_argument("--steps", type=int, default=1, help="steps to run before probing (default 1: the prompt only)")
    common.add_decoding_args(p)
    p.add_argument("--layers", default="0", help="comma-separated layers to attack, e.g. 0,1 (default 0)")
    p.add_argument(
        "--context", default="auto", choices=("auto", "cache", "greedy"),
        help="deeper layers: prefix from the cached lower layers (cache) or from the tokens recovered so far (greedy)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the full result as JSON")


def run(args) -> int:
    from ..core import validate
    from ..core.probe import probe_session

    validate.count(args.steps)
    layers = common.number_list(args.layers, "--layers", int, "; give e.g. 0 or 0,1")
    s = common.session(args)
    s.run(args.steps)
    result = probe_session(s, layers, context=args.context)
    if args.json:
        common.print_json(result.to_json())
        return 0
    for lp in result.layers:
        print(f"layer {lp.layer} ({lp.method}), {lp.n_positions} cached positions:")
        print(f"  {'pos':>4}  {'true':<16} {'recovered':<16} {'distance':>10} {'margin':>10}")
        for p in lp.positions:
            mark = "✓" if p.recovered else "✗"
            print(
                f"  {p.position:>4}  {p.true_label or '':<16} {p.label:<16} {p.distance:>10.3g} {p.margin:>10.3g}  {mark}"
            )
        print(f"  recovered {lp.n_recovered}/{lp.n_positions}: {result.texts[lp.layer]!r}")
    print(result.summary(), file=sys.stderr)
    return 0
