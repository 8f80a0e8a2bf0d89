"""An attention rank's outgoing step outputs, encoded and sent from a thread of their own.

A step's `Outputs` (one message for every request the step changed, and the rank's stats) is
JSON-encoded field by field (codec.py) and written to the frontend's socket: per-request Python
work that would otherwise sit between two steps. Handed to this thread, it runs while the next
step is scheduled and runs its forward (torch releases the interpreter lock in its kernels and
device waits), as vLLM's engine core sends its outputs from a thread beside its busy loop.

Messages leave in the order given. The queue is bounded, so a frontend that stops reading still
holds the rank back (as a blocking send did) instead of letting outputs pile up. A send that
fails is raised by the next `send`, or by `check` after `close`.
"""

from __future__ import annotations

import queue
import threading

from afdserve.afd.ranks.channel import Channel

# Steps' outputs waiting at most: enough to ride out a slow read, few enough to stay current.
MAX_QUEUED = 8


class OutputSender:
    def __init__(self, conn: Channel, max_queued: int = MAX_QUEUED) -> None:
        self.conn = conn
        self.error: BaseException | None = None
        self._queue: queue.Queue[object | None] = queue.Queue(max_queued)
        self._thread = threading.Thread(target=self._run, name="afdserve-outputs", daemon=True)
        self._thread.start()

    def send(self, message: object) -> None:
        self.check()
        self._queue.put(message)

    def close(self) -> None:
        """Send what is queued, then stop the thread (never raises: see `check`)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            if self.error is not None:
                continue  # the connection failed: drain, so that close() never blocks
            try:
                self.conn.send(message)
            except BaseException as e:  # raised again in the stepping thread
                self.error = e
