"""Flags shared by sub-commands, and turning them into engine objects."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TypeVar

from ..core.errors import InspectorError

T = TypeVar("T", int, float)


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


class _Turn(argparse.Action):
    """--system/--user/--assistant TEXT: one turn each, kept in the order given on the command line."""

    def __call__(self, parser, namespace, values, option_string=None):
        turns = list(getattr(namespace, "turns", None) or [])
        turns.append({"role": self.dest.removeprefix("turn_"), "content": values})
        namespace.turns = turns


def add_prompt_args(p: argparse.ArgumentParser, help_text: str, required: bool = True) -> None:
    """--prompt, or a chat: --messages FILE.json and/or --system/--user/--assistant turns (the tokenizer's template)."""
    p.add_argument("--prompt", default=None, help=help_text + (" (or a chat: --messages, --user)" if required else ""))
    g = p.add_argument_group("chat (the prompt built by the tokenizer's chat template instead of --prompt)")
    g.add_argument("--messages", default=None, type=user_path, metavar="FILE.json",
                   help='the turns: [{"role": "system", "content": "..."}, {"role": "user", ...}, ...]')  # fmt: skip
    for role in ("system", "user", "assistant"):
        g.add_argument(f"--{role}", dest=f"turn_{role}", action=_Turn, metavar="TEXT",
                       help=f"a {role} turn, after --messages' turns, in command-line order (repeatable)")  # fmt: skip
    g.add_argument("--no-generation-prompt", dest="add_generation_prompt", action="store_false",
                   help="leave out the template's assistant header at the end (generate's add_generation_prompt=False)")  # fmt: skip
    p.set_defaults(turns=None, prompt_required=required)


def prompt_args(args) -> dict:
    """``{"prompt": ...}`` or ``{"messages": [...], "add_generation_prompt": ...}``; checked, before the model loads."""
    from ..core import chat, validate

    msgs = chat.load_messages(args.messages) if getattr(args, "messages", None) else []
    msgs += getattr(args, "turns", None) or []
    if msgs:
        if args.prompt is not None:
            raise InspectorError("give --prompt or chat turns (--messages, --system, --user), not both")
        return {"messages": chat.check_messages(msgs), "add_generation_prompt": args.add_generation_prompt}
    if getattr(args, "add_generation_prompt", True) is False:
        raise InspectorError("--no-generation-prompt needs chat turns (--messages, --user)")
    if args.prompt is None:
        if getattr(args, "prompt_required", False):
            raise InspectorError("give --prompt TEXT, or chat turns with --messages FILE.json or --user TEXT")
        return {}
    validate.text(args.prompt, "--prompt")
    return {"prompt": args.prompt}


def add_decoding_args(p: argparse.ArgumentParser, g=None, temperature=(0.0, "0 = greedy (default)"),
                      sampler: bool = True, max_new_tokens: bool = True) -> None:  # fmt: skip
    """The decoding flags, in group ``g`` (default: a new "decoding" group); ``temperature``: its (default, help);
    ``sampler``: also the rest of generate's sampler arguments (``add_sampler_args``)."""
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
    if sampler:
        add_sampler_args(g, max_new_tokens)


def add_sampler_args(g, max_new_tokens: bool = True) -> None:
    """generate's other sampler arguments, by its names; unset ones take the model's generation-config
    default where it ships one. The warpers (min-p ... eta) apply only when sampling (temperature > 0)."""
    for flag, typ, text in (
        ("--min-p", float, "drop tokens below min-p times the top token's probability (sampling)"),
        ("--typical-p", float, "keep the locally typical tokens up to this mass (sampling)"),
        ("--epsilon-cutoff", float, "drop tokens below this probability (sampling)"),
        ("--eta-cutoff", float, "drop tokens below an entropy-scaled cutoff (sampling)"),
        ("--repetition-penalty", float, "divide the scores of tokens already in the text (1 = off; < 1 favours them)"),
        ("--no-repeat-ngram-size", int, "never repeat an n-gram of this size"),
        ("--min-new-tokens", int, "forbid the end-of-sequence token for this many steps"),
        ("--forced-eos-token-id", int, "force this token on the last step (with --max-new-tokens, else the context's end)"),
    ):  # fmt: skip
        g.add_argument(flag, type=typ, default=None, help=text)
    if max_new_tokens:
        g.add_argument("--max-new-tokens", type=int, default=None, help="with --forced-eos-token-id: steps before it")
    g.add_argument("--suppress-tokens", default=None, metavar="IDS", help="token ids never chosen, e.g. 13,198")
    g.add_argument("--bad-words-ids", default=None, metavar="IDS;IDS",
                   help="token-id sequences never completed, e.g. 318;262,3290 (semicolons between sequences)")  # fmt: skip
    g.add_argument("--bad-words", default=None, metavar="WORDS",
                   help="words never produced, comma-separated, tokenized as typed (quote a leading space)")  # fmt: skip


SAMPLER_FLAGS = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty", "no_repeat_ngram_size",
                 "min_new_tokens", "forced_eos_token_id")  # fmt: skip


