"""Flags shared by sub-commands, and turning them into engine objects."""

from __future__ import annotations

import argparse
import json
import sys

from ..core.errors import InspectorError


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model", default=None, help="hub id (gpt2, distilgpt2, ...) or local folder; default: the embedded demo model"
    )
    g.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N, mps")
    g.add_argument("--dtype", default=None, help="float32 (default), float16 or bfloat16")
    g.add_argument(
        "--device-map",
        default=None,
        help="auto, balanced or sequential: spread the layers over the GPUs, the CPU and disk (accelerate)",
    )
    g.add_argument(
        "--max-memory",
        default=None,
        help="with --device-map: the most each device may hold, e.g. 0=20GiB,1=20GiB,cpu=60GiB",
    )
    g.add_argument(
        "--offload-folder",
        default=None,
        type=user_path,
        help="with --device-map: where the weights that fit nowhere else wait on disk",
    )
    g.add_argument(
        "--allow-pickle", action="store_true", help="also load pickle (.bin) weights; only for sources you trust"
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model repository's own Python code; only for sources you trust",
    )
    g.add_argument(
        "--unverified",
        action="store_true",
        help="load a model whose logits through gpt-inspector differ from its own eager attention "
        "(the load-time self-test failed); outputs are marked unverified",
    )


def add_decoding_args(p: argparse.ArgumentParser, g=None, temperature=(0.0, "0 = greedy (default)")) -> None:
    """The decoding flags, in group ``g`` (default: a new "decoding" group); ``temperature``: its (default, help)."""
    g = g or p.add_argument_group("decoding")
    g.add_argument("--temperature", type=float, default=temperature[0], help=temperature[1])
    g.add_argument(
        "--top-k", type=int, default=None, help="keep only the k most likely tokens before sampling (default: off)"
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="keep the smallest set of tokens whose probability adds up to p (default: off)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="random seed for sampling (default 0); the same seed gives the same tokens"
    )


def load_options(args) -> dict:
    """``load_model``'s keyword arguments from the model flags (a sweep's workers load with them too)."""
    return {"name_or_path": args.model, "device": args.device, "dtype": args.dtype, "allow_pickle": args.allow_pickle,
            "trust_remote_code": args.trust_remote_code, "allow_unverified": args.unverified,
            "device_map": args.device_map, "max_memory": args.max_memory, "offload_folder": args.offload_folder}  # fmt: skip


def load(args):
    from ..core import load_model

    lm = load_model(**load_options(args))
    if lm.unverified:
        print(
            f"gpt-inspector: warning: UNVERIFIED model, its numbers may not be the model's own: {lm.unverified}",
            file=sys.stderr,
        )
    for w in lm.warnings:
        print(f"gpt-inspector: warning: {w}", file=sys.stderr)
    # information, not a doubt: on stdout (a successful run keeps stderr for what went wrong), and not
    # where stdout carries JSON
    if lm.note and getattr(args, "json", None) not in (True, "-"):
        print(f"gpt-inspector: note: {lm.note}")
    return lm


def session(args):
    from ..core import Session

    return Session(
        load(args), args.prompt, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )


def check_run_args(args) -> None:
    """Refuse a bad prompt, seed or decoding setting before the (slow) model load."""
    from ..core import decoding, validate

    validate.text(args.prompt, "--prompt")
    validate.seed(args.seed, "--seed")
    if getattr(args, "temperature", None) is not None:
        decoding.validate(args.temperature, args.top_k, args.top_p)


def int_list(text: str, what: str, hint: str = "") -> list[int]:
    """Comma-separated integers (blanks skipped); none at all is refused, with ``hint`` after the message."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if part:
            try:
                out.append(int(part))
            except ValueError:
                raise InspectorError(f"{what} takes comma-separated integers, got {text!r}") from None
    if not out:
        raise InspectorError(f"{what} is empty{hint}")
    return out


def user_path(text: str) -> str:
    """An argparse type for file arguments: ``~`` expands even when quoted, as the shell would."""
    from ..core import outfile

    try:
        return str(outfile.expand(text))
    except InspectorError as e:  # argparse turns this, not a RuntimeError, into its one-line exit 2
        raise argparse.ArgumentTypeError(str(e)) from None


def check_out(path) -> None:
    """Refuse a destination the result could not be written to, before the model runs rather than after:
    a missing or read-only folder, a folder, device, FIFO or link at the name, a name too long."""
    from ..core import outfile

    outfile.check_writable(path)


def print_json(obj, ensure_ascii: bool = False) -> None:
    json.dump(obj, sys.stdout, ensure_ascii=ensure_ascii)
    sys.stdout.write("\n")


def save_figure(build, path, what: str) -> None:
    """Draw ``build(figures)`` to ``path``, say where on stderr, and let go of the figure's buffers."""
    from .. import figures

    fig = build(figures)
    print(f"{what} saved to {figures.save(fig, path)}", file=sys.stderr)
    figures.close(fig)
