"""`gpt-inspector math-check`: recompute every attention output by hand and compare with the model's."""

from __future__ import annotations

import sys

from ..core.errors import InspectorError
from . import common

NAME = "math-check"
HELP = (
    "recompute softmax(q·Kᵀ·scaling + mask)·V in float64 per layer/head and compare with the model (exit 1 on mismatch)"
)


def add_arguments(p):
    src = p.add_argument_group("source (one of)")
    src.add_argument("--trace", default=None, help="a trace file (.safetensors) saved by `trace`")
    src.add_argument("--prompt", default=None, help="run the model on this prompt instead")
    common.add_model_args(p)
    common.add_connect_arg(p)
    p.add_argument("--steps", type=int, default=1, help="with --prompt: steps to run (default 1)")
    common.add_decoding_args(p)
    p.add_argument("--layer", type=int, default=None, help="check only this layer")
    p.add_argument("--head", type=int, default=None, help="with --position: show one head's vectors")
    p.add_argument("--position", type=int, default=None, help="with --head: the query position (default: last)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="absolute tolerance (default: per dtype, relative to the largest |V| of the head)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _source(args):
    from ..core import validate

    if args.trace is not None and args.prompt is not None:
        raise InspectorError("give either --trace FILE or --prompt (with --model), not both")
    if args.trace is not None:
        from ..core.trace import load_trace

        return load_trace(args.trace)
    if args.prompt is None:
        raise InspectorError("nothing to check: give --trace FILE or --model M --prompt P --steps N")
    validate.count(args.steps)
    s = common.session(args)
    s.run(args.steps)
    return s


def run(args) -> int:
    from ..core.mathcheck import check, check_all

    if args.tolerance is not None and not args.tolerance > 0:
        raise InspectorError(f"--tolerance must be positive, got {args.tolerance}")
    src = _source(args)
    one = args.head is not None or args.position is not None  # one head's output vector, not the whole report
    if one and (args.head is None or args.layer is None):
        raise InspectorError("--head/--position check one vector: give --layer and --head too")
    if one:
        result = check(src, args.layer, args.head, args.position, args.tolerance)
    else:
        result = check_all(src, None if args.layer is None else [args.layer], args.tolerance)
    if args.json:
        common.print_json(result.to_json(), ensure_ascii=True)
    else:
        print(result.formula)
        if one:
            print(f"{'dim':>4} {'recomputed':>14} {'model':>14} {'|diff|':>10}")
            for i, (a, b) in enumerate(zip(result.recomputed, result.model)):
                print(f"{i:>4} {a:>14.7g} {b:>14.7g} {abs(a - b):>10.3g}")
        else:
            for i, layer in enumerate(result.layers):
                cells = "  ".join(
                    f"h{h} {result.max_diff[i, h]:.2e}{'' if result.max_diff[i, h] <= result.tolerance[i, h] else ' ✗'}"
                    for h in range(result.n_heads)
                )
                print(f"layer {layer:>2}: {cells}")
        print(result.summary())
    if not result.ok:
        print(f"gpt-inspector: mismatch: {result.summary()}", file=sys.stderr)
        return 1
    return 0
