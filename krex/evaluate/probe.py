"""Evidence gathered around the timed calls, never inside them.

:class:`CountingTimer` wraps the real timer of ``krex.compare``: it reads
the process's counters (device launches, the candidate's threads' CPU time)
just before the start mark and just after the stop mark of every sample, and
around every cache flush, so each sample splits into *in the call* and *after
the call returned, before the next one* — without adding a nanosecond to the
timed span.  :class:`Calls` are the two timed callables: they rotate over
several input sets and keep each set's last output for checking afterwards.

:func:`probing_region` wraps the region factory: when the timed loop is done
and the region still held, it runs the *return probe* — a few calls of each
side, each followed by a synchronisation, a drain of this process's own
queued device work (``counters.self_drain_ms``) and a short quiet window in
which nothing of ours should run.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from krex.evaluate import counters

PROBE_CALLS = 3  # per side
QUIET_WINDOW_MS = 5.0  # floor of the window watched after each probe call
AFTER_DRAIN_MS = 2.0  # ... of which at least this after its drains


@dataclass
class Calls:
    """One side of the A/B: a function over rotating input sets."""

    fn: Callable[..., Any]
    input_sets: list[Any]
    side: str  # "reference" | "candidate"
    calls: int = 0

    def __call__(self) -> Any:
        slot = self.calls % len(self.input_sets)
        self.calls += 1
        return self.fn(*self.input_sets[slot])


@dataclass
class Reading:
    launches: int | None
    thread_cpu_ns: int
    a_calls: int
    b_calls: int

    @classmethod
    def take(cls, threads: counters.ThreadCpu, a: Calls, b: Calls) -> Reading:
        return cls(counters.device_launches(), threads.read_ns(), a.calls, b.calls)


@dataclass
class SideStats:
    samples: int = 0
    launches_in_call: list[int] = field(default_factory=list)
    launches_after: int = 0  # launches between this side's call and the next sample
    thread_cpu_in_call_ns: int = 0
    thread_cpu_after_ns: int = 0
    gaps: int = 0  # sample ends followed by a sample start with no call in between

    def to_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "launches_in_call": self.launches_in_call,
                "launches_after": self.launches_after,
                "thread_cpu_in_call_ms": self.thread_cpu_in_call_ns / 1e6,
                "thread_cpu_after_ms": self.thread_cpu_after_ns / 1e6, "gaps": self.gaps}


def run_delay_ns(fd: int | None = None) -> int | None:
    """Nanoseconds this thread has waited on a run queue for a CPU (its schedstat), or
    None where the kernel does not report it.  ``fd``: the thread's schedstat, open
    (``os.pread`` on it costs ~4 us, opening the file each time ~20-70 us)."""
    try:
        if fd is not None:
            return int(os.pread(fd, 128, 0).split()[1])
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Pending:
    """A sample in flight: the inner timer's handle and the thread's run delay in it."""

    inner: Any
    delay_ns: int | None


class CountingTimer:
    """A :class:`~krex.measure.timers.Timer` proxy that counts around each sample.

    With a timer of the thread's own execution (``CpuTimer``) each sample also carries
    the run delay of the timing thread over its span: ``offcpu_ms`` -- the time it
    waited for a CPU while it was being timed (another task had its core), for
    compare's ``screen_offcpu``.  Not with a device timer: a device's samples can be
    disturbed where the holder's wait does not show.
    """

    def __init__(self, inner: Any, a: Calls, b: Calls, threads: counters.ThreadCpu) -> None:
        self.inner = inner
        self.name, self.device, self.resolution_ms = inner.name, inner.device, inner.resolution_ms
        self.a, self.b, self.threads = a, b, threads
        self.stats = {a.side: SideStats(), b.side: SideStats()}
        self._before: Reading | None = None
        self._after: tuple[SideStats, Reading] | None = None  # the last sample's side and end
        self._flush_launches = 0  # krex's own launches (cache flushes) since the last sample
        self._schedstat: int | None = None  # the timing thread's, open while timing
        if hasattr(inner, "offcpu_ms"):  # a timer of the thread's own execution (cpu) only:
            # a device's samples are disturbed where the holder's wait does not show
            # (fakegpu's kernels run in a server on the other cores; a same-speed pair
            # read 1.65x with every preempted pair set aside, at load 5)
            if run_delay_ns() is not None:
                self._schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
                self.offcpu_ms: Callable[[Pending], float] = self._delay_ms
            else:  # no schedstat: wall minus thread CPU time
                self.offcpu_ms = lambda p: float(inner.offcpu_ms(p.inner))
        if hasattr(inner, "clocks"):
            self.clocks = inner.clocks

    def _read(self) -> Reading:
        return Reading.take(self.threads, self.a, self.b)

    def start(self) -> Any:
        before = self._read()
        self._close_gap(before)
        self._before = before
        delay = self._run_delay()
        return Pending(self.inner.start(), delay)

    def _run_delay(self) -> int | None:
        return None if self._schedstat is None else run_delay_ns(self._schedstat)

    def close(self) -> None:
        """Close the timing thread's schedstat (the timing is over)."""
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None

    def stop(self, start: Pending) -> Pending:
        inner = self.inner.stop(start.inner)
        delay = self._run_delay()
        pending = Pending(inner, None if delay is None or start.delay_ns is None
                          else delay - start.delay_ns)
        after, before = self._read(), self._before
        self._before, self._after, self._flush_launches = None, None, 0
        if before is None:
            return pending
        a_ran, b_ran = after.a_calls - before.a_calls, after.b_calls - before.b_calls
        if (a_ran, b_ran) not in ((1, 0), (0, 1)):
            return pending
        stats = self.stats[self.a.side if a_ran else self.b.side]
        stats.samples += 1
        if after.launches is not None and before.launches is not None:
            stats.launches_in_call.append(after.launches - before.launches)
        stats.thread_cpu_in_call_ns += after.thread_cpu_ns - before.thread_cpu_ns
        self._after = (stats, after)
        return pending

    def _close_gap(self, now: Reading) -> None:
        """Attribute what happened since the last sample ended to that sample's side."""
        if self._after is None:
            return
        stats, after = self._after
        self._after = None
        if (now.a_calls, now.b_calls) != (after.a_calls, after.b_calls):
            return  # calls outside the samples (warm-up): not a clean gap
        stats.gaps += 1
        if now.launches is not None and after.launches is not None:
            stats.launches_after += max(0, now.launches - after.launches - self._flush_launches)
        stats.thread_cpu_after_ns += max(0, now.thread_cpu_ns - after.thread_cpu_ns)

    def flush_cache(self) -> None:
        before = counters.device_launches()
        self.inner.flush_cache()
        after = counters.device_launches()
        if before is not None and after is not None:
            self._flush_launches += after - before

    def synchronize(self) -> None:
        self.inner.synchronize()

    def elapsed_ms(self, pending: Pending) -> float:
        return float(self.inner.elapsed_ms(pending.inner))

    @staticmethod
    def _delay_ms(pending: Pending) -> float:
        return (pending.delay_ns or 0) / 1e6

    def waited_s(self) -> float | None:
        """Seconds the timing thread has waited for a CPU so far (None: not known)."""
        delay = self._run_delay()
        return None if delay is None else delay / 1e9

    def now_s(self) -> float:
        return float(self.inner.now_s())


