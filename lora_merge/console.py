"""Everything the command tells its user goes through one `Console`, so that `-q` and `-v` mean the same in
every subcommand:

- errors: always, on stderr, one line each (`lora-merge: error: …`), and what a failed verification found
  (the error's detail, on stdout);
- warnings: on stderr, unless `--quiet`;
- results (plans, summaries, inspect's description, verify's counts) and notes: on stdout, unless `--quiet`;
- details (every tensor, every file): on stdout, only with `--verbose`;
- the progress bar: on stderr, unless `--quiet` or `--no-progress` (and only on a terminal).

The streams are looked up at each call, not kept, so a caller that swaps sys.stdout (a test) sees the output.
"""

from __future__ import annotations

import sys

QUIET, NORMAL, VERBOSE = 0, 1, 2
PREFIX = "lora-merge"


class Console:
    def __init__(self, level: int = NORMAL):
        self.level = level

    @property
    def verbose(self) -> bool:
        return self.level >= VERBOSE

    def error(self, message: str) -> None:
        print(f"{PREFIX}: error: {message}", file=sys.stderr)

    def problem(self, message: str) -> None:
        print(f"  problem: {message}")

    def interrupted(self, message: str) -> None:
        print(f"{PREFIX}: {message}", file=sys.stderr)

    def warn(self, message: str) -> None:
        if self.level >= NORMAL:
            print(f"{PREFIX}: warning: {message}", file=sys.stderr)

    def note(self, message: str) -> None:
        if self.level >= NORMAL:
            print(f"note: {message}")

    def result(self, line: str = "") -> None:
        if self.level >= NORMAL:
            print(line)

    def detail(self, line: str) -> None:
        if self.level >= VERBOSE:
            print(line)

    def progress_bar(self, enabled: bool = True) -> "ProgressBar | None":
        return ProgressBar() if enabled and self.level >= NORMAL else None


class ProgressBar:
    """The API's progress(done, total) callback as a tqdm bar on stderr (none when stderr is not a terminal)."""

    def __init__(self):
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="merging", file=sys.stderr, disable=None,
                            dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
