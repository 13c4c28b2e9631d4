"""The sampling machinery shared by ``measure`` and ``compare``.

Outside the region: the first call (compilation, lazy init), an estimate of
one sample's time (flush and overheads included, as do_bench estimates it),
and the warm-up (``warmup_ms`` of calls).  Inside the region
(:func:`in_region`): a short warm-up, then batches of samples — each sample
is ``flush cache (cold) -> clear grads -> start -> fn() -> stop`` — with one
device synchronisation per batch, until the stopping rule says so.  A region
whose report is not clean is retried, the loop starting afresh.

Budgets bound the **hold** (:class:`Hold`): before each batch the loop
checks that the batch fits in what is left of the rule's wall-time limit
(and of the daemon's granted maximum hold, less :data:`HOLD_SLACK_S`), so a
region is held at most its budget plus one sample plus :data:`HOLD_SLACK_S`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from krex.errors import RegionRevoked
from krex.measure import checks, clocks
from krex.measure.options import TimingOptions
from krex.measure.regions import RegionFactory, get_region_factory, no_daemon
from krex.measure.timers import Timer
from krex.protocol.report import Outcome, Reason, ReasonCode, RegionReport

CHECK_INTERVAL_MS = 10.0  # how much measured time between two stopping decisions
MAX_BATCH = 1000
ESTIMATE_CALLS = 5
GROWTH_DIVISOR = 20  # a batch is at least 1/20 of the samples so far


@dataclass
class Plan:
    """How one function is sampled."""

    fn: Callable[[], Any]
    timer: Timer
    cold: bool = True
    grad_to_none: Sequence[Any] | None = None
    inner: int = 1  # calls per sample (CUDA-graph replays hold several); samples are / inner


def take_sample(plan: Plan) -> Any:
    if plan.cold:
        plan.timer.flush_cache()
    if plan.grad_to_none is not None:
        for tensor in plan.grad_to_none:
            tensor.grad = None
    start = plan.timer.start()
    plan.fn()
    return plan.timer.stop(start)


def read_samples(plan: Plan, pending: list[Any]) -> list[float]:
    plan.timer.synchronize()
    return [plan.timer.elapsed_ms(p) / plan.inner for p in pending]


@dataclass
class Estimate:
    call_ms: float  # one call of fn, as the timer sees it
    sample_wall_ms: float  # one whole sample on the host clock: flush and overheads included


def first_call_and_estimate(plan: Plan, calls: int = ESTIMATE_CALLS) -> Estimate:
    """Call once (compile, lazy init), then estimate from ``calls`` samples.

    With a cold cache, one flush first: allocating and touching the flush
    buffer is a one-off cost that must not inflate the estimate.
    """
    plan.fn()
    if plan.cold:
        plan.timer.flush_cache()
    plan.timer.synchronize()
    t0 = plan.timer.now_s()
    samples = read_samples(plan, [take_sample(plan) for _ in range(calls)])
    wall_ms = (plan.timer.now_s() - t0) * 1e3 / calls
    call_ms = max(sorted(samples)[len(samples) // 2], 1e-6)  # median: one bad sample is ignored
    return Estimate(call_ms, max(wall_ms, call_ms))


def first_call_and_warm_up(plan: Plan, warmup_ms: float) -> int:
    """Without an estimate: call once (compile, lazy init; with a cold cache a flush
    after it, as :func:`first_call_and_estimate` does), then call until ``warmup_ms`` of
    the timer's clock has passed since (at least once more), each call waited for;
    returns the calls after the first."""
    plan.fn()
    if plan.cold:
        plan.timer.flush_cache()
    plan.timer.synchronize()
    start, count = plan.timer.now_s(), 0
    while count == 0 or (plan.timer.now_s() - start) * 1e3 < warmup_ms:
        plan.fn()
        plan.timer.synchronize()
        count += 1
    return count


def warm_up(plan: Plan, warmup_ms: float, estimate_ms: float) -> int:
    """``warmup_ms`` worth of calls (at least one), the do_bench way; returns the count."""
    count = max(1, int(warmup_ms / estimate_ms))
    for _ in range(count):
        plan.fn()
    plan.timer.synchronize()
    return count


def batch_size(sample_wall_ms: float, interval_ms: float = CHECK_INTERVAL_MS) -> int:
    """Samples per stopping decision: about ``interval_ms`` of wall time."""
    return max(1, min(MAX_BATCH, int(interval_ms / max(sample_wall_ms, 1e-6))))


def overhead_per_sample_ms(samples_ms: Sequence[float], elapsed_s: float) -> float | None:
    """Loop time per sample outside the timed intervals: flush, marks, synchronisation."""
    if not samples_ms:
        return None
    return max(0.0, (elapsed_s * 1e3 - math.fsum(samples_ms)) / len(samples_ms))


@dataclass
class LoopResult:
    samples_ms: list[float]
    stop_reason: str
    elapsed_s: float
    offcpu_ms: list[float] = field(default_factory=list)
    clocks_start: dict[str, Any] = field(default_factory=dict)
    clocks_end: dict[str, Any] = field(default_factory=dict)


@dataclass
class Hold:
    """The region's hold as the timed loop sees it (on the timer's clock)."""

    start_s: float  # when the region was entered
    ceiling_s: float = math.inf  # hold after which the daemon would revoke, less the slack

    def limit(self, rule_limit_s: float) -> float:
        return min(rule_limit_s, self.ceiling_s)


def samples_that_fit(left_s: float, per_sample_s: float, wanted: int) -> int:
    """How many of ``wanted`` samples of ``per_sample_s`` fit in ``left_s``."""
    if per_sample_s <= 0:
        return wanted
    return max(0, min(wanted, int(left_s / per_sample_s)))


def timed_loop(plan: Plan, rule: Any, estimate: Estimate, hold: Hold | None = None) -> LoopResult:
    """Sample in batches until ``rule.decide(samples, held_s)`` names a reason.

    A batch is cut to what fits before the rule's limit on the hold; when not
    even one sample fits (and some were taken) the loop stops with the
    limit's reason.  After each batch, the batch size and the rule's count
    (``rule.refit``) follow a sample's wall time as measured in the region.
    """
    timer = plan.timer
    offcpu = getattr(timer, "offcpu_ms", None)
    samples: list[float] = []
    offcpu_ms: list[float] = []
    batch = batch_size(estimate.sample_wall_ms)
    start_s = timer.now_s()
    hold = hold or Hold(start_s)
    limit_s, limit_reason = rule.limit()
    limit_s = hold.limit(limit_s)
    while True:
        n = max(batch, len(samples) // GROWTH_DIVISOR)  # O(log n) decisions for long runs
        n = min(n, rule.count - len(samples)) if hasattr(rule, "count") else n
        now = timer.now_s()
        per_sample_s = (now - start_s) / len(samples) if samples else estimate.sample_wall_ms / 1e3
        n = samples_that_fit(limit_s - (now - hold.start_s), per_sample_s, n)
        if n < 1 and samples:
            return LoopResult(samples, limit_reason, timer.now_s() - start_s, offcpu_ms)
        pending = [take_sample(plan) for _ in range(max(1, n))]
        samples.extend(read_samples(plan, pending))
        if offcpu is not None:
            offcpu_ms.extend(offcpu(p) / plan.inner for p in pending)
        # a sample's wall time in here, not the estimate's from outside on a busy host
        wall_ms = (timer.now_s() - start_s) * 1e3 / len(samples)
        batch = batch_size(wall_ms)
        rule.refit(wall_ms)
        reason = rule.decide(samples, timer.now_s() - hold.start_s)
        if reason:
            return LoopResult(samples, reason, timer.now_s() - start_s, offcpu_ms)


@dataclass
class RegionRun:
    """The outcome of the body run in the last region, with the rejected reports."""

    value: Any
    report: RegionReport
    attempts: int
    rejected: list[RegionReport]
    clocks_start: dict[str, Any]
    clocks_end: dict[str, Any]


def timed_region(body: Callable[[Hold], Any], opts: TimingOptions, device: str,
                 timer: Timer, *, budget_s: float,
                 screened: Callable[[Any], bool] | None = None) -> RegionRun:
    """:func:`in_region` for a timed loop that must yield samples.

    The maximum hold asked of the daemon defaults to the loop's budget plus
    :data:`HOLD_MARGIN_S` (the daemon may grant less: its ``--max-hold-s`` is
    a ceiling, and the loop then ends before it); a region revoked before any
    sample raises :class:`~krex.errors.RegionRevoked`.
    """
    hold_s = opts.max_hold_s or budget_s + HOLD_MARGIN_S
    run = in_region(body, get_region_factory(opts.region), device, retries=opts.retries,
                    label=opts.label, max_hold_s=hold_s, timer=timer, screened=screened)
    if run.value is None:
        raise RegionRevoked("region revoked before any sample", device=device, seconds=hold_s)
    return run


HOLD_MARGIN_S = 5.0  # the maximum hold a timed loop asks for: its budget plus this
HOLD_SLACK_S = 0.05  # a budget bounds the hold to budget + one sample + this (docs/measure.md)


def in_region(
    body: Callable[[Hold], Any],
    factory: RegionFactory,
    device: str,
    *,
    retries: int,
    label: str | None,
    max_hold_s: float | None,
    timer: Timer | None = None,
    screened: Callable[[Any], bool] | None = None,
) -> RegionRun:
    """Run ``body(hold)`` inside a region; retry up to ``retries`` times while not clean.

    ``screened(value)``: the body set aside every sample its own thread was preempted in
    and kept enough of them -- a region not clean only for the holder's contention
    (:data:`checks.CONTENTION`) is then not retried: measuring again gains nothing.

    Clocks are sampled at the start and end of the body: ``timer.clocks()``
    when the timer has one (the FakeTimer: none), else the device's.
    """
    read_clocks = getattr(timer, "clocks", None) or (lambda: clocks.sample(device))
    now = timer.now_s if timer is not None else time.perf_counter
    rejected: list[RegionReport] = []
    for attempt in range(retries + 1):
        value, report, before, after = _one_region(
            body, factory, device, label, max_hold_s, (read_clocks, now)
        )
        if attempt == retries or not checks.should_retry(report) or (
                screened is not None and value is not None
                and checks.only_contention(report) and screened(value)):
            return RegionRun(value, report, attempt + 1, rejected, before, after)
        rejected.append(report)
    raise AssertionError("unreachable")


def _one_region(body, factory, device, label, max_hold_s, clocks_and_now):
    """One region around ``body``; a revocation becomes a not-clean, revoked report."""
    read_clocks, now = clocks_and_now
    value, before, after, r = None, {}, {}, None
    try:
        with factory(device, max_hold_s=max_hold_s, label=label) as r:
            hold = Hold(now(), granted_ceiling_s(r))
            before = read_clocks()
            value = body(hold)
            after = read_clocks()
    except RegionRevoked as exc:
        report = getattr(r, "report", None) or RegionReport(device=device, mode="region")
        revoked = Reason(ReasonCode.REVOKED, str(exc), {"region": exc.region})
        return value, report.with_reason(revoked, Outcome.REVOKED), before, after
    return value, getattr(r, "report", None) or _no_report(device), before, after


def _no_report(device: str) -> RegionReport:
    """A region factory whose regions report nothing: nothing can be said to be enforced."""
    return RegionReport(device=device, mode=None, exclusive=False,
                        reasons=[no_daemon("the region factory gave no report")])


def granted_ceiling_s(region: Any) -> float:
    """The daemon's granted maximum hold of ``region`` less the slack (inf when none),
    less the time the grant took to reach us: the daemon's hold began when it sent the
    grant (``granted_mono_s``, its CLOCK_MONOTONIC: ours too, on the same host), and on
    a loaded machine the reply can wait tens of ms for this process to run."""
    grant = getattr(region, "grant", None) or {}
    granted = grant.get("max_hold_s")
    if not granted:
        return math.inf
    ceiling = max(float(granted) - HOLD_SLACK_S, float(granted) / 2)
    sent = grant.get("granted_mono_s")
    if sent is not None:
        late = time.monotonic() - float(sent)
        if 0.0 < late < ceiling:
            ceiling -= late
    return ceiling
