"""The sampling machinery shared by ``measure`` and ``compare``.

Outside the region: the first call (compilation, lazy init), an estimate of
one call's time, and the warm-up (``warmup_ms`` of calls).  Inside the region
(:func:`in_region`): a short warm-up, then batches of samples — each sample
is ``flush cache (cold) -> clear grads -> start -> fn() -> stop`` — with one
device synchronisation per batch, until the stopping rule says so.  A region
whose report is not clean is retried, the loop starting afresh.
"""

from __future__ import annotations

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
    """Call once (compile, lazy init), then estimate from ``calls`` samples."""
    plan.fn()
    plan.timer.synchronize()
    t0 = plan.timer.now_s()
    samples = read_samples(plan, [take_sample(plan) for _ in range(calls)])
    wall_ms = (plan.timer.now_s() - t0) * 1e3 / calls
    call_ms = max(sorted(samples)[len(samples) // 2], 1e-6)  # median: one bad sample is ignored
    return Estimate(call_ms, max(wall_ms, call_ms))


def warm_up(plan: Plan, warmup_ms: float, estimate_ms: float) -> int:
    """``warmup_ms`` worth of calls (at least one), the do_bench way; returns the count."""
    count = max(1, int(warmup_ms / estimate_ms))
    for _ in range(count):
        plan.fn()
    plan.timer.synchronize()
    return count


def batch_size(sample_wall_ms: float) -> int:
    """Samples per stopping decision: about CHECK_INTERVAL_MS of wall time."""
    return max(1, min(MAX_BATCH, int(CHECK_INTERVAL_MS / max(sample_wall_ms, 1e-6))))


@dataclass
class LoopResult:
    samples_ms: list[float]
    stop_reason: str
    elapsed_s: float
    offcpu_ms: list[float] = field(default_factory=list)
    clocks_start: dict[str, Any] = field(default_factory=dict)
    clocks_end: dict[str, Any] = field(default_factory=dict)


def timed_loop(plan: Plan, rule: Any, estimate: Estimate) -> LoopResult:
    """Sample in batches until ``rule.decide(samples, elapsed_s)`` names a reason."""
    timer = plan.timer
    offcpu = getattr(timer, "offcpu_ms", None)
    samples: list[float] = []
    offcpu_ms: list[float] = []
    batch = batch_size(estimate.sample_wall_ms)
    start_s = timer.now_s()
    while True:
        n = max(batch, len(samples) // GROWTH_DIVISOR)  # O(log n) decisions for long runs
        n = min(n, rule.count - len(samples)) if hasattr(rule, "count") else n
        pending = [take_sample(plan) for _ in range(max(1, n))]
        samples.extend(read_samples(plan, pending))
        if offcpu is not None:
            offcpu_ms.extend(offcpu(p) / plan.inner for p in pending)
        reason = rule.decide(samples, timer.now_s() - start_s)
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


def timed_region(body: Callable[[], Any], opts: TimingOptions, device: str,
                 timer: Timer) -> RegionRun:
    """:func:`in_region` for a timed loop that must yield samples.

    The maximum hold defaults to the loop's timeout plus a margin; a region
    revoked before any sample raises :class:`~krex.errors.RegionRevoked`.
    """
    hold_s = opts.max_hold_s or opts.timeout_s + HOLD_MARGIN_S
    run = in_region(body, get_region_factory(opts.region), device, retries=opts.retries,
                    label=opts.label, max_hold_s=hold_s, timer=timer)
    if run.value is None:
        raise RegionRevoked("region revoked before any sample", device=device, seconds=hold_s)
    return run


HOLD_MARGIN_S = 5.0  # a timed loop's maximum hold: its timeout plus this


def in_region(
    body: Callable[[], Any],
    factory: RegionFactory,
    device: str,
    *,
    retries: int,
    label: str | None,
    max_hold_s: float | None,
    timer: Timer | None = None,
) -> RegionRun:
    """Run ``body`` inside a region; retry up to ``retries`` times while not clean.

    Clocks are sampled at the start and end of the body: ``timer.clocks()``
    when the timer has one (the FakeTimer: none), else the device's.
    """
    read_clocks = getattr(timer, "clocks", None) or (lambda: clocks.sample(device))
    rejected: list[RegionReport] = []
    for attempt in range(retries + 1):
        value, report, before, after = _one_region(
            body, factory, device, label, max_hold_s, read_clocks
        )
        if attempt == retries or not checks.should_retry(report):
            return RegionRun(value, report, attempt + 1, rejected, before, after)
        rejected.append(report)
    raise AssertionError("unreachable")


def _one_region(body, factory, device, label, max_hold_s, read_clocks):
    """One region around ``body``; a revocation becomes a not-clean, revoked report."""
    value, before, after, r = None, {}, {}, None
    try:
        with factory(device, max_hold_s=max_hold_s, label=label) as r:
            before = read_clocks()
            value = body()
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
