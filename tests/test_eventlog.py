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


def test_the_log_rotates_past_its_budget_and_keeps_the_part_before(tmp_path):
    """10 000 events (about 1 MB) into a 64 KB budget: the file and its previous part stay
    near the budget each, the newest events are in the file, the part before them in
    ``.1``, and a ``log_rotated`` line begins each new file.  Control: without a budget
    the same events make one file holding them all."""
    path = str(tmp_path / "events.jsonl")
    log = EventLog(path, max_queue=20000, max_bytes=64 * 1024)
    for i in range(10000):
        log.emit("region_granted", region=i, pad="x" * 60)
    log.close()
    import os

    size, older = os.path.getsize(path), os.path.getsize(path + ".1")
    assert log.rotations >= 10
    assert size <= 64 * 1024 * 9 // 8  # plus one piece of a flush (an eighth) at most
    assert older <= 64 * 1024 * 9 // 8
    events = read_events(path)
    assert events[0]["event"] == "log_rotated"
    assert events[-1]["region"] == 9999
    before = read_events(path + ".1")
    assert before[-1]["region"] == events[1]["region"] - 1  # nothing lost between the two

    plain = str(tmp_path / "plain.jsonl")
    log = EventLog(plain, max_queue=20000)
    for i in range(10000):
        log.emit("region_granted", region=i, pad="x" * 60)
    log.close()
    assert len(read_events(plain)) == 10000 and not os.path.exists(plain + ".1")
