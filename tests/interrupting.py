"""Ctrl+C at a chosen moment: SIGINT to the main thread from a timer thread, as a terminal sends it."""

from __future__ import annotations

import signal
import sys
import threading
import time


def interrupted_during(fn, delay: float) -> bool:
    """Run ``fn()`` while SIGINT reaches the main thread ``delay`` seconds in; True if it landed inside.

    A signal that comes after ``fn`` returned lands in a short sleep that follows it, never in the
    caller's next lines.
    """
    main = threading.main_thread().ident

    def fire():
        time.sleep(delay)
        signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=fire, daemon=True)
    # a shell starts a background job with SIGINT ignored (CI run with `&`, nohup): Python then never
    # raises KeyboardInterrupt. Ctrl+C in a terminal reaches the default handler; so does this signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        t.start()  # inside the try: a tiny delay can fire before start() returns
        fn()
        t.join()
        time.sleep(0.01)  # a late signal lands here, outside fn
        return False
    except KeyboardInterrupt:
        return True
    finally:
        t.join()
        signal.signal(signal.SIGINT, previous)


def lines_run(fn) -> int:
    """How many Python lines ``fn()`` executes (in every frame it calls): the points a Ctrl+C can land."""
    count = [0]

    def tracer(frame, event, arg):
        if event == "line":
            count[0] += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count[0]


def interrupted_at_line(fn, n: int) -> bool:
    """Run ``fn()`` with a real SIGINT raised as its ``n``-th Python line starts; True if it interrupted ``fn``.

    Deterministic where a timer thread is not: every point of a fast operation can be hit in turn.
    The signal goes through the installed handler, so code that holds Ctrl+C back holds this back too.
    """
    count = [0]

    def tracer(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] == n:
                sys.settrace(None)
                frame.f_trace = None
                signal.raise_signal(signal.SIGINT)
                return None
        return tracer

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sys.settrace(tracer)
        try:
            fn()
        finally:
            sys.settrace(None)
        time.sleep(0.001)  # a signal still pending lands here, outside fn
        return False
    except KeyboardInterrupt:
        return True
    finally:
        signal.signal(signal.SIGINT, previous)
