"""The daemon core in-process, with a scripted enforcement: liveness, cancel, pages, accounts.

The enforcement here is a fake (tests/fakes.py) whose ``enter`` can be made to wait, so the
tests show what the core does while one device's enforcement is slow,
without root, cgroups or real siblings.  Real enforcement and real timers
are tested through a real daemon (test_daemon_liveness.py, test_regions.py).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from fakes import FakeSession, ScriptedExclusivity, next_id, request

from krex.daemon.config import DaemonConfig
from krex.daemon.core import Daemon
from krex.daemon.finished import BLOCK
from krex.enforce.process import ProcessRef
from krex.errors import AccessDenied, BadRequest, LimitExceeded, QuotaExceeded
from krex.protocol import messages as m
from krex.protocol.framing import MAX_FRAME, encode_frame
from krex.protocol.peer import Peer
from krex.protocol.report import Outcome, RegionReport


@pytest.fixture
def core(tmp_path):
    # the protocol as clients drive it: no fair window, no re-queueing (test_requeue.py)
    config = DaemonConfig(runtime_dir=str(tmp_path), fair_window_ms=0, requeue_ms=0)
    d = Daemon(config, exclusivity=ScriptedExclusivity())  # type: ignore[arg-type]
    yield d
    for gate in d.exclusivity.slow.values():  # type: ignore[attr-defined]
        gate.set()
    d.shutdown()


def job(d: Daemon, s: FakeSession, device: str) -> int:
    return d.handle(s, m.CreateJob(device=device, name="j", mode="region"))["job_id"]


def test_slow_enforcement_blocks_neither_status_nor_other_devices(core):
    """Before the lanes, ``handle(acquire)`` ran enforcement under the daemon's one lock:
    a slow set-up on fakegpu:0 held up status and every other device."""
    core.exclusivity.slow["fakegpu:0"] = threading.Event()
    a, b = FakeSession(), FakeSession()
    gpu_job, cpu_job = job(core, a, "fakegpu:0"), job(core, b, "cpu")
    slow = threading.Thread(target=request, args=(core, a, m.Acquire),
                            kwargs={"job_id": gpu_job}, daemon=True)
    slow.start()
    time.sleep(0.2)  # fakegpu:0's enforcement is now waiting
    t0 = time.monotonic()
    status = core.handle(b, m.Status())
    assert status["scheduler"]["fakegpu:0"]["holder"]["phase"] == "entering"
    rid = request(core, b, m.Acquire, job_id=cpu_job)
    grant = b.reply(rid, timeout_s=5)
    assert isinstance(grant, m.Reply), grant
    release = request(core, b, m.Release, region=grant.data["region"])
    assert b.reply(release).data["report"]["outcome"] == "released"
    assert time.monotonic() - t0 < 2.0  # not the 30 s the gpu's enforcement may wait
    core.exclusivity.slow["fakegpu:0"].set()
    slow.join(5)
    gpu_grant = a.pushed.get(timeout=5)  # the slow set-up ends in its grant
    assert isinstance(gpu_grant, m.Reply) and gpu_grant.data["device"] == "fakegpu:0"


def test_cancel_withdraws_a_queued_acquire(core):
    a, b = FakeSession(), FakeSession()
    ja, jb = job(core, a, "cpu"), job(core, b, "cpu")
    held = a.reply(request(core, a, m.Acquire, job_id=ja)).data["region"]
    waiting = request(core, b, m.Acquire, job_id=jb)
    assert core.status()["scheduler"]["cpu"]["queue"]
    reply = core.handle(b, m.Cancel(acquire=waiting))
    assert reply["cancelled"] == "queued"
    assert core.status()["scheduler"]["cpu"]["queue"] == []
    request(core, a, m.Release, region=held)
    time.sleep(0.3)
    assert core.status()["scheduler"]["cpu"]["holder"] is None  # nobody holds it for b
    assert core.handle(b, m.Cancel(acquire=waiting))["cancelled"] == "none"


def test_cancel_of_a_grant_in_flight_releases_it(core):
    """The grant was sent as the requester gave up: the region ends, nothing stays held."""
    s = FakeSession()
    j = job(core, s, "cpu")
    rid = request(core, s, m.Acquire, job_id=j)
    grant = s.reply(rid)  # granted; the client, interrupted, never read it
    reply = core.handle(s, m.Cancel(acquire=rid))
    assert reply == {"cancelled": "granted", "region": grant.data["region"]}
    deadline = time.monotonic() + 5
    while core.status()["scheduler"]["cpu"]["holder"] is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (rec,) = core.handle(s, m.Regions())["regions"]
    assert rec["outcome"] == "cancelled" and rec["clean"] is False


def test_regions_come_in_pages_that_fit_a_frame(core):
    s = FakeSession()
    big = {"label": "x" * 2000, "job_id": 1}
    for i in range(3000):
        core.finished.append((i + 1, os.getuid(), {**big, "region": i + 1}))
    reply = core.handle(s, m.Regions(limit=100000))
    assert len(encode_frame({"type": "ok", "data": reply})) < MAX_FRAME
    rows, before, pages = list(reply["regions"]), reply["next_before"], 1
    while before is not None:
        reply = core.handle(s, m.Regions(limit=m.PAGE_MAX, before=before))
        rows, before, pages = reply["regions"] + rows, reply["next_before"], pages + 1
    assert pages > 1 and [r["region"] for r in rows] == list(range(1, 3001))


def test_regions_limit_zero_is_none_and_negative_is_refused(core):
    s = FakeSession()
    for i in range(5):
        core.finished.append((i + 1, os.getuid(), {"region": i + 1, "job_id": 1}))
    assert core.handle(s, m.Regions(limit=0))["regions"] == []
    assert [r["region"] for r in core.handle(s, m.Regions(limit=2))["regions"]] == [4, 5]
    with pytest.raises(BadRequest):
        core.handle(s, m.Regions(limit=-1))


def test_acquires_per_connection_are_capped(tmp_path):
    config = DaemonConfig(runtime_dir=str(tmp_path), max_acquires_per_connection=2)
    d = Daemon(config, exclusivity=ScriptedExclusivity())  # type: ignore[arg-type]
    try:
        holder, s = FakeSession(), FakeSession()
        request(d, holder, m.Acquire, job_id=job(d, holder, "cpu"))
        j = job(d, s, "cpu")
        request(d, s, m.Acquire, job_id=j)
        request(d, s, m.Acquire, job_id=j)
        with pytest.raises(LimitExceeded):
            d.handle(s, m.Acquire(id=99, job_id=j))
        assert d.handle(FakeSession(), m.Status())  # others are served
    finally:
        d.shutdown()


def test_job_time_accounts(core):
    """waited_s, enforce_s, held_s of the holder; frozen_s of the sibling it stopped."""
    core.exclusivity.slow["cpu"] = gate = threading.Event()
    a, b, c = FakeSession(), FakeSession(), FakeSession()
    ja, jb = job(core, a, "cpu"), job(core, b, "cpu")
    for j in (ja, jb):  # jobs with a process: something to freeze
        core.jobs.jobs[j].root = ProcessRef.of(os.getpid())
    first = request(core, a, m.Acquire, job_id=ja)  # a's set-up waits on the gate
    rb = request(core, b, m.Acquire, job_id=jb)  # b queues behind it
    time.sleep(0.3)
    gate.set()
    ra = a.reply(first).data["region"]
    time.sleep(0.2)
    request(core, a, m.Release, region=ra)
    rb_region = b.reply(rb).data["region"]
    request(core, b, m.Release, region=rb_region)
    time.sleep(0.1)
    jobs = {j["job_id"]: j for j in core.handle(c, m.Jobs())["jobs"]}
    assert jobs[ja]["enforce_s"] >= 0.25 and jobs[ja]["held_s"] >= 0.15
    assert jobs[jb]["waited_s"] >= 0.45  # behind a's set-up and hold
    assert jobs[jb]["frozen_s"] >= 0.45  # a's region stopped b (b exists: a sibling)
    assert jobs[ja]["frozen_s"] < 0.2  # b's region: a was frozen only for its short hold
    assert jobs[ja]["regions"] == jobs[jb]["regions"] == 1
    # each region's record says how long it kept its sibling stopped: the job's account
    records = {r["job_id"]: r for r in core.handle(c, m.Regions())["regions"]}
    assert records[ja]["frozen_s"] == pytest.approx(jobs[jb]["frozen_s"])
    assert records[jb]["frozen_s"] == pytest.approx(jobs[ja]["frozen_s"])


def test_a_region_with_nobody_to_stop_kept_nobody_frozen(core):
    """Negative control of the region's ``frozen_s``: a lone job stops no sibling."""
    s = FakeSession()
    j = job(core, s, "cpu")
    core.jobs.jobs[j].root = ProcessRef.of(os.getpid())
    region = s.reply(request(core, s, m.Acquire, job_id=j)).data["region"]
    time.sleep(0.05)
    request(core, s, m.Release, region=region)
    (rec,) = core.handle(s, m.Regions())["regions"]
    assert rec["held_s"] >= 0.05 and rec["frozen_s"] == 0, rec


