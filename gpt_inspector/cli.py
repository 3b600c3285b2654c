"""Command line: `gpt-inspector [window options]` opens the window; sub-commands work headless.

Errors a user can fix print one line on stderr and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from . import __version__
from .commands import compare, export, kv_lab, lens, math_check, probe_cache, serve, trace

# sub-commands in help order; each module imports the engine only when its command runs
COMMANDS = (trace, compare, export, probe_cache, math_check, lens, kv_lab, serve)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other user error
        self.exit(2, f"{self.prog}: error: {message}\n")


def _size(text: str) -> tuple[int, int]:
    """ "1366x768" -> (1366, 768); argparse turns the ValueError into a one-line usage error."""
    w, sep, h = text.lower().partition("x")
    if not sep or not w.strip().isdigit() or not h.strip().isdigit() or int(w) < 200 or int(h) < 200:
        raise argparse.ArgumentTypeError(
            f"expected WIDTHxHEIGHT in pixels, at least 200x200, e.g. 1366x768; got {text!r}"
        )
    return int(w), int(h)


def build_parser() -> argparse.ArgumentParser:
    from .commands import common

    p = _Parser(
        prog="gpt-inspector",
        description="Step-through debugger for GPT-style language models. With no COMMAND it opens the "
        "window (on the embedded demo model unless --model is given); the commands work headless.",
    )
    p.add_argument("--version", action="version", version=f"gpt-inspector {__version__}")
    common.add_model_args(p)
    common.add_prompt_args(p, "prompt to start the window with", required=False)
    p.add_argument(
        "--connect", default=None, metavar="URL", type=common.connect_url,
        help="open the window on the engine gpt-inspector serve runs (the ws://HOST:PORT/?token=... line it printed)",
    )  # fmt: skip
    common.add_sampler_args(p.add_argument_group("the window's sampler (generate's names)"), max_new_tokens=False)
    p.add_argument("--steps", type=int, default=None, help="with --screenshot: steps to run first")
    p.add_argument(
        "--screenshot",
        default=None,
        type=common.user_path,
        help="open the window, run --steps, save a PNG of it and exit",
    )
    p.add_argument(
        "--screenshot-size",
        type=_size,
        default=None,
        metavar="WxH",
        help="with --screenshot: the window's size in pixels (default 1366x768, a laptop screen)",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    scratch = argparse.ArgumentParser(add_help=False)
    common.add_model_args(scratch)
    model_dests = {a.dest for a in scratch._actions}
    for mod in COMMANDS:
        sp = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
        # `gpt-inspector --model M trace ...`: a sub-command's own defaults would silently replace the
        # model options given before it (argparse's rule), and the demo model would run instead
        for action in sp._actions:
            if action.dest in model_dests:
                action.default = argparse.SUPPRESS
    return p


def quiet_transformers() -> str | None:
    """Keep transformers' warnings and progress bars from burying our one-line messages.

    Called after argument parsing, so ``--help`` still does not import transformers. Returns the
    one-line reason where the installed transformers cannot serve (missing, or older than the floor).
    """
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from .core import hf
    except ImportError as e:
        if _interrupt["seen"]:  # transformers' lazy modules report a Ctrl+C mid-import as an ImportError
            raise KeyboardInterrupt from None
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    hf.quiet()
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the command line; Ctrl+C at any moment, the seconds spent importing torch and transformers
    included, prints one line and exits 130."""
    import signal
    import threading

    # installed before any heavy import: Ctrl+C raises KeyboardInterrupt as Python's own handler does,
    # and is remembered, since some libraries turn it into another error on its way up (a shell that
    # started us with SIGINT ignored, a background job, is obeyed)
    _interrupt["seen"] = False
    previous = signal.getsignal(signal.SIGINT)
    if (
        previous in (signal.SIG_DFL, signal.default_int_handler)
        and threading.current_thread() is threading.main_thread()
    ):
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("gpt-inspector: interrupted", file=sys.stderr)
        _forget_unhandled_interrupt()
        return 130
    finally:
        if signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, previous)


_interrupt = {"seen": False}


def _forget_unhandled_interrupt() -> None:
    """Exit 130, not -2: CPython ends by re-raising SIGINT on itself when a KeyboardInterrupt left code run
    through ``PyRun_*`` (a Rust extension's ``py.run``), even one caught further up, as this one was; any
    ``PyRun_SimpleString`` clears that flag (about 1 run in 5 of Ctrl+C 1.5 s into ``trace`` ended with -2)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.pythonapi.PyRun_SimpleString(b"")


def _on_sigint(signum, frame):
    _interrupt["seen"] = True
    raise KeyboardInterrupt


def _main(argv: list[str] | None) -> int:
    from .core.errors import InspectorError, StepFailed

    parser = build_parser()
    args = parser.parse_args(argv)
    unusable = quiet_transformers()  # imports transformers and torch: seconds a Ctrl+C may land in
    if _interrupt["seen"]:  # a library's import fallback swallowed it: the user still asked to stop
        raise KeyboardInterrupt
    if unusable:
        print(f"gpt-inspector: error: {unusable}", file=sys.stderr)
        return 2
    try:
        if args.command is None:
            from .gui.app import run as run_window

            return run_window(args)
        rc = args._run(args)
        if _interrupt["seen"] and rc == 0:  # swallowed on its way up (an import fallback): still a Ctrl+C
            raise KeyboardInterrupt
        return rc
    except (InspectorError, StepFailed) as e:
        if _interrupt["seen"]:  # an interrupt some layer reported as a failure: still the user's Ctrl+C
            raise KeyboardInterrupt from None
        print(f"gpt-inspector: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    finally:
        if args.command is not None:
            from .commands import common

            common.release_remote()


if __name__ == "__main__":
    raise SystemExit(main())
