"""`gpt-inspector kv-lab`: run a KV cache policy beside the full cache, step by step, or sweep
policies and budgets over a prompt file and draw the frontier (bytes vs KL, bytes vs probe)."""

from __future__ import annotations

import json
import sys

from ..core.errors import InspectorError
from ..core.kvlab.registry import NAMES as POLICIES  # the registry's names import no torch (--help stays light)
from . import common

NAME = "kv-lab"
HELP = "what a KV cache policy (eviction, quantization) costs in bytes, fidelity and privacy, step by step"


def add_arguments(p):
    common.add_model_args(p)
    common.add_connect_arg(p)  # the engine runs the labs on its model (a sweep: one after the other)
    p.add_argument("--prompt", default=None, help="the text to start from (one run)")
    p.add_argument("--policy", default=None, help=f"one of {', '.join(POLICIES)}")
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help="eviction: cache entries kept per KV head (default: unlimited, the full cache)",
    )
    p.add_argument("--steps", type=int, default=8, help="steps to run (default 8)")
    p.add_argument("--free-running", action="store_true",
                   help="let the policy run choose its own tokens and show where the texts part "
                        "(default: teacher-forced, it is fed the reference's tokens)")  # fmt: skip
    common.add_decoding_args(p, sampler=False)  # the lab's runs take temperature, top-k and top-p only
    p.add_argument(
        "--probe",
        action="store_true",
        help="one run: also probe layer 0 of the policy's cache for the prompt (one vocabulary pass per position)",
    )
    g = p.add_argument_group("policy options")
    g.add_argument("--sinks", type=int, default=None, help="eviction: first entries always kept (streaming default 4)")
    g.add_argument("--recent", type=int, default=None, help="eviction: newest entries always kept (default per policy)")
    g.add_argument(
        "--layer-budget",
        action="append",
        default=[],
        metavar="L=N[,N...]",
        help="eviction: layer L keeps N entries per KV head (or one N per KV head); repeatable",
    )
    g.add_argument(
        "--window", type=int, default=None, help="snapkv: observation window at the prompt's end (default 8)"
    )
    g.add_argument("--schedule", default=None, metavar="WHEN",
                   help="eviction: when the cache is cut to the budget: step (after every step; default), prefill "
                        "(after the prompt only), N (after the prompt and every N steps) or append (never: "
                        "just the accounting)")  # fmt: skip
    g.add_argument("--page", type=int, default=None,
                   help="eviction: evict whole pages of N positions (ranked by their entries' mean score), and count "
                        "bytes as a paged cache allocates them (default 1: entries)")  # fmt: skip
    g.add_argument("--share", default=None, choices=("head", "layer"),
                   help="eviction: head (each KV head its own budget; default) or layer (AdaKV: a layer's KV heads "
                        "share their budgets, allocated by score)")  # fmt: skip
    g.add_argument("--group", type=int, default=None, help="int quantization: group size (default min(32, head size))")
    g.add_argument(
        "--scheme",
        default=None,
        choices=("kivi", "transformers"),
        help="int quantization: kivi (keys per channel, values per token; default) or transformers "
        "(what transformers' quantized cache does with quanto: int4/int2)",
    )
    g.add_argument(
        "--residual", type=int, default=None, help="quantization: newest entries kept in full precision (default 16)"
    )
    s = p.add_argument_group("sweep")
    s.add_argument("--sweep", action="store_true", help="run every policy at every budget over --prompts")
    s.add_argument(
        "--prompts", default=None, type=common.user_path, help="sweep: a UTF-8 text file, one prompt per line"
    )
    s.add_argument("--policies", default=None, help="sweep: comma-separated policies")
    s.add_argument("--budgets", default=None, help="sweep: comma-separated budgets for the eviction policies")
    s.add_argument("--no-probe", action="store_true", help="sweep: skip the cache probe (no privacy axis)")
    s.add_argument("--needle", action="store_true",
                   help="sweep: also plant facts early in a long prompt and ask for them at its end, per policy: "
                        "does it still answer them greedily as the full cache does (a panel of the frontier)")  # fmt: skip
    s.add_argument("--jobs", type=int, default=1,
                   help="sweep: worker processes running (policy, budget) labs side by side, each loading the model "
                        "and using cores/N threads (default 1: this process)")  # fmt: skip
    p.add_argument(
        "--out",
        default=None,
        type=common.user_path,
        help="draw the figure (sweep: the frontier; one run: KL per step) to .png, .svg or .pdf",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        type=common.user_path,
        help="print the result as JSON, or write it to FILE (the sweep's table)",
    )


def _names(text: str) -> list[str]:
    names = [_check_policy(x.strip()) for x in str(text).split(",") if x.strip()]
    if not names:
        raise InspectorError("--policies is empty; give e.g. streaming,h2o,int4")
    return names


def _check_policy(name) -> str:
    if name not in POLICIES:
        raise InspectorError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}")
    return name


