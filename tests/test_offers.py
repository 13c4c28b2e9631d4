"""Offers: a re-queued region granted to a job is offered to it, and the job's next
plain acquire takes it without a round trip (docs/protocol.md, "Offers").

What must hold: an offered region is as exclusive as any other (the jobs' own clocks
never see two regions at once); a stale offer is not taken; a claim that left after
the window is answered before the region is used, and a lapsed one falls back to a
plain acquire; a claim the daemon refuses is raised at the region's release, never
passed as held (the negative control: an offer made to lie about its window)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time

from daemon_support import daemon_counters, freezing_daemon, start_steps, step_rows
from helpers import PY, REPO, bare_connection

from krex.client.connection import Connection
from krex.protocol import messages as m

LATE = os.path.join(REPO, "tests", "jobs", "offer_late.py")


def test_plain_loops_take_their_offers_and_stay_exclusive(runtime_dir):
    """Two plain loops of 3 ms regions: most re-queued regions are taken from their
    offers (the claim window is wide, so a loaded machine's slow thaw does not lapse
    them); every region is released, and in the jobs' own clocks each region starts
    after the previous one's release was handled."""
    with freezing_daemon(runtime_dir, "--requeue-ms", "300") as (d, procs):
        procs += [start_steps(d, *["r0.003"] * 60) for _ in range(2)]
        a, b = step_rows(procs[0]), step_rows(procs[1])
        counters = daemon_counters(d)
    assert counters["offers_claimed"] >= 20, counters
    assert counters["offers_lapsed"] == 0, counters
    assert counters["offered"] >= counters["offers_claimed"], counters
    rows = sorted(a + b, key=lambda r: r["entered"])
    assert all(r["report"]["outcome"] == "released" for r in rows), rows
    for prev, nxt in zip(rows, rows[1:], strict=False):
        assert nxt["entered"] >= prev["report"]["released_mono_s"], (prev, nxt)
    # and none began before the daemon granted it (an offered region's report counts
    # from its claim: the grant was ``unclaimed_s`` before that)
    for r in rows:
        rep = r["report"]
        assert r["entered"] >= rep["granted_mono_s"] - rep["unclaimed_s"], r


def _late(runtime_dir, mode: str, window_ms: int = 20,
          windows: float = 3.0) -> tuple[dict, dict]:
    """offer_late.py in ``mode`` beside a loop of 20 ms regions, the offer let go for
    ``windows`` claim windows; its line and the daemon's counters."""
    with freezing_daemon(runtime_dir, "--requeue-ms", str(window_ms)) as (d, procs):
        procs.append(start_steps(d, *["r0.02"] * 3000))  # reaped once offer_late.py is done
        env = {**os.environ, "KREX_SOCKET": d.socket}
        x = subprocess.Popen([PY, LATE, mode, str(window_ms / 1e3), str(windows)],
                             stdout=subprocess.PIPE, text=True, env=env)
        procs.append(x)
        out, _ = x.communicate(timeout=120)
        assert x.returncode == 0, out
        counters = daemon_counters(d)
    return json.loads(out.strip().splitlines()[-1]), counters


def test_a_stale_offer_is_not_taken(runtime_dir):
    line, counters = _late(runtime_dir, "normal")
    assert line["error"] is None and not line["offered"], line
    assert line["region"] != line["offer"], line
    assert counters["requeue_lapsed"] >= 1 and counters["offers_lapsed"] == 0, counters


def test_a_claim_sent_after_the_window_is_answered_first_and_falls_back(runtime_dir):
    line, counters = _late(runtime_dir, "late")
    assert line["error"] is None and not line["offered"], line  # asked as usual
    assert line["region"] != line["offer"], line
    assert counters["offers_lapsed"] >= 1, counters  # the claim was refused


def test_a_refused_claim_is_raised_at_the_release_never_passed_as_held(runtime_dir):
    """The negative control: an offer that lies about its window is taken at once; the
    daemon refuses the claim (the region lapsed) and the release raises it."""
    line, counters = _late(runtime_dir, "lie")
    assert line["offered"] and line["region"] == line["offer"], line
    assert line["error"] == "offer_lapsed", line
    assert counters["offers_lapsed"] >= 1, counters


