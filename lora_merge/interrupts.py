"""SIGINT, SIGTERM and SIGHUP (Ctrl-C, `timeout`, Slurm, a closed terminal) all stop a run the same way:
as an exception in the main thread, so every `finally` removes what the run staged.

From the first of these on, the handled signals are ignored until the process exits: once a signal has
interrupted the run (so a second Ctrl-C cannot leave a half-removed staging directory), and once the output
begins to be published (so a signal cannot turn a published output into a failure, or kill the process with
it complete). Only the outermost `signals_raise` block sets handlers, and one opened with `until_exit` (the
command's entry point) leaves them ignored when it ends; elsewhere (the CLI called in-process, as the tests
do) the handlers are restored. The Python API sets no handlers and ignores nothing."""

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


class _State:
    active = False  # within the outermost signals_raise block, in the main thread
    ignoring = False  # ignore_signals was called within it
    armed: tuple = ()  # the signals that block raises (those not ignored on entry)


def ignore_signals() -> None:
    """From here on the process finishes what it does (cleanup, publishing, exiting) undisturbed. Where no
    signals_raise block is active (the Python API, another thread) this does nothing: a library must not
    change its caller's signal handling. A signal that arrived just before is raised here (signal.signal
    runs pending handlers first), so it still counts as arriving before this point."""
    if not _State.active or threading.current_thread() is not threading.main_thread():
        return
    for sig in HANDLED:
        signal.signal(sig, signal.SIG_IGN)
    _State.ignoring = True


@contextmanager
def signals_raise(until_exit: bool = False):
    """Within the block, the handled signals raise Interrupted (main thread only; a no-op elsewhere, and
    inside another such block, which owns the handlers). With `until_exit`, signals ignored by then stay
    ignored after the block."""
    if threading.current_thread() is not threading.main_thread() or _State.active:
        yield
        return
    # A signal ignored on entry (nohup ignores SIGHUP, a shell's background job SIGINT) stays ignored.
    previous = {sig: signal.getsignal(sig) for sig in HANDLED if signal.getsignal(sig) is not signal.SIG_IGN}
    for sig in previous:
        signal.signal(sig, _raise)
    _State.active, _State.ignoring, _State.armed = True, False, tuple(previous)
    try:
        yield
    finally:
        keep_ignored = until_exit and _State.ignoring
        _State.active = False
        if not keep_ignored:
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def raising_again():
    """After ignore_signals, within the signals_raise block: the signals raise again inside this block (an upload
    of an output already complete on local disk can still be stopped), and are ignored again after it. A no-op
    where signals are not being ignored (the Python API, another thread, before the point of no return)."""
    if not _State.active or not _State.ignoring or threading.current_thread() is not threading.main_thread():
        yield
        return
    for sig in _State.armed:
        signal.signal(sig, _raise)
    _State.ignoring = False
    try:
        yield
    finally:
        ignore_signals()