def test_a_region_whose_requester_left_during_set_up_is_undone_not_granted(core):
    """The connection closed while the grant's enforcement was being set up: it is
    undone as soon as it is in place and the next request gets the device."""
    core.exclusivity.slow["cpu"] = gate = threading.Event()
    a, b = FakeSession(), FakeSession()
    ja, jb = job(core, a, "cpu"), job(core, b, "cpu")
    request(core, a, m.Acquire, job_id=ja)
    time.sleep(0.1)  # a's set-up is waiting on the gate
    core.session_closed(a)
    rb = request(core, b, m.Acquire, job_id=jb)
    gate.set()
    grant = b.reply(rb)
    assert isinstance(grant, m.Reply) and a.pushed.empty()  # nothing sent to the gone one
    events = [e for e in core.handle(b, m.Regions())["regions"]]
    assert events == []  # a's region was never granted: no record of a hold


class OtherUser(FakeSession):
    def __init__(self, uid: int) -> None:
        super().__init__()
        self.peer = Peer(os.getpid(), uid, uid)


def node_core(tmp_path, **quota) -> Daemon:
    config = DaemonConfig(runtime_dir=str(tmp_path), node=True, group="0", **quota)
    return Daemon(config, exclusivity=ScriptedExclusivity())  # type: ignore[arg-type]


