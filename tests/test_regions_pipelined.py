"""``krex.regions(n)``: back-to-back regions whose next request goes with each release.

Through a real daemon (freezing on: a job is frozen while another holds the device):
two jobs taking back-to-back regions that wait for each release's report leave the
device waiting at every chain's end (the outgoing holder is frozen before it can ask
again, so when the other releases nobody is queued); pipelined, the job is still queued
and every handoff goes straight to it, and so it is for a plain loop, whose release
does not wait (it asks again before the handoff freezes it).  Also: leaving the loop
early leaves nothing held or queued, and a reply to a pipelined request read while
another is waited for is kept, not dropped.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from daemon_support import freezes, loop_rows, start_loops
from helpers import bare_connection, steal_ms

import krex
from krex.client.connection import Client
from krex.protocol import messages as m
from krex.protocol.framing import FrameReader, encode_frame

N, HOLD_MS = 40, 3.0


def _two_jobs(how: str) -> list[dict]:
    return loop_rows(start_loops(how, N, HOLD_MS)[0])


def _chain_ends(rows: list[dict]) -> int:
    """Handoffs to the other job where it was not queued when the device was released:
    the device waited for it to ask."""
    return sum(1 for a, b in zip(rows, rows[1:], strict=False)
               if a["job"] != b["job"] and b["requested"] > a["released"])


def _on_daemon(tmp_path, monkeypatch, name: str, *args: str,
               how: str = "plain") -> tuple[list[dict], dict]:
    """Two loops (``how``: see tests/jobs/regions_loop.py) on a daemon of their own,
    started with ``args``: their rows, and the daemon's counters after them."""
    from helpers import Daemon

    (tmp_path / name).mkdir(mode=0o700)
    d = Daemon(str(tmp_path / name), *args)
    d.start()
    try:
        with monkeypatch.context() as mp:
            mp.setenv("KREX_SOCKET", d.socket)
            rows = _two_jobs(how)
        with Client(d.socket, autostart=False) as c:
            return rows, c.status()["counters"]
    finally:
        d.stop()


def test_pipelined_regions_keep_the_job_queued_so_no_chain_ends(daemon, tmp_path,
                                                                 monkeypatch):
    if not freezes(daemon):
        pytest.skip("no freeze backend here: a job is not frozen while another holds")
    pipelined = _two_jobs("pipelined")
    # plain: the daemon queues each job again at its release (--requeue-ms), and the
    # thawed job claims that region when it asks.  The default window (5 ms) is about
    # what a thawed job takes beside a CPU loop (4.9 ms seen), and a claim the host
    # stole past it lapses and backs off (a CI run: 18 of 40 set up): the mechanism is
    # tested with a window noise does not reach; bench_regions.py measures the default.
    # Even so a CI run beside a CPU loop once set up 13 of 40: up to three attempts, with
    # what the host stole meanwhile (the control below sets up about half every time).
    seen = []
    for attempt in range(3):
        stolen = steal_ms()
        plain, counters = _on_daemon(tmp_path, monkeypatch, f"rt50-{attempt}",
                                     "--requeue-ms", "50")
        assert len(plain) == 2 * N
        seen.append((sum(not r["handed_over"] for r in plain), steal_ms() - stolen,
                     counters["chain_ends"]))
        # the daemon's count of handoffs is the reports', plus the two warm-up regions
        # (no row; the second may be handed over) and re-queued regions handed over and
        # then lapsed (no report)
        reported = sum(r["handed_over"] for r in plain)
        assert reported <= counters["handed_over"] <= \
            reported + 2 + counters["requeue_lapsed"], counters
        if seen[-1][0] <= N // 4:
            break
    for rows in (plain, pipelined):
        assert len(rows) == 2 * N
        assert all(b["granted"] >= a["released"] for a, b in zip(rows, rows[1:], strict=False))
    switches = sum(1 for a, b in zip(pipelined, pipelined[1:], strict=False)
                   if a["job"] != b["job"])
    # pipelined: the other job asked before the release (its request went with its own
    # last release), so the device was handed straight on, alternating between the jobs
    assert switches >= N and _chain_ends(pipelined) <= 2, pipelined
    # ... taken over, not set up anew (the report says so); the first region is set up
    assert sum(not r["handed_over"] for r in pipelined) <= 3, pipelined
    # plain: re-queued, most handoffs went straight to the other job too
    assert seen[-1][0] <= N // 4, f"(set up, steal ms, chain ends) per attempt: {seen}"
    # control: without re-queueing, a loop that reads each report before its next region
    # waits for the release's reply, so its outgoing holder is frozen before it asks again
    # (the report is made after the handoff), and its chains end
    read, counters = _on_daemon(tmp_path, monkeypatch, "rt0-read", "--requeue-ms", "0",
                                how="plain-read")
    assert _chain_ends(read) >= N // 2, read  # 40-54 of 80 on the quiet 2-core machine
    assert sum(not r["handed_over"] for r in read) >= N // 4, read
    # ... and the daemon says why: nobody was queued at those releases
    assert counters["chain_ends"].get("nobody_queued", 0) >= N // 4, counters


