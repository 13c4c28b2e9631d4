"""The scheduler alone: no processes, no clock, no root."""

import itertools
import math
import random

import pytest

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


def test_max_hold_counts_from_the_start_revokes_then_hands_over_on_release():
    s = Scheduler()
    a = req(1, max_hold_s=2.0)
    b = req(2)
    s.submit(a, 0)
    s.submit(b, 0)
    assert s.next_deadline() == math.inf  # enforcement being set up: no deadline yet
    s.started(a.region, 0.5)
    assert s.next_deadline() == 2.5
    assert s.expire(2.4) == []
    out = s.expire(2.5)
    assert len(out) == 1 and isinstance(out[0], Revoke) and out[0].request is a
    assert s.queue("cpu").holder is a  # until its enforcement is undone
    assert s.expire(3.0) == [] and s.next_deadline() == math.inf  # revoked once, no spin
    assert granted(s.release(a.region, 3.1)) == [b]
    assert s.release(a.region, 3.2) == []  # releasing twice changes nothing


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


def test_holds_that_cannot_be_revoked_have_no_deadline():
    """A mode-none or nested region past its maximum hold must not keep a deadline in
    the past: the daemon's ticker sleeps until the next deadline and would spin."""
    s = Scheduler()
    shared = req(1, exclusive=False, max_hold_s=0.1)
    s.submit(shared, 0)
    whole = req(2, whole_job=True, max_hold_s=0.1)
    s.submit(whole, 0)
    s.started(whole.region, 0)
    inner = req(2, max_hold_s=0.1)
    s.submit(inner, 0)
    assert inner.nested
    out = s.expire(1.0)
    assert [type(d) for d in out] == [Revoke] and out[0].request is whole
    assert s.next_deadline() == math.inf
    assert s.expire(2.0) == []


def test_tenants_share_by_region_time_not_by_job_count():
    """Tenant A runs 6 jobs, tenant B one; each job always has a region queued."""
    s = Scheduler(window_s=0)
    jobs = {j: ("A" if j < 6 else "B") for j in range(7)}
    for j, t in jobs.items():
        s.submit(req(j, tenant=t), 0)
    held = {"A": 0.0, "B": 0.0}
    now = 0.0
    holder = s.queue("cpu").holder
    for _ in range(300):
        s.started(holder.region, now)
        now += 0.01
        held[holder.tenant] += 0.01
        nxt = req(holder.job_id, tenant=holder.tenant)
        out = granted(s.release(holder.region, now))
        out += granted(s.submit(nxt, now))
        holder = out[0]
    assert abs(held["A"] - held["B"]) / (held["A"] + held["B"]) < 0.02, held


def test_unequal_region_lengths_are_shared_by_time():
    """Both tenants always have a request queued (the next is asked before the release)."""
    s = Scheduler(window_s=0)
    s.submit(req(1, tenant="long"), 0)
    s.submit(req(2, tenant="short"), 0)
    held = {"long": 0.0, "short": 0.0}
    now, holder = 0.0, s.queue("cpu").holder
    for _ in range(200):
        s.started(holder.region, now)
        d = 0.05 if holder.tenant == "long" else 0.01
        now += d
        held[holder.tenant] += d
        out = granted(s.submit(req(holder.job_id, tenant=holder.tenant), now))  # a 2nd thread
        out += granted(s.release(holder.region, now))
        holder = out[0]
    assert abs(held["long"] - held["short"]) / sum(held.values()) < 0.1, held


def test_an_idle_tenant_banks_no_credit():
    s = Scheduler(window_s=0)
    a = req(1, tenant="A")
    s.submit(a, 0)
    s.started(a.region, 0)
    granted(s.release(a.region, 100.0))  # A held 100 s alone
    b1, a2 = req(2, tenant="B"), req(1, tenant="A")
    s.submit(b1, 100.0)  # B arrives: no earlier use, but it banks nothing
    s.submit(a2, 100.0)
    s.started(b1.region, 100.0)
    assert granted(s.release(b1.region, 101.0)) == [a2]  # B's lead lasts its own hold
    assert s.queue("cpu").usage["B"] >= 100.0


