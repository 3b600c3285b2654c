"""Ctrl+C at a chosen moment: SIGINT to the main thread from a timer thread, as a terminal sends it."""

from __future__ import annotations

import signal
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