def test_only_a_trusted_peer_names_a_tenant(tmp_path):
    d = node_core(tmp_path)
    try:
        user, operator = OtherUser(4242), FakeSession()
        with pytest.raises(AccessDenied, match="may not act for tenant"):
            d.handle(user, m.CreateJob(device="cpu", name="j", tenant="someone-else"))
        mine = d.handle(user, m.CreateJob(device="cpu", name="j"))
        assert mine["tenant"] == "uid:4242"
        theirs = d.handle(operator, m.CreateJob(device="cpu", name="j", tenant="token-7"))
        assert theirs["tenant"] == "token-7"
        with pytest.raises(BadRequest, match="tenant id"):
            d.handle(operator, m.CreateJob(device="cpu", name="j", tenant="bad id!"))
    finally:
        d.shutdown()


def test_a_user_acts_only_on_its_own_jobs_and_regions(tmp_path):
    d = node_core(tmp_path)
    try:
        alice, bob = OtherUser(4242), OtherUser(4343)
        ja = d.handle(alice, m.CreateJob(device="cpu", name="a"))["job_id"]
        rid = request(d, alice, m.Acquire, job_id=ja)
        region = alice.reply(rid).data["region"]
        with pytest.raises(AccessDenied):
            d.handle(bob, m.Acquire(id=5, job_id=ja))
        with pytest.raises(AccessDenied):
            d.handle(bob, m.Revoke(region=region))
        with pytest.raises(AccessDenied):
            d.handle(bob, m.Stop())
        seen = d.handle(bob, m.Status())
        assert seen["jobs"] == [] and seen["other_jobs"] == 1
        assert seen["scheduler"]["cpu"]["holder"]["label"] is None  # not bob's to see
        assert d.handle(bob, m.Jobs())["jobs"] == []
    finally:
        d.shutdown()


def test_tenant_quotas_fail_with_clear_errors(tmp_path):
    d = node_core(tmp_path, tenant_max_jobs=1, tenant_max_hold_s=5.0,
                  tenant_region_s_per_min=0.2)
    try:
        user = OtherUser(4242)
        j = d.handle(user, m.CreateJob(device="cpu", name="one"))["job_id"]
        with pytest.raises(QuotaExceeded, match="its quota of concurrent jobs"):
            d.handle(user, m.CreateJob(device="cpu", name="two"))
        with pytest.raises(QuotaExceeded, match="its quota is 5 s"):
            d.handle(user, m.Acquire(id=1, job_id=j, max_hold_s=10))
        rid = request(d, user, m.Acquire, job_id=j)
        region = user.reply(rid).data["region"]
        time.sleep(0.3)  # past its 0.2 region-seconds per minute
        request(d, user, m.Release, region=region)
        user.reply(rid + 1)
        with pytest.raises(QuotaExceeded, match="region-seconds per minute") as exc:
            d.handle(user, m.Acquire(id=3, job_id=j))
        assert exc.value.seconds is not None and 55 < exc.value.seconds <= 60
    finally:
        d.shutdown()