def test_a_plain_loop_asks_again_before_the_handoff_freezes_it(daemon, tmp_path,
                                                                monkeypatch):
    """A release does not wait for its report: the plain loop's next acquire is sent
    while the daemon hands the device on, before the handoff freezes the job, so even
    without re-queueing (``--requeue-ms 0``) the other job is queued at each release
    and the chain goes on.  Control: the same loop reading each report before its next
    region is frozen before it asks (the test above).

    With the shield, as daemons run by default: without it, the daemon's thread that
    carries the release out may be woken on the releasing holder's own core and run
    there first, and an unmanaged task (a CPU loop beside the suite) may hold that
    core, so the job does not get to ask before the freeze (half the chains ended)."""
    if not freezes(daemon):
        pytest.skip("no freeze backend here: a job is not frozen while another holds")
    from helpers import skip_if_another_daemon_owns_the_shield

    skip_if_another_daemon_owns_the_shield()
    monkeypatch.setenv("KREX_SHIELD", "on")
    plain, counters = _on_daemon(tmp_path, monkeypatch, "rt0-plain", "--requeue-ms", "0")
    assert len(plain) == 2 * N
    assert all(b["granted"] >= a["released"] for a, b in zip(plain, plain[1:], strict=False))
    # 0-6 chain ends of 80 handoffs mostly, 11-13 in 3 of 22 runs alone beside a CPU
    # loop on the 2-core machine (a fresh clone's suite read 11 so, and the code of the
    # morning did the same); the control, reading each report, 40-54
    most = 3 * N // 8
    assert _chain_ends(plain) <= most, plain
    assert sum(not r["handed_over"] for r in plain) <= most, plain
    assert counters["chain_ends"].get("nobody_queued", 0) <= most, counters


@pytest.mark.parametrize("leave", ["break", "raise"])
def test_leaving_the_loop_early_leaves_nothing_held_or_queued(daemon, leave):
    """The region in hand is released and no further request is left behind: another
    region is granted at once.  Control: the loop ran (the regions were granted)."""
    seen = []
    with pytest.raises(RuntimeError) if leave == "raise" else contextlib.nullcontext():
        for r in krex.regions(5, "cpu"):
            seen.append(r.region_id)
            if len(seen) == 2:
                if leave == "raise":
                    raise RuntimeError("the candidate failed")
                break
    assert len(seen) == 2 and all(seen)
    with Client(daemon.socket, autostart=False) as c:
        status = c.status()
    assert not _held_or_queued(status), status
    t0 = time.monotonic()
    with krex.region("cpu", timeout_s=5):
        pass
    assert time.monotonic() - t0 < 5


def _held_or_queued(status: dict) -> list:
    return [x for dev in status["scheduler"].values()
            for x in ([dev["holder"]] if dev["holder"] else []) + dev["queue"]]


def test_a_pipelined_reply_read_early_is_kept_for_its_own_wait():
    """The daemon may answer a pipelined acquire before the release sent ahead of it;
    the release's wait keeps that grant for the acquire's.  Control: a request not sent
    as pipelined has its stray reply skipped, as before."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = bare_connection(ours)

    def answer(order: list[int], data: dict[int, dict]) -> None:
        reader = FrameReader(theirs)
        for _ in order:
            reader.read()
        for rid in order:
            theirs.sendall(encode_frame({"type": "ok", "re": rid, "data": data[rid]}))

    try:
        for pipelined in (True, False):
            order = [2, 1] if pipelined else [4, 3, 5]
            t = threading.Thread(target=answer, args=(order, {
                1: {"report": "r1"}, 2: {"region": 7}, 3: {"report": "r3"}, 4: {"region": 8},
                5: {"fine": True}}))
            t.start()
            rel = conn.send(m.Release(region=6))
            acq = conn.send(m.Acquire(job_id=1, device="cpu"), pipelined=pipelined)
            if not pipelined:
                conn.send(m.Status())
            assert conn.wait_reply(rel) == {"report": "r1" if pipelined else "r3"}
            if pipelined:
                assert conn.wait_reply(acq) == {"region": 7}
            else:  # skipped: the next reply read is the status's
                assert conn.wait_reply(5) == {"fine": True} and not conn._early
            t.join(5)
    finally:
        ours.close()
        theirs.close()


def test_one_job_alone_takes_its_regions_one_after_another(daemon):
    """Nobody else on the device: each pipelined request is the next grant (the job's own
    region handed to itself); every region is released with a report, none overlaps."""
    reports = []
    for r in krex.regions(20, "cpu"):
        assert r.region_id is not None
        reports.append(r)
    rows = [r.report for r in reports]
    assert len({r.region for r in rows}) == 20
    assert all(r.outcome.value == "released" for r in rows), [r.outcome for r in rows]
    assert all(b.granted_mono_s >= a.released_mono_s for a, b in zip(rows, rows[1:],
                                                                      strict=False))
    with Client(daemon.socket, autostart=False) as c:
        assert not _held_or_queued(c.status())


def test_a_refused_next_request_still_releases_and_says_why(runtime_dir, monkeypatch):
    """The daemon answers ``again`` like any acquire: refused (here: one region per
    connection), the error is that request's reply, the release goes ahead with its
    report, and nothing is left held.  Control: the same daemon serves plain regions."""
    from helpers import Daemon

    from krex.errors import LimitExceeded

    d = Daemon(str(runtime_dir), "--max-acquires-per-connection", "1")
    d.start()
    monkeypatch.setenv("KREX_SOCKET", d.socket)
    try:
        seen = []
        with pytest.raises(LimitExceeded, match="max-acquires-per-connection"):
            for r in krex.regions(3, "cpu"):
                seen.append(r)
        assert len(seen) == 1 and seen[0].report is not None
        assert seen[0].report.outcome.value == "released"
        for _ in range(2):  # control: plain regions, one at a time, are fine
            with krex.region("cpu") as plain:
                pass
            assert plain.report is not None
        with Client(d.socket, autostart=False) as c:
            assert not _held_or_queued(c.status())
    finally:
        d.stop()