def _options(args) -> dict:
    from ..core import validate

    out = {}
    for key, low in (("sinks", 0), ("recent", 0), ("window", 1), ("group", 1), ("residual", 0)):
        v = getattr(args, key)
        if v is not None:
            out[key] = validate.integer(f"--{key}", v, low)
    if args.scheme is not None:
        out["scheme"] = args.scheme
    if getattr(args, "page", None) is not None:
        out["page"] = validate.integer("--page", args.page, 1)
    if getattr(args, "schedule", None) is not None:
        from ..core.kvlab.serving import check_schedule

        out["schedule"] = check_schedule(args.schedule)
    if getattr(args, "share", None) is not None:
        out["share"] = args.share
    if getattr(args, "layer_budget", None):
        out["layer_budgets"] = dict(_layer_budget(text) for text in args.layer_budget)
    return out


def _layer_budget(text: str) -> tuple[int, int | list[int]]:
    layer, sep, rest = str(text).partition("=")
    try:
        if not sep:
            raise ValueError
        per = [int(x) for x in rest.split(",")]
        return int(layer), per[0] if len(per) == 1 else per
    except ValueError:
        raise InspectorError(f"--layer-budget takes L=N or L=N,N,... (one per KV head), got {text!r}") from None


def run(args) -> int:
    from ..core import validate

    validate.count(args.steps)
    if args.out is not None:
        from ..figures import check_format

        check_format(args.out)
        common.check_out(args.out)
    if args.sweep:
        return _sweep(args)
    given = [flag for flag, on in (("--prompts", args.prompts is not None), ("--policies", args.policies is not None),
             ("--budgets", args.budgets is not None), ("--no-probe", args.no_probe), ("--needle", args.needle),
             ("--jobs", args.jobs != 1)) if on]  # fmt: skip
    if given:  # else silently ignored: the user asked for a sweep and got one run
        raise InspectorError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for a sweep: add --sweep")
    if args.prompt is None or args.policy is None:
        raise InspectorError("kv-lab needs --prompt and --policy (or --sweep with --prompts, --policies, --budgets)")
    common.check_run_args(args)
    name = _check_policy(args.policy)
    if args.json not in (None, "-"):
        common.check_out(args.json)
    opts = _options(args)
    from ..core.kvlab import registry

    # a sweep gives each policy the options it takes; one run names its policy: say what would be ignored
    unused = [k for k in opts if k not in registry.options(name)]
    if unused:
        flags = ", ".join("--layer-budget" if k == "layer_budgets" else f"--{k}" for k in unused)
        what = "an eviction" if registry.kind(name) == "eviction" else "a quantization"
        raise InspectorError(f"{name} is {what} policy: it does not take {flags}")
    from ..core.kvlab import KVLab
    from ..core.kvlab.lab import final_rows
    from ..core.kvlab.sweep import build_policy

    policy = build_policy(name, args.budget, opts)  # refused before the model loads if it makes no sense
    if args.connect:  # the engine runs both runs; its steps, bytes and probe come back
        s = common.remote_session(args)
        try:
            lab = s.remote_kvlab(name, args.budget, 0, args.free_running, opts)
            return _one_run(args, lab, s.model_name, lab.final_rows)
        finally:
            common.release(s)
    lm = common.load(args)
    lab = KVLab(lm, args.prompt, policy, free_running=args.free_running, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed)  # fmt: skip
    return _one_run(args, lab, lm.name, lambda: final_rows(lab))


def _one_run(args, lab, model: str, rows) -> int:
    """Step ``lab`` (a KVLab, or a RemoteLab on an engine) and print or save what it found."""
    import numpy as np

    for st in lab.steps(args.steps):
        if args.json is None:
            mark = "" if st.agree else "  <- top-1 differs"
            lost = "n/a" if bool(np.isnan(st.lost_mass).any()) else f"{float(st.lost_mass.max()):.3f}"
            print(f"step {st.index + 1:>3}  ref {st.reference_label!r:<14} policy {st.policy_label!r:<14} "
                  f"KL {st.kl:.3e}  bytes {sum(st.bytes_policy):>10,} / {sum(st.bytes_full):>10,}  "
                  f"lost mass max {lost}{_paged(st)}{mark}")  # fmt: skip
    summary = lab.summary()
    privacy = lab.probe() if args.probe else None
    if args.out is not None:
        common.save_figure(lambda figures: figures.lab_figure(lab), args.out, "figure")
    if args.json is not None:
        out = {"model": model, **summary, **_from_one(summary),
               "steps_detail": [{"step": s.index + 1, **{k: v for k, v in s.to_json().items() if k != "index"}}
                                for s in lab.history],
               "privacy": None if privacy is None else privacy.to_json(), **rows()}  # fmt: skip
        _write_json(out, args.json)
        return 0
    k = lab.first_divergence
    # the full cache is the model's own (sliding layers: their window); the reference run keeps every position
    full, kept = summary["bytes_full"], summary["bytes_kept"]
    print(f"{summary['policy']}: mean KL {summary['mean_kl']:.3e}, top-1 agreement {summary['agreement']:.0%}, "
          f"first divergence {'none' if k is None else f'step {k + 1}'}; cache {summary['bytes_policy']:,} of "
          f"{full:,} bytes" + (f" (kept for inspection {kept:,})" if kept > full else "")
          + (f"; in pages of {summary['page']}: {summary['bytes_paged']:,} of {summary['bytes_full_paged']:,}"
             if summary["page"] > 1 and summary["bytes_paged"] is not None else ""))  # fmt: skip
    if args.free_running:
        parted = lab.parted_at
        print(f"texts part at step {parted + 1}" if parted is not None else "texts never part")
        print(f"reference: {summary['reference_text']!r}\npolicy:    {summary['policy_text']!r}")
    if privacy is not None:
        print(f"cache probe (layer 0): {privacy.recovered} of {privacy.prompt_tokens} prompt tokens recovered "
              f"({privacy.held} still held)")  # fmt: skip
    return 0


