"""The `lora-merge` command. Signals are handled from the first instant — importing torch takes seconds,
and Ctrl-C or SIGTERM then must give one line, not a traceback or a silent death — and ignored from the
moment the output begins to be published (or the run has finished) until the process exits, so a signal
arriving after a successful publish cannot turn it into a failure or kill the process."""

from __future__ import annotations

import sys

from lora_merge.allocator import reuse_freed_chunks
from lora_merge.console import Console
from lora_merge.interrupts import RECEIVED, Interrupted, ignore_signals, signals_raise


def main() -> int:
    console = Console()  # only interruptions are reported here; the command's own options set its Console
    with signals_raise(until_exit=True):
        try:
            from lora_merge.cli import main as run
        except Interrupted as exc:
            console.interrupted(f"interrupted by {exc.name} while starting; no output was written")
            return exc.exit_code
        except KeyboardInterrupt:
            console.interrupted("interrupted while starting; no output was written")
            return 130
        except BaseException:
            # A library caught the signal's exception inside an import and failed otherwise (a half-imported
            # module, an import error wrapping it): the signal is still what stopped the start.
            if not RECEIVED:
                raise
        if RECEIVED:  # raised inside an import that swallowed it
            exc = Interrupted(RECEIVED[0])
            console.interrupted(f"interrupted by {exc.name} while starting; no output was written")
            return exc.exit_code
        reuse_freed_chunks()
        try:
            code = run()
            ignore_signals()
        except Interrupted as exc:  # after the command had caught everything: while it reported its outcome
            from lora_merge.cli import what_was_written
            console.interrupted(f"interrupted by {exc.name}; {what_was_written()}")
            code = exc.exit_code
        from lora_merge.stage_clock import write_if_asked
        write_if_asked()
        return code


if __name__ == "__main__":
    sys.exit(main())
