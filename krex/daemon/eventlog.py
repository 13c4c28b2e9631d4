"""The JSONL event log: one line per region or job event.

Each line carries ``mono_ns`` (CLOCK_MONOTONIC, comparable with the jobs'
own ``time.monotonic_ns()``) and ``wall`` (Unix time) so the log can be
checked against timestamps the jobs record themselves.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class EventLog:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        if path:
            os.chmod(path, 0o600)

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = {"event": event, "mono_ns": time.monotonic_ns(), "wall": time.time(), **fields}
        text = json.dumps(line, separators=(",", ":"), default=str)
        with self._lock:
            self._file.write(text + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file:
                self._file.close()
                self._file = None


def read_events(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