def _paged(st) -> str:
    return "" if st.page == 1 or st.bytes_paged is None else f"  paged {sum(st.bytes_paged):>10,}"


def _from_one(summary: dict) -> dict:
    """The summary's step numbers counted from 1, as the window and every command print steps (the
    library's ``first_divergence`` and ``parted_at`` are indices into the lab's history, from 0)."""
    return {k: None if summary[k] is None else summary[k] + 1 for k in ("first_divergence", "parted_at")}


def _write_json(obj, dest) -> None:
    if dest == "-":
        common.print_json(obj)
        return
    from ..core import outfile

    outfile.write_text(dest, json.dumps(obj, ensure_ascii=False, indent=1))
    print(f"table saved to {dest}", file=sys.stderr)


def _read_prompts(path) -> list[str]:
    from ..core import validate

    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\r\n") for line in f]
    except (OSError, UnicodeDecodeError) as e:
        raise InspectorError(f"cannot read --prompts {path}: {e}") from None
    prompts = [validate.text(x, "a prompt in --prompts") for x in lines if x.strip()]
    if not prompts:
        raise InspectorError(f"--prompts {path} holds no prompt (one per line)")
    return prompts


def _sweep(args) -> int:
    if not args.prompts or not args.policies:
        raise InspectorError("--sweep needs --prompts FILE and --policies (and --budgets for eviction policies)")
    prompts = _read_prompts(args.prompts)
    names = _names(args.policies)
    budgets = common.number_list(args.budgets, "--budgets", int) if args.budgets else []
    if args.json not in (None, "-"):
        common.check_out(args.json)
    opts = _options(args)
    from ..core.kvlab.sweep import check_jobs, plan, sweep

    jobs = check_jobs(args.jobs, "--jobs")
    pairs = plan(names, budgets)
    if args.connect:
        return _remote_sweep(args, prompts, pairs, opts, jobs)
    lm = common.load(args)
    # each worker loads the model exactly as this process did
    load = common.load_options(args)
    # Ctrl+C stops the sweep here; nothing is written (the figure and table are written only when complete)
    result = sweep(lm, prompts, pairs, args.steps, probe=not args.no_probe, options=opts, progress=_progress,
                   jobs=jobs, load=load, needle=args.needle)  # fmt: skip
    return _sweep_out(args, result)


def _progress(done, total, what) -> None:
    tty = sys.stderr.isatty()
    bar = "#" * (20 * done // total)
    line = f"[{bar:<20}] {done}/{total} {what}"
    print(("\r" + line) if tty else line, end="" if tty and done < total else "\n", file=sys.stderr, flush=True)


def _remote_sweep(args, prompts, pairs, opts, jobs) -> int:
    """The sweep on the engine at ``--connect``: its labs one after the other, on its model."""
    if args.needle:
        raise InspectorError("--needle runs where the model is: leave out --connect (or --needle)")
    if jobs != 1:
        raise InspectorError("--jobs: the engine runs one lab at a time: leave out --jobs with --connect")
    s = common.remote_session(args)
    try:
        result = s.remote_sweep(prompts, pairs, args.steps, probe=not args.no_probe, options=opts, progress=_progress)
    finally:
        common.release(s)
    return _sweep_out(args, result)


def _sweep_out(args, result) -> int:
    if args.out is not None:
        common.save_figure(lambda figures: figures.frontier_figure(result), args.out, "frontier")
    if args.json is not None:
        _write_json(result.to_json(), args.json)
        if args.json == "-":
            return 0
    print(f"{'policy':<10} {'budget':>6} {'bytes':>7} {'mean KL':>10} {'top-1':>6} {'probe':>7}"
          + (f" {'needle':>7}" if args.needle else ""))  # fmt: skip
    for p in result.points():
        rec = "-" if p["recovered_fraction"] is None else f"{p['recovered_fraction']:.0%}"
        budget = "-" if p["budget"] is None else p["budget"]
        print(
            f"{p['policy']:<10} {budget:>6} {p['bytes_ratio']:>7.1%} {p['mean_kl']:>10.3e} {p['agreement']:>6.0%} {rec:>7}"
            + (f" {p['needle_found']:>7.0%}" if "needle_found" in p else "")
        )
    if result.needles:
        ref = next(iter(result.needles.values()))
        print(f"needle: {len(ref.cases)} facts planted ~{ref.cases[0]['prompt_tokens']} tokens back; the full cache "
              f"answers {ref.reference_found} of them")  # fmt: skip
    return 0
