"""Pipeline stages on threads of their own: merging, writing and hashing overlap.

torch kernels, file writes and hashlib release the GIL, so the stages really run on all cores. Queues are
short: memory holds a few chunks, whatever the model size.
"""

from __future__ import annotations

import queue
import threading

from lora_merge.stage_clock import charge_thread


class OrderedWorker:
    """Runs submitted calls one after another, in order, on a thread of its own. After a call fails the
    rest are skipped, and the failure is raised to the submitting thread at its next submit or close."""

    def __init__(self, name: str, depth: int):
        self.name = name
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            charge_thread(self.name.removeprefix("lora-merge-"))

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is None:
                call, args = item
                try:
                    call(*args)
                except BaseException as exc:  # handed to the submitting thread
                    self._error = exc

    def submit(self, call, *args) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put((call, args))

    def check(self) -> None:
        """Raise the failure of a call, if one failed."""
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Wait until every submitted call has run; re-raise a failure."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """On the way out of a failed run: wait until the thread has ended (it runs what is queued: a few
        calls), dropping a failure: the run's own error is the one to report."""
        try:
            self.close()
        except BaseException:  # noqa: BLE001  (whatever it was: raised from here, it would skip the cleanup after)
            pass


class BackgroundWriter:
    """`write(name, tensor, then)` calls on a writer thread, so reading and merging the next chunk overlaps
    writing this one. `then`, if given, is handed to the write function, to call once it is done with the
    tensor."""

    def __init__(self, write, depth: int = 3):
        self._write = write
        self._worker = OrderedWorker("lora-merge-writer", depth)

    def write(self, name, tensor, then=None) -> None:
        self._worker.submit(self._write, name, tensor, then)

    def close(self) -> None:
        """Wait until everything queued is written; re-raise a write error."""
        self._worker.close()

    def stop(self) -> None:
        """On the way out of a failed run: let the writer thread end, so that the files are not closed under
        a write in progress (OrderedWorker.stop)."""
        self._worker.stop()