def test_another_users_daemon_makes_regions_not_clean(tmp_path):
    """A listening krexd.sock owned by another uid, seen during a region, gives the
    region a foreign_daemon reason; our own daemons and sockets seen outside it do not."""
    import socket as so

    from krex.daemon.neighbours import Neighbours

    theirs = tmp_path / "other" / "krexd.sock"
    theirs.parent.mkdir()
    listener = so.socket(so.AF_UNIX)
    listener.bind(str(theirs))
    listener.listen(1)
    try:
        mine = tmp_path / "krexd.sock"
        if os.geteuid() == 0:
            os.chown(theirs, 4242, 4242)
        other_uid = os.stat(theirs).st_uid
        listed = [str(theirs), str(mine)]
        n = Neighbours(str(mine), own_uid=os.getuid(), scan=lambda: listed)
        n.look(100.0)
        if other_uid == os.getuid():
            assert n.during(99.0, 101.0) == []  # our own user's daemons are not foreign
            pytest.skip("needs root to give the socket another owner")
        (seen,) = n.during(99.0, 101.0)
        assert seen.uid == 4242
        (tmp_path / "rt").mkdir()
        d = Daemon(DaemonConfig(runtime_dir=str(tmp_path / "rt")),
                   exclusivity=ScriptedExclusivity())  # type: ignore[arg-type]
        try:
            d.neighbours = Neighbours(str(mine), own_uid=os.getuid(), scan=lambda: listed)
            user = FakeSession()
            rid = request(d, user, m.Acquire, job_id=job(d, user, "cpu"))
            region = user.reply(rid).data["region"]
            report = user.reply(request(d, user, m.Release, region=region)).data["report"]
            assert [r["code"] for r in report["reasons"]] == ["foreign_daemon"]
            assert report["clean"] is False
        finally:
            d.shutdown()
        listed.clear()  # it stopped
        assert n.during(200.0, 201.0) == []  # not seen then
    finally:
        listener.close()


def test_listening_daemons_are_read_from_proc_net_unix(tmp_path):
    import socket as so

    from krex.daemon.neighbours import listening_daemons

    path = tmp_path / "krexd.sock"
    s = so.socket(so.AF_UNIX)
    s.bind(str(path))
    try:
        assert str(path) not in listening_daemons()  # bound, not listening
        s.listen(1)
        assert str(path) in listening_daemons()
    finally:
        s.close()


class _StoreWatchingSession(FakeSession):
    """Notes, at each frame pushed, how many regions the store held already."""

    def __init__(self, core: Daemon) -> None:
        super().__init__()
        self.core = core
        self.stored_at_push: list[int] = []

    def push(self, message: m.Message) -> None:
        self.stored_at_push.append(len(self.core.finished))
        super().push(message)


def test_a_release_reply_is_sent_before_its_report_is_encoded_into_the_store(core):
    """The finished-region store encodes each report (JSON, and every so many regions a
    zlib block of several ms): that is done after the release's reply is sent, not
    before it; yet a ``regions`` request right after the reply sees the region.
    Control: the store does hold the region once the release has been handled."""
    s = _StoreWatchingSession(core)
    j = job(core, s, "cpu")
    rid = request(core, s, m.Acquire, job_id=j)
    region = s.reply(rid).data["region"]
    core.lanes.wait_idle(5)
    rel = request(core, s, m.Release, region=region)
    assert s.reply(rel).data["report"]["region"] == region
    assert s.stored_at_push[-1] == 0  # the reply went out before the record was encoded
    assert len(core.finished) == 1  # ... and it was encoded right after (control)
    rows = core.handle(s, m.Regions())["regions"]
    assert [r["region"] for r in rows] == [region]


def test_a_regions_request_sees_a_region_not_yet_encoded(core):
    """A record still waiting for its encoding (recorded, lock not yet released) is
    encoded before any read of the store."""
    s = FakeSession()
    report = RegionReport(device="cpu", region=77, job_id=1, outcome=Outcome.RELEASED,
                          held_s=0.1)
    with core.lock:  # as holds does: under the lock, before it is released
        core.record_region(os.getuid(), report)
        assert len(core.finished) == 0
        rows = core._on_regions(s, m.Regions())["regions"]
    assert [r["region"] for r in rows] == [77]


