"""The scheduler alone: no processes, no clock, no root."""

import itertools
import math
import random

from krex.daemon.scheduler import Cancel, Grant, Request, Revoke, Scheduler

_ids = itertools.count(1)


def req(job, device="cpu", owner=None, **kw):
    return Request(region=next(_ids), job_id=job, device=device, owner=owner or f"conn{job}",
                   requested_mono_s=kw.pop("now", 0.0), **kw)


def granted(decisions):
    return [d.request for d in decisions if isinstance(d, Grant)]


def test_one_holder_per_device_and_fifo_handoff():
    s = Scheduler()
    a, b = req(1), req(2)
    assert granted(s.submit(a, 0)) == [a]
    assert granted(s.submit(b, 0)) == []
    assert s.queue("cpu").holder is a
    assert granted(s.release(a.region, 1)) == [b]


def test_devices_are_independent():
    s = Scheduler()
    a, b = req(1, "cpu"), req(2, "fakegpu:0")
    assert granted(s.submit(a, 0)) == [a]
    assert granted(s.submit(b, 0)) == [b]


def test_round_robin_between_jobs_fifo_within_a_job():
    s = Scheduler()
    holder = req(9)
    s.submit(holder, 0)
    greedy = [req(1) for _ in range(5)]
    for r in greedy:
        s.submit(r, 0)
    others = [req(2), req(3)]
    for r in others:
        s.submit(r, 0)
    order = []
    current = holder
    for t in range(1, 8):
        nxt = granted(s.release(current.region, t))
        if not nxt:
            break
        current = nxt[0]
        order.append(current)
    assert [r.job_id for r in order] == [1, 2, 3, 1, 1, 1, 1]
    assert [r for r in order if r.job_id == 1] == greedy  # FIFO within the job


def test_fairness_bound_under_random_load():
    """No request sees more other-job grants while waiting than there are other jobs."""
    rng = random.Random(7)
    s = Scheduler()
    jobs = 6
    pending = {j: 20 for j in range(jobs)}
    queued = {j: None for j in range(jobs)}
    holder = None
    now = 0.0
    worst = 0
    while any(pending.values()) or holder:
        for j in range(jobs):
            if queued[j] is None and pending[j]:
                pending[j] -= 1
                r = req(j, now=now)
                queued[j] = r
                got = granted(s.submit(r, now))
                holder = got[0] if got else holder
        now += rng.random()
        if holder:
            worst = max(worst, holder.jobs_served_while_waiting)
            queued[holder.job_id] = None
            got = granted(s.release(holder.region, now))
            holder = got[0] if got else None
    assert worst <= jobs - 1


def test_release_of_a_waiting_request_just_removes_it():
    s = Scheduler()
    a, b, c = req(1), req(2), req(3)
    for r in (a, b, c):
        s.submit(r, 0)
    assert s.release(b.region, 1) == []
    assert granted(s.release(a.region, 2)) == [c]


def test_drop_owner_releases_held_and_queued():
    s = Scheduler()
    a = req(1, owner="x")
    a2 = req(1, owner="x")
    b = req(2, owner="y")
    for r in (a, a2, b):
        s.submit(r, 0)
    assert granted(s.drop_owner("x", 1)) == [b]
    assert a.region not in s.live and a2.region not in s.live


def test_max_hold_revokes_and_hands_over():
    s = Scheduler()
    a = req(1, max_hold_s=2.0)
    b = req(2)
    s.submit(a, 0)
    s.submit(b, 0)
    assert s.next_deadline() == 2.0
    assert s.expire(1.9) == []
    out = s.expire(2.0)
    assert isinstance(out[0], Revoke) and out[0].request is a
    assert granted(out) == [b]
    assert s.release(a.region, 3) == []  # releasing a revoked region changes nothing


def test_wait_timeout_cancels():
    s = Scheduler()
    a, b = req(1), req(2, timeout_s=0.5)
    s.submit(a, 0)
    s.submit(b, 0)
    out = s.expire(0.6)
    assert len(out) == 1 and isinstance(out[0], Cancel) and out[0].request is b
    assert s.release(a.region, 1) == []


def test_mode_none_is_granted_at_once_without_holding():
    s = Scheduler()
    a = req(1)
    s.submit(a, 0)
    shared = req(2, exclusive=False)
    assert granted(s.submit(shared, 0)) == [shared]
    assert s.queue("cpu").holder is a


def test_whole_job_hold_nests_the_jobs_own_regions():
    s = Scheduler()
    whole = req(1, whole_job=True)
    s.submit(whole, 0)
    assert whole.max_hold_s == math.inf
    inner = req(1)
    assert granted(s.submit(inner, 0)) == [inner] and inner.nested
    other = req(2)
    assert granted(s.submit(other, 0)) == []
    s.release(inner.region, 1)
    assert s.queue("cpu").holder is whole
    assert granted(s.release(whole.region, 2)) == [other]


def test_regions_queued_before_a_whole_job_grant_are_nested_when_it_comes():
    s = Scheduler()
    blocker = req(2)
    s.submit(blocker, 0)
    whole = req(1, whole_job=True)
    s.submit(whole, 0)
    inner = req(1)
    s.submit(inner, 0)
    out = granted(s.release(blocker.region, 1))
    assert whole in out and inner in out and inner.nested
