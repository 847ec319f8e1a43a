"""SIGINT, SIGTERM and SIGHUP (Ctrl-C, `timeout`, Slurm, a closed terminal) all stop a run the same way:
as an exception in the main thread, so every `finally` removes what the run staged. Further signals are
ignored while it cleans up, so a second Ctrl-C cannot leave a half-removed staging directory."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process killed by the signal


# Signals received: library code may swallow the exception (a bare `except:` while torch imports), so the
# caller also checks this.
RECEIVED: list[int] = []


def raise_if_received() -> None:
    """Raise the interruption a library swallowed: call after importing one (torch and transformers are
    imported once the arguments are parsed, inside the run)."""
    if RECEIVED:
        raise Interrupted(RECEIVED[0])


def _raise(signum, frame):
    ignore_signals()
    RECEIVED.append(signum)
    raise Interrupted(signum)


def ignore_signals() -> None:
    """From here on the process finishes what it does (cleanup, or exiting after success) undisturbed."""
    for sig in HANDLED:
        signal.signal(sig, signal.SIG_IGN)


@contextmanager
def signals_raise():
    """Within the block, the handled signals raise Interrupted (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # A signal ignored on entry (nohup ignores SIGHUP, a shell's background job SIGINT) stays ignored.
    previous = {sig: signal.getsignal(sig) for sig in HANDLED if signal.getsignal(sig) is not signal.SIG_IGN}
    for sig in previous:
        signal.signal(sig, _raise)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