def test_a_job_frozen_through_a_release_gets_the_fair_window():
    """Job 1 releases and asks again at once; job 2 was frozen and asks 5 ms later."""
    s = Scheduler(window_s=0.02)
    j1, j2 = req(1), req(2)
    s.submit(j1, 0)
    s.submit(j2, 0)
    s.started(j1.region, 0)
    assert granted(s.release(j1.region, 1.0)) == [j2]  # j2 was queued: plain order
    s.started(j2.region, 1.0)
    again = req(1, now=2.0)
    s.submit(again, 2.0)  # j1 queued while j2 holds
    granted(s.release(j2.region, 2.0, frozen={1}))  # j1 was queued: no window for it
    assert s.queue("cpu").holder is again
    s.started(again.region, 2.0)
    # j2 is frozen through j1's region and has not asked: a window opens for it.
    assert s.release(again.region, 3.0, frozen={2}) == []
    greedy = req(1, now=3.0001)
    assert s.submit(greedy, 3.0001) == []  # held back while j2 may still ask
    late = req(2, now=3.005)
    assert granted(s.submit(late, 3.005)) == [late]  # j2 asked: the window closes, j2 first


def test_window_passes_and_a_job_that_never_asks_is_not_waited_for_again():
    s = Scheduler(window_s=0.02, max_misses=2)
    quiet = req(2)
    s.submit(quiet, 0)  # job 2 asks once, so it takes regions on this device
    s.started(quiet.region, 0)
    s.release(quiet.region, 0.5)
    t = 1.0
    current = req(1, now=t)
    assert granted(s.submit(current, t)) == [current]
    stalls = 0
    for _ in range(4):
        s.started(current.region, t)
        t += 0.1
        s.release(current.region, t, frozen={2})  # job 2 frozen through it, never asks
        current = req(1, now=t + 1e-4)
        g = granted(s.submit(current, t + 1e-4))  # asks again at once
        if not g:  # held back by the window
            assert s.next_deadline() == pytest.approx(t + 0.02)
            g = granted(s.expire(t + 0.02))
            stalls += 1
        assert g == [current]
    assert stalls == 2  # two windows missed, then job 2 is not waited for


def test_forget_job_closes_its_window():
    s = Scheduler(window_s=10)
    a, b = req(1), req(2)
    s.submit(b, 0)
    s.started(b.region, 0)
    s.release(b.region, 0.1)
    s.submit(a, 0.2)
    s.started(a.region, 0.2)
    assert s.release(a.region, 1, frozen={2}) == []
    a2 = req(1, now=1)
    assert s.submit(a2, 1) == []
    assert granted(s.forget_job(2, 1.1)) == [a2]


def test_within_a_tenant_the_job_served_least_recently_goes_first():
    """One user's jobs share a tenant: after a window the releaser, who asked again
    first, still goes after the jobs it froze (the ring order alone put it first)."""
    s = Scheduler(window_s=0.02)
    for job in (2, 3):  # jobs 2 and 3 take regions on this device
        earlier = req(job, tenant="uid:0")
        s.submit(earlier, 0)
        s.started(earlier.region, 0)
        s.release(earlier.region, 0)
    first = req(1, tenant="uid:0")
    s.submit(first, 0)
    s.started(first.region, 0)
    assert s.release(first.region, 1.0, frozen={2, 3}) == []  # a window for jobs 2 and 3
    greedy = req(1, now=1.0001, tenant="uid:0")
    assert s.submit(greedy, 1.0001) == []
    two, three = req(2, now=1.005, tenant="uid:0"), req(3, now=1.006, tenant="uid:0")
    assert s.submit(two, 1.005) == []
    assert granted(s.submit(three, 1.006)) == [two]
    s.started(two.region, 1.006)
    assert granted(s.release(two.region, 1.1)) == [three]
    s.started(three.region, 1.1)
    assert granted(s.release(three.region, 1.2)) == [greedy]


