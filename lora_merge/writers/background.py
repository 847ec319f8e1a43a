"""Write on a second thread, so reading and merging the next chunk overlaps writing this one.

torch kernels and file writes release the GIL, so the two threads really run on both cores. The queue is
short: memory holds a few chunks, whatever the model size.
"""

from __future__ import annotations

import queue
import threading


class BackgroundWriter:
    def __init__(self, write, depth: int = 3):
        self._write = write
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lora-merge-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            name, tensor, then = item
            if self._error is None:
                try:
                    self._write(name, tensor)
                    if then is not None:
                        then()
                except BaseException as exc:  # handed to the producing thread
                    self._error = exc

    def write(self, name, tensor, then=None) -> None:
        """Queue `tensor` for writing; `then()`, if given, runs on the writer thread once it is written."""
        if self._error is not None:
            raise self._error
        self._queue.put((name, tensor, then))

    def close(self) -> None:
        """Wait until everything queued is written; re-raise a write error."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