def test_a_claim_that_arrives_within_the_grace_is_honoured(runtime_dir):
    """A claim that arrives after the window but within its grace (the second window)
    is the job's region: the grace is what makes a claim sent within the window always
    arrive in time.  (The test above is the control: after both windows it is refused.)"""
    line, counters = _late(runtime_dir, "lie", window_ms=200, windows=1.3)
    assert line["offered"] and line["region"] == line["offer"], line
    assert line["error"] is None, line
    assert counters["offers_lapsed"] == 0, counters


def test_a_claim_sent_in_time_but_read_late_is_honoured(runtime_dir):
    """A claim that left in time but that the daemon has not read when the offer's
    grace ends (its first bytes in, as when the daemon's thread waits for a CPU) holds
    the lapse back: the region is the job's.  Control: past MAX_LAPSE_WAITS more windows
    the lapse no longer waits, and the release raises ``offer_lapsed``."""
    line, counters = _late(runtime_dir, "split", window_ms=200, windows=4)
    assert line["offered"] and line["region"] == line["offer"], line
    assert line["error"] is None, line
    assert counters["lapses_waited"] >= 1 and counters["offers_lapsed"] == 0, counters
    line, counters = _late(runtime_dir, "split", window_ms=200, windows=14)
    assert line["offered"] and line["error"] == "offer_lapsed", line
    assert counters["lapses_waited"] >= 8, counters


def _conn() -> tuple[Connection, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return bare_connection(ours), theirs


def test_an_offer_is_taken_only_by_its_own_jobs_plain_acquire():
    conn, theirs = _conn()
    try:
        def offer(**kw) -> dict:
            o = {"type": "offer", "region": 9, "job_id": 3, "device": "cpu",
                 "tenant": "uid:0", "claim_by_mono_s": time.monotonic() + 60,
                 "job_device": True, "job_tenant": True, **kw}
            conn.offers = {9: o}
            return o

        plain = m.Acquire(job_id=3, device="cpu")
        o = offer()
        assert conn._offer_for(plain) == o
        assert conn.offers == {}  # taken or not, an offer is for one acquire
        offer()
        assert conn._offer_for(m.Acquire(job_id=3)) is not None  # the job's own device
        for kw, msg in (({}, m.Acquire(job_id=4, device="cpu")),
                        ({}, m.Acquire(job_id=3, device="fakegpu:0")),
                        ({"job_device": False}, m.Acquire(job_id=3)),
                        ({"job_tenant": False}, m.Acquire(job_id=3, device="cpu")),
                        ({}, m.Acquire(job_id=3, device="cpu", tenant="other")),
                        ({}, m.Acquire(job_id=3, device="cpu", whole_job=True)),
                        ({"claim_by_mono_s": time.monotonic() + 0.0005}, plain)):
            offer(**kw)
            assert conn._offer_for(msg) is None, (kw, msg)
        conn._newest_region = 9  # granted already (its offer came first): stale
        offer()
        assert conn._offer_for(plain) is None
    finally:
        conn.sock.close()
        theirs.close()


def test_a_sessions_unhandled_input_is_seen_wherever_it_waits():
    """What holds a lapse back (Session.input_pending): bytes still in the socket's
    queue, bytes in the reader's buffer, or a frame being handled; none of them: no."""
    from krex.daemon.server import Session
    from krex.protocol.framing import FrameReader

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        session = Session(ours, None, None)  # type: ignore[arg-type]
        session.reader = FrameReader(ours)
        assert not session.input_pending()  # the control
        theirs.sendall(b"\0\0")
        assert session.input_pending()  # in the socket's queue
        ours.settimeout(0.2)
        with contextlib.suppress(TimeoutError):
            session.reader.read()  # takes the two bytes, waits for the rest of a header
        assert session.reader.buffered() == 2 and session.input_pending()  # in the reader
        session.reader = FrameReader(ours)
        assert not session.input_pending()
        session.handling = True
        assert session.input_pending()
    finally:
        ours.close()
        theirs.close()
