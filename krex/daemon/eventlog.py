"""The JSONL event log: one line per region or job event.

Each line carries ``mono_s`` (CLOCK_MONOTONIC seconds, comparable with the jobs'
own ``time.monotonic()``) and ``wall_s`` (Unix time) so the log can be
checked against timestamps the jobs record themselves.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from typing import Any

FLUSH_INTERVAL_S = 0.02


class EventLog:
    """Timestamps are taken in ``emit``; encoding and writing happen on a writer thread,
    off the grant path; a line reaches the file within ~20 ms."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        if path:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._file = os.fdopen(fd, "a")
            self._writer = threading.Thread(target=self._write_loop, name="krex-events",
                                            daemon=True)
            self._writer.start()

    def emit(self, event: str, **fields: Any) -> None:
        if self._writer is not None:
            self._queue.put({"event": event, "mono_s": time.monotonic(), "wall_s": time.time(),
                             **fields})

    def _write_loop(self) -> None:
        # Wake on a period rather than per event: a thread woken per event competes
        # with the session threads for the GIL right on the grant path.
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            while not self._queue.empty():
                line = self._queue.get()
                if line is None:
                    self._file.close()
                    return
                self._file.write(json.dumps(line, separators=(",", ":"), default=str) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Write everything queued so far, then stop the writer."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(5)
            self._writer = None


def read_events(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