def sampler_settings(args) -> dict:
    """The sampler flags given, as ``Session``'s keyword arguments (``--bad-words`` needs the tokenizer:
    see ``bad_words``); InspectorError for a malformed list."""
    if getattr(args, "max_new_tokens", None) is not None:  # else -1 or 0 passed unnoticed without --forced-eos-token-id
        from ..core import validate

        validate.count(args.max_new_tokens, "--max-new-tokens")
    out = {k: getattr(args, k) for k in SAMPLER_FLAGS if getattr(args, k, None) is not None}
    if out.get("forced_eos_token_id") is not None and getattr(args, "max_new_tokens", None) is not None:
        out["max_new_tokens"] = args.max_new_tokens
    if getattr(args, "suppress_tokens", None) is not None:
        out["suppress_tokens"] = number_list(args.suppress_tokens, "--suppress-tokens", int)
    if getattr(args, "bad_words_ids", None) is not None:
        seqs = [part for part in args.bad_words_ids.split(";") if part.strip()]
        if not seqs:
            raise InspectorError("--bad-words-ids is empty")
        out["bad_words_ids"] = [number_list(part, "--bad-words-ids", int) for part in seqs]
    return out


def bad_words(args, tokenizer) -> list[list[int]]:
    """``--bad-words`` as token-id sequences, each word encoded as typed."""
    from ..core import validate

    out = []
    words = validate.text(getattr(args, "bad_words", None) or "", "--bad-words")  # the tokenizer raises on surrogates
    for word in words.split(","):
        if word.strip():
            ids = list(tokenizer.encode(word, add_special_tokens=False))
            if not ids:
                raise InspectorError(f"--bad-words: {word!r} encodes to no tokens")
            out.append(ids)
    if getattr(args, "bad_words", None) is not None and not out:
        raise InspectorError("--bad-words is empty")
    return out


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