def test_the_tenant_ledger_keeps_the_last_minute_and_nothing_older():
    """A daemon without quotas (the default) ends regions for hours: the ledger keeps
    exactly the spans that end inside the window — all of them (a quota or a status
    still sees the whole minute), none older (before, one span per region stayed for
    ever unless a quota check or the same tenant's status trimmed it).  A tenant that
    stops asking is let go within a window too."""
    from krex.daemon.tenants import WINDOW_S, Ledger

    ledger, step = Ledger(), 0.02  # 50 regions a second, fake clock
    ends: list[float] = []
    region = 0
    for i in range(int(10 * WINDOW_S / step)):  # ten minutes
        now = i * step
        for tenant in ("http:a", "mcp:b") if now < 5 * WINDOW_S else ("http:a",):
            region += 1
            ledger.start(tenant, region, now)
            ledger.end(region, now + step / 2)
            ends.append(now + step / 2)
    last = ends[-1]
    in_window = int(WINDOW_S / step)  # http:a's spans ending after last - WINDOW_S
    assert ledger.spans() == in_window, (ledger.spans(), in_window)  # not fewer, not more
    assert abs(ledger.used("http:a", last) - in_window * step / 2) < 1e-6
    assert ledger.used("mcp:b", last) == 0.0 and "mcp:b" not in ledger._done


def test_the_daemon_keeps_as_many_ended_jobs_and_regions_as_configured(tmp_path):
    """``--keep-jobs`` / ``--keep-regions`` bound what the daemon remembers of ended work
    (the load benchmark runs with small bounds to see its memory level off).  Control: the
    same ended jobs are all listed under the default bound."""
    def ended(config: DaemonConfig) -> tuple[list[int], list[int]]:
        os.makedirs(config.runtime_dir)
        d = Daemon(config, exclusivity=ScriptedExclusivity())  # type: ignore[arg-type]
        try:
            s = FakeSession()
            ids = [job(d, s, "cpu") for _ in range(7)]
            for j in ids:
                d.handle(s, m.EndJob(job_id=j))
            for i in range(600):
                d.finished.append((i + 1, os.getuid(), {"region": i + 1, "job_id": 1}))
            listed = [j["job_id"] for j in d.handle(s, m.Jobs())["jobs"]]
            regions, before = [], None
            while True:
                reply = d.handle(s, m.Regions(limit=m.PAGE_MAX, before=before))
                regions += [r["region"] for r in reply["regions"]]
                if (before := reply["next_before"]) is None:
                    return listed, regions
        finally:
            d.shutdown()

    listed, regions = ended(DaemonConfig(runtime_dir=str(tmp_path / "a"), keep_jobs=3,
                                         keep_regions=256))
    assert sorted(listed) == [5, 6, 7]  # the newest 3
    # the newest regions, at least 256 (whole compressed blocks: less than a block more)
    assert sorted(regions) == list(range(601 - len(regions), 601))
    assert 256 <= len(regions) < 256 + BLOCK
    listed, regions = ended(DaemonConfig(runtime_dir=str(tmp_path / "b")))
    assert sorted(listed) == list(range(1, 8)) and len(regions) == 600
    with pytest.raises(ValueError, match="--keep-jobs"):
        DaemonConfig(runtime_dir=str(tmp_path / "c"), keep_jobs=0)


@pytest.mark.parametrize("again", [True, False])
def test_a_release_with_again_queues_the_jobs_next_region_before_the_device_moves_on(
        core, again):
    """``release`` with ``again``: the job's next region (the released one's parameters,
    the given request id) is queued before the device is handed on, so the job that
    was waiting gets the device and this one is next in line.  Control: a plain release
    leaves the job out of the queue."""
    a, b, c = FakeSession(), FakeSession(), FakeSession()
    ja, jb = job(core, a, "cpu"), job(core, b, "cpu")
    ra = a.reply(request(core, a, m.Acquire, job_id=ja, label="mine")).data["region"]
    rb_acq = request(core, b, m.Acquire, job_id=jb)  # queued behind a's region
    nxt = next_id()
    rel = request(core, a, m.Release, region=ra, **({"again": nxt} if again else {}))
    assert a.reply(rel).data["report"]["region"] == ra
    rb = b.reply(rb_acq).data["region"]
    queue_ = core.handle(c, m.Status())["scheduler"]["cpu"]["queue"]
    if not again:
        assert queue_ == []
        return
    assert [(q["job_id"], q["label"]) for q in queue_] == [(ja, "mine")]
    request(core, b, m.Release, region=rb)
    grant = a.reply(nxt).data
    assert grant["region"] not in (ra, rb)
    request(core, a, m.Release, region=grant["region"])
    assert core.handle(c, m.Status())["scheduler"]["cpu"]["holder"] is None
