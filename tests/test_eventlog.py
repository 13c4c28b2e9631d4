"""The event log never stops the daemon: a bounded queue, and a writer that outlives errors."""

from __future__ import annotations

import errno
import threading
import time

from krex.daemon.eventlog import EventLog, read_events


class FlakyFile:
    """A file whose writes fail with ENOSPC while ``full`` is set (cut mid-line once)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.full = threading.Event()
        self.cut_next = False

    def write(self, data: bytes) -> int:
        if self.cut_next:
            self.cut_next = False
            self.data += data[: len(data) // 2]
            return len(data) // 2
        if self.full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        self.data += data
        return len(data)


def wait_written(f: FlakyFile, text: bytes, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in f.data:
        assert time.monotonic() < deadline, f"{text!r} never written"
        time.sleep(0.01)


def test_write_errors_lose_lines_but_not_the_writer(tmp_path):
    f = FlakyFile()
    log = EventLog("(test)", writer=f.write)
    log.emit("before")
    wait_written(f, b"before")
    f.full.set()
    for i in range(5):
        log.emit("lost", i=i)
    time.sleep(0.2)  # written (and failed) meanwhile
    f.full.clear()
    log.emit("after")
    wait_written(f, b"after")
    log.close()
    path = tmp_path / "events.jsonl"
    path.write_bytes(bytes(f.data))
    events = read_events(str(path))
    assert [e["event"] for e in events] == ["before", "events_lost", "after"]
    assert events[1]["count"] == 5 and log.lost == 5


def test_a_line_cut_short_is_skipped_not_fatal(tmp_path):
    f = FlakyFile()
    log = EventLog("(test)", writer=f.write)
    f.cut_next = True
    f.full.set()  # the rest of the cut write fails
    log.emit("cut")
    time.sleep(0.2)
    f.full.clear()
    log.emit("whole")
    log.close()
    path = tmp_path / "events.jsonl"
    path.write_bytes(bytes(f.data))
    assert [e["event"] for e in read_events(str(path))] == ["events_lost", "whole"]


def test_the_queue_is_bounded(tmp_path):
    stuck = threading.Event()

    def writer(data: bytes) -> int:
        stuck.wait(10)  # a writer that cannot keep up (a hung disk)
        return len(data)

    log = EventLog("(test)", max_queue=100, writer=writer)
    for i in range(1000):
        log.emit("e", i=i)
    assert len(log._queue) <= 100
    assert log.lost >= 800
    stuck.set()
    log.close()
