"""`gpt-inspector serve`: load a model and serve its engine to one client (gi.connect) over a websocket."""

from __future__ import annotations

import signal
import sys
import threading
import time

from . import common

NAME = "serve"
HELP = "load a model and serve the engine on a websocket; prints the URL (with its token) to connect to"


def add_arguments(p):
    common.add_model_args(p)
    p.add_argument(
        "--bind", default="127.0.0.1:0",
        help="HOST:PORT to listen on (default 127.0.0.1 and a free port); another host than localhost "
        "lets anyone who can reach it and has the token drive the model: prefer an SSH tunnel",
    )  # fmt: skip
    start = p.add_mutually_exclusive_group()
    start.add_argument("--prompt", default=None, help="open a session on this prompt at start (a client can open one)")
    start.add_argument(
        "--restore", default=None, type=common.user_path,
        help="start from a recipe a stopped server saved (--recipe-out): the session replays to where it stopped",
    )  # fmt: skip
    common.add_decoding_args(p)
    p.add_argument(
        "--recipe-out", default=None, type=common.user_path,
        help="where Ctrl+C saves the session's recipe (default: gpt-inspector-session-<time>.json here)",
    )  # fmt: skip


def _bind(text: str) -> tuple[str, int]:
    from ..core.errors import InspectorError

    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InspectorError(f"--bind takes HOST:PORT (PORT 0 picks a free one), e.g. 127.0.0.1:8765; got {text!r}")
    return host, int(port)


def _read_recipe(path) -> dict:
    import json

    from ..core.errors import InspectorError
    from ..core.recipe_check import check_recipe

    try:
        with open(path, encoding="utf-8") as f:
            recipe = json.load(f)
    except (OSError, ValueError) as e:
        raise InspectorError(f"cannot read the recipe {path}: {getattr(e, 'strerror', None) or e}") from None
    return check_recipe(recipe)


def run(args) -> int:
    import secrets

    from ..core import Session
    from ..core.errors import InspectorError
    from ..remote.server import Engine, Server, save_recipe

    host, port = _bind(args.bind)
    if args.prompt is not None:
        common.check_run_args(args)
    recipe_out = args.recipe_out or f"gpt-inspector-session-{time.strftime('%Y%m%d-%H%M%S')}.json"
    common.check_out(recipe_out)
    recipe = None if args.restore is None else _read_recipe(args.restore)  # a bad file: refused before the load
    lm = common.load(args)  # the self-test runs here, before any client can connect
    session = None
    if args.prompt is not None:
        session = Session(lm, args.prompt, args.temperature, args.top_k, args.top_p, args.seed)
    elif args.restore is not None:
        session = Session.replay(lm, recipe)
    engine = Engine(lm, session)
    try:
        server = Server(engine, host, port, secrets.token_urlsafe(32))
    except OSError as e:
        raise InspectorError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"gpt-inspector: warning: listening on {host}: anyone who reaches it with the token drives the model "
              "(and the traffic is not encrypted); an SSH tunnel to 127.0.0.1 is safer", file=sys.stderr)  # fmt: skip
    stopping = threading.Event()
    stopper: list[threading.Thread] = []

    def stop(_signum, _frame) -> None:
        # a flag and a thread, not KeyboardInterrupt: a second signal (Ctrl+C twice, the SIGTERM a
        # supervisor sends after it) must not land inside the shutdown, the recipe's save or exit hooks
        if not stopping.is_set():
            stopping.set()
            stopper.append(threading.Thread(target=server.shutdown, name="gpt-inspector-stop", daemon=True))
            stopper[0].start()

    # SIGTERM (a service manager, kill) stops as Ctrl+C does: the recipe is saved either way
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print(server.url, flush=True)
    print(f"gpt-inspector: serving {lm.name}; connect with gi.connect(URL); Ctrl+C stops and saves the session's "
          f"recipe to {recipe_out}", file=sys.stderr, flush=True)  # fmt: skip
    try:
        server.serve_forever()
    finally:
        if not stopping.is_set():  # it ended on its own (an error): close what is open
            stopping.set()
            server.shutdown()
    # serve_forever returns as the shutdown begins: its closing of the connections must end before the
    # interpreter does (else "cannot schedule new futures after interpreter shutdown", from that thread)
    for t in stopper:
        t.join(timeout=10)
    # stopped: a further signal has nothing left to stop (Python's exit would otherwise meet it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # the step in progress (if any) ends first: the recipe is of a whole session, never of half a step
    with engine.lock:
        saved = save_recipe(engine, recipe_out)
    print(f"gpt-inspector: stopped; {'recipe saved to ' + saved if saved else 'no session was opened'}",
          file=sys.stderr, flush=True)  # fmt: skip
    return 0