def test_jobs_served_earlier_in_a_handoff_chain_do_not_hold_back_a_queued_job():
    """Issue 18: a job handed over from (frozen since its own release, so it cannot have
    asked) had its turn: while another job is queued the window does not wait for it;
    with nobody queued it gets the window like any frozen job.  Control: the same
    release without ``served`` opens the window and grants nobody."""
    s = Scheduler(window_s=0.02)
    j1, j2, j3 = req(1), req(2), req(3)
    assert granted(s.submit(j1, 0.0)) == [j1]
    s.started(j1.region, 0.0)
    s.submit(j2, 0.0)
    s.submit(j3, 0.0)
    assert granted(s.release(j1.region, 1.0, frozen={2, 3})) == [j2]  # both queued
    s.started(j2.region, 1.0)
    # j2 hands over to j3: j1 (the chain's first holder) is frozen and has not asked;
    # it held the device for 1 s, j3 not at all: it would not go first
    assert granted(s.release(j2.region, 2.0, frozen={1, 3}, served={1})) == [j3]
    s.started(j3.region, 2.0)
    # nobody queued now: j1 and j2 get the window as usual
    assert granted(s.release(j3.region, 3.0, frozen={1, 2}, served={1, 2})) == []
    assert s.queue("cpu").window is not None

    c = Scheduler(window_s=0.02)  # the control
    k1, k2, k3 = req(1), req(2), req(3)
    c.submit(k1, 0.0)
    c.started(k1.region, 0.0)
    c.submit(k2, 0.0)
    c.submit(k3, 0.0)
    assert granted(c.release(k1.region, 1.0, frozen={2, 3})) == [k2]
    c.started(k2.region, 1.0)
    assert granted(c.release(k2.region, 2.0, frozen={1, 3})) == []  # waits for job 1


def test_a_served_job_of_a_tenant_that_used_the_device_less_is_still_waited_for():
    """Tenant fairness first: a job handed over from whose tenant has used the device
    less than the queued tenant's would go first if it asked: the window waits."""
    s = Scheduler(window_s=0.02)
    a, b1, b2 = req(1, tenant="A"), req(2, tenant="B"), req(3, tenant="B")
    assert granted(s.submit(b1, 0.0)) == [b1]
    s.started(b1.region, 0.0)
    s.submit(a, 0.5)
    s.submit(b2, 0.5)
    assert granted(s.release(b1.region, 5.0, frozen={1, 3})) == [a]  # A used nothing yet
    s.started(a.region, 5.0)
    # A (1 s) hands over to B's next job; B has used 5 s: A would go first again
    assert granted(s.release(a.region, 6.0, frozen={3}, served=set())) == [b2]
    s.started(b2.region, 6.0)
    assert granted(s.release(b2.region, 6.5, frozen={1}, served={1})) == []  # nobody queued
    s2 = Scheduler(window_s=0.02)
    a, b1, b2, b3 = req(1, tenant="A"), req(2, tenant="B"), req(3, tenant="B"), req(4, tenant="B")
    assert granted(s2.submit(b1, 0.0)) == [b1]
    s2.started(b1.region, 0.0)
    s2.submit(a, 0.1)
    s2.submit(b2, 0.1)
    s2.submit(b3, 0.1)
    assert granted(s2.release(b1.region, 5.0, frozen={1, 3, 4})) == [a]
    s2.started(a.region, 5.0)
    assert granted(s2.release(a.region, 6.0, frozen={3, 4})) == [b2]
    s2.started(b2.region, 6.0)
    # b2 hands over; A (1 s) is frozen and was served in the chain, B has 5.5 s, b3 is
    # queued: A would go first if it asked, so the window waits for it
    assert granted(s2.release(b2.region, 6.5, frozen={1, 4}, served={1})) == []