def connect_url(text: str) -> str:
    """``--connect``'s value: an empty one would silently run here instead (argparse makes this one line)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("needs the ws://HOST:PORT/?token=... line gpt-inspector serve printed")
    return text


def add_connect_arg(p):
    p.add_argument(
        "--connect", default=None, metavar="URL", type=connect_url,
        help="run on the engine gpt-inspector serve runs (the ws://HOST:PORT/?token=... line it printed) "
        "instead of loading a model here",
    )  # fmt: skip


def remote_session(args):
    """A new session on the engine at ``--connect`` (the model is the engine's); one line for a bad URL or token."""
    from ..remote.client import connect

    if getattr(args, "model", None) is not None:
        raise InspectorError("--connect runs on the engine's model: leave out --model")
    if getattr(args, "bad_words", None) is not None:
        raise InspectorError("--bad-words needs the model's tokenizer: with --connect give --bad-words-ids")
    temperature = 0.0 if args.temperature is None else args.temperature  # compare's: for its samples only
    # a chat's turns go as turns: the engine's tokenizer applies its template
    r = connect(args.connect, temperature=temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                **prompt_args(args), **sampler_settings(args))  # fmt: skip
    _REMOTE.append(r)
    return r


_REMOTE: list = []  # the remote sessions a command opened: closed when it returns (cli._main), freeing the engine


def release_remote() -> None:
    """Close every link a command opened to a remote engine (its one client slot is free at once)."""
    while _REMOTE:
        _REMOTE.pop().close()


def release(s) -> None:
    """Close ``s``'s link where it is a remote engine's session (a local one has nothing to close)."""
    if s.engine is not None:
        s.close()


def session(args):
    if getattr(args, "connect", None):
        return remote_session(args)
    from ..core import Session

    lm = load(args)
    return Session(lm, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                   **prompt_args(args), **settings_for(args, lm))  # fmt: skip


def settings_for(args, lm) -> dict:
    """``sampler_settings`` with ``--bad-words`` encoded by ``lm``'s tokenizer and added to the id sequences."""
    out = sampler_settings(args)
    words = bad_words(args, lm.tokenizer)
    if words:
        out["bad_words_ids"] = out.get("bad_words_ids", []) + words
    return out


def check_run_args(args) -> None:
    """Refuse a bad prompt, seed or decoding setting before the (slow) model load."""
    from ..core import decoding, validate

    prompt_args(args)
    validate.seed(args.seed, "--seed")
    if getattr(args, "temperature", None) is not None:
        decoding.validate(args.temperature, args.top_k, args.top_p)
    extra = sampler_settings(args)
    if extra:
        t = getattr(args, "temperature", None)
        decoding.Decoding(0.0 if t is None else t, **extra)  # the whole set, before the (slow) model load


def window_settings(args) -> dict:
    """The window's start settings from its sampler flags, checked before the window opens."""
    from ..core import decoding

    if args is None:
        return {}
    if getattr(args, "bad_words", None) is not None:
        raise InspectorError("the window takes --bad-words-ids (token ids), not --bad-words")
    out = sampler_settings(args)
    decoding.Decoding(**out)
    return out


def number_list(text: str, what: str, convert: Callable[[str], T], hint: str = "") -> list[T]:
    """Comma-separated numbers, each read by ``convert`` (int, float; blanks skipped); none at all is
    refused, with ``hint`` after the message."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if part:
            try:
                out.append(convert(part))
            except ValueError:
                kind = "integers" if convert is int else "numbers"
                raise InspectorError(f"{what} takes comma-separated {kind}, got {text!r}") from None
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


def add_assisted_args(p: argparse.ArgumentParser) -> None:
    """generate's assisted-decoding arguments: a draft model or prompt lookup (greedy)."""
    g = p.add_argument_group("assisted decoding (greedy; one of the first two)")
    g.add_argument("--assistant-model", default=None, metavar="PATH",
                   help="a draft model with the target's tokenizer (hub id or folder) proposes tokens")  # fmt: skip
    g.add_argument("--prompt-lookup-num-tokens", type=int, default=None, metavar="N",
                   help="prompt lookup: propose the N tokens that followed the last n-gram earlier in the text")  # fmt: skip
    g.add_argument("--num-assistant-tokens", type=int, default=None, metavar="N",
                   help="with --assistant-model: tokens it proposes per round (generate's default 20)")  # fmt: skip
    g.add_argument("--assistant-confidence-threshold", type=float, default=None, metavar="P",
                   help="with --assistant-model: it stops proposing below this probability (default 0.4; 0 never)")  # fmt: skip


def assisted_given(args) -> bool:
    return (
        getattr(args, "assistant_model", None) is not None
        or getattr(args, "prompt_lookup_num_tokens", None) is not None
    )


def check_assisted_args(args, temperature=None) -> None:
    """Refuse bad assisted-decoding flags before any model loads."""
    from ..core import validate

    if args.assistant_model is not None and args.prompt_lookup_num_tokens is not None:
        raise InspectorError("give --assistant-model or --prompt-lookup-num-tokens, not both")
    if args.num_assistant_tokens is not None:
        if args.assistant_model is None:
            raise InspectorError("--num-assistant-tokens only applies with --assistant-model")
        validate.integer("--num-assistant-tokens", args.num_assistant_tokens, 1)
    t = args.assistant_confidence_threshold
    if t is not None:
        if args.assistant_model is None:
            raise InspectorError("--assistant-confidence-threshold only applies with --assistant-model")
        if not 0 <= t <= 1:
            raise InspectorError(f"--assistant-confidence-threshold must be from 0 to 1, got {t!r}")
    if args.prompt_lookup_num_tokens is not None:
        validate.integer("--prompt-lookup-num-tokens", args.prompt_lookup_num_tokens, 1)
    if assisted_given(args) and temperature:
        raise InspectorError("assisted decoding here is greedy (do_sample=False): leave --temperature at 0")


def load_assistant(args, lm):
    """``--assistant-model`` loaded with the target's model flags and checked against ``lm`` (same tokenizer),
    or None."""
    from ..core.assisted import check_assistant

    if args.assistant_model is None:
        return None
    draft = load(argparse.Namespace(**{**vars(args), "model": args.assistant_model, "json": True}))
    check_assistant(lm, draft)
    return draft


def assisted(args, session, max_new_tokens: int):
    """The Assisted run over ``session`` the flags ask for."""
    from ..core.assisted import Assisted

    # on a remote engine the draft is named, and the engine loads it from its own disk
    draft = args.assistant_model if session.engine is not None else load_assistant(args, session.lm)
    return Assisted(session, draft, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
                    num_assistant_tokens=args.num_assistant_tokens,
                    assistant_confidence_threshold=args.assistant_confidence_threshold,
                    max_new_tokens=max_new_tokens)  # fmt: skip