@dataclass
class ProbeCall:
    side: str
    launches_in_call: int | None
    launches_after: int | None  # during the quiet window after the call returned
    thread_cpu_after_ms: float  # the candidate's threads, same window
    call_ms: float  # the call itself, on the host clock
    call_cpu_ms: float  # ... and the calling thread's CPU time in it (preemption adds none)
    preempted: int  # involuntary context switches of the calling thread during the call
    synced_ms: float  # call + synchronising the current context
    pending_ms: float | None  # first drain of all contexts minus a second one: work still queued
    window_ms: float  # watched after the call: synchronisation and drains included

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def return_probe(sides: list[Calls], timer: Any, threads: counters.ThreadCpu) -> list[ProbeCall]:
    """Each side called :data:`PROBE_CALLS` times, each call watched after it returned.

    After a call: synchronise the context (what a timer on the default stream
    waits for), drain every context the process launched on twice (the first
    drain minus the second is work still queued elsewhere), then a quiet
    window of four times the call, at least :data:`QUIET_WINDOW_MS`, at most
    100 ms.  Once a drain times out the rest skip it (the queue is known).
    """
    out: list[ProbeCall] = []
    for _ in range(PROBE_CALLS):
        for calls in sides:
            drain = not any((c.pending_ms or 0) >= counters.DRAIN_TIMEOUT_S * 1e3 for c in out)
            out.append(_probe_one(calls, timer, threads, drain))
    return out


def _probe_one(calls: Calls, timer: Any, threads: counters.ThreadCpu, drain: bool) -> ProbeCall:
    l0, switches = counters.device_launches(), _involuntary_switches()
    t0, cpu0 = time.perf_counter(), time.thread_time_ns()
    calls()
    call_ms, call_cpu_ms = (time.perf_counter() - t0) * 1e3, (time.thread_time_ns() - cpu0) / 1e6
    switches = _involuntary_switches() - switches
    l1, c1 = counters.device_launches(), threads.read_ns()
    watched = time.perf_counter()  # from here every launch and thread's CPU time counts
    timer.synchronize()
    synced_ms = (time.perf_counter() - t0) * 1e3
    pending = _pending_ms() if drain else None
    window_ms = max(QUIET_WINDOW_MS, min(4 * synced_ms, 100.0))
    spent_ms = (time.perf_counter() - watched) * 1e3  # the synchronisation and the drains
    # were watched already: the window only tops them up to its length — but a launch
    # parked at our gate while it drained gets some time to go through once it reopened
    after_ms = AFTER_DRAIN_MS if pending is not None else 0.0
    time.sleep(max(after_ms, window_ms - spent_ms) / 1e3)
    l2, c2 = counters.device_launches(), threads.read_ns()
    watched_ms = (time.perf_counter() - watched) * 1e3
    return ProbeCall(calls.side, None if l0 is None or l1 is None else l1 - l0,
                     None if l1 is None or l2 is None else l2 - l1, (c2 - c1) / 1e6, call_ms,
                     call_cpu_ms, switches, synced_ms, pending, watched_ms)


def _involuntary_switches() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


BURST_MS = 25.0  # a burst is about this much of the side's own (synchronised) time
BURST_CALLS = (5, 50)


@dataclass
class Burst:
    """Calls back to back, as in the timed loop, then one synchronisation and a drain."""

    side: str
    calls: int
    host_ms: float  # the calls, host clock
    synced_ms: float  # ... plus synchronising the current context (what a timer waits for)
    pending_ms: float | None  # then queued elsewhere: first drain minus a second one
    first_pending_ms: float | None = None  # a first burst's, when it looked like work queued

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def burst(calls: Calls, timer: Any, per_call_ms: float) -> Burst:
    n = int(min(max(BURST_MS / max(per_call_ms, 1e-3), BURST_CALLS[0]), BURST_CALLS[1]))
    t0 = time.perf_counter()
    for _ in range(n):
        calls()
    host_ms = (time.perf_counter() - t0) * 1e3
    timer.synchronize()
    synced_ms = (time.perf_counter() - t0) * 1e3
    return Burst(calls.side, n, host_ms, synced_ms, _pending_ms())


def _pending_ms() -> float | None:
    first = counters.self_drain_ms()
    if first is None or first >= counters.DRAIN_TIMEOUT_S * 1e3:
        return first
    second = counters.self_drain_ms()
    return None if second is None else max(0.0, first - second)


@dataclass
class ProbeBox:
    """Where the region wrapper leaves the probe's result (the last attempt's)."""

    calls: list[ProbeCall] = field(default_factory=list)
    bursts: list[Burst] = field(default_factory=list)
    error: str | None = None
    regions: int = 0


def run(sides: list[Calls], timer: Any, threads: counters.ThreadCpu, box: ProbeBox) -> None:
    """The whole return probe: single calls of the candidate watched, then a burst of
    them where the interposer is loaded.  The reference is not probed (it held a
    device's region ~30 ms per evaluation for single calls and ~30 ms for a burst): the
    baseline of launches after a call is its rate in the timed loop's gaps
    (judge._probe_evidence), and its drains read nothing the candidate's drains after
    them did not read as well.
    """
    box.bursts = []
    box.calls = return_probe([s for s in sides if s.side == "candidate"], timer, threads)
    if counters.device_launches() is None:  # no interposer: nothing queued anywhere to drain
        return
    for calls in sides:
        if calls.side != "candidate":  # a reference burst was judged by nothing but its
            continue  # drain's timeout, which the candidate's drains after it read as well
        per_call = [c.synced_ms for c in box.calls if c.side == calls.side]
        median = sorted(per_call)[len(per_call) // 2]
        first = burst(calls, timer, median)
        if calls.side == "candidate" and _looks_queued(first):
            again = burst(calls, timer, median)  # a drain preempted by other load reads as
            if again.pending_ms is not None:  # queued work once; hidden work reads so twice
                again.first_pending_ms = first.pending_ms
                first = again if again.pending_ms < (first.pending_ms or 0.0) else first
        box.bursts.append(first)


def _looks_queued(b: Burst) -> bool:
    """What the judge would call work still queued after the burst (judge._pending)."""
    from krex.evaluate.judge import BURST_PENDING_MIN_MS, BURST_PENDING_SHARE

    return b.pending_ms is not None and counters.DRAIN_TIMEOUT_S * 1e3 > b.pending_ms > max(
        BURST_PENDING_MIN_MS, BURST_PENDING_SHARE * b.synced_ms)


def guarded(run_probe: Callable[[], None], box: ProbeBox) -> None:
    """Run the probe; the candidate raising in it is reported in ``box``, not lost."""
    try:
        run_probe()
    except Exception as exc:  # noqa: BLE001  (the candidate raised: reported, not lost)
        box.error = f"{type(exc).__name__}: {exc}"


def probing_region(inner: Callable[..., Any], run_probe: Callable[[], None],
                   box: ProbeBox) -> Callable[..., Any]:
    """A region factory that runs ``run_probe`` at the end of each region, still inside it."""

    @contextlib.contextmanager
    def factory(device: str, **kw: Any) -> Iterator[Any]:
        with inner(device, **kw) as region:
            yield region
            box.regions += 1
            guarded(run_probe, box)

    return factory
