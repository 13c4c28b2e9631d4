"""Timers: replaceable parts that turn ``start(); fn(); stop()`` into milliseconds.

A :class:`Timer` records a start mark, a stop mark, and later (after
``synchronize()``) reads the elapsed milliseconds between them.  Device
timers record events on the device stream, so a batch of samples needs only
one host synchronisation.  ``now_s()`` is the clock the stopping rules use
for their wall-time limits: real timers return the host clock, the
:class:`FakeTimer` returns its virtual clock so stopping is deterministic.

Device event timers live in :mod:`krex.measure.events`; :func:`make_timer`
picks one for a device string ("cpu", "cuda:0", "rocm:0", "fakegpu:0").
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import cycle
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Timer(Protocol):
    """What the measurement loop needs from a clock."""

    name: str
    device: str
    resolution_ms: float  # the shortest duration this timer measures meaningfully

    def start(self) -> Any: ...

    def stop(self, start: Any) -> Any: ...

    def synchronize(self) -> None: ...

    def elapsed_ms(self, pending: Any) -> float: ...

    def now_s(self) -> float: ...

    def flush_cache(self) -> None: ...


@dataclass
class CpuSample:
    wall_ns: int
    cpu_ns: int


class CpuTimer:
    """Wall time with ``perf_counter_ns`` plus the thread's CPU time.

    ``offcpu_ms(pending)`` is wall minus thread CPU time: time the measured
    thread was not running (preempted, blocked) — the interference signal.
    """

    name = "cpu"

    def __init__(self, device: str = "cpu", flush_bytes: int | None = None) -> None:
        self.device = device
        self.resolution_ms = cpu_timer_resolution_ms()
        self._flusher: Any = None
        self._flush_bytes = flush_bytes

    @property
    def flush_bytes(self) -> int:
        """Bytes written per cold-cache flush (``flush_bytes=`` or the timed core's caches)."""
        if self._flusher is not None:
            return int(self._flusher.size_bytes)
        from krex.measure.cache import default_flush_bytes

        return self._flush_bytes or default_flush_bytes()

    def start(self) -> tuple[int, int]:
        return time.thread_time_ns(), time.perf_counter_ns()

    def stop(self, start: tuple[int, int]) -> CpuSample:
        wall = time.perf_counter_ns()
        cpu = time.thread_time_ns()
        return CpuSample(wall - start[1], cpu - start[0])

    def synchronize(self) -> None:
        pass

    def elapsed_ms(self, pending: CpuSample) -> float:
        return pending.wall_ns / 1e6

    def offcpu_ms(self, pending: CpuSample) -> float:
        return max(0.0, (pending.wall_ns - pending.cpu_ns) / 1e6)

    def now_s(self) -> float:
        return time.perf_counter()

    def flush_cache(self) -> None:
        if self._flusher is None:
            from krex.measure.cache import CpuCacheFlusher

            self._flusher = CpuCacheFlusher(self._flush_bytes)
        self._flusher.flush()


_OVERHEAD_MS: list[float] = []


def cpu_timer_resolution_ms() -> float:
    """The shortest span the CpuTimer resolves: its clock's tick or the cost of an
    empty start/stop pair, whichever is larger (≈ 0.2 µs on the development machine)."""
    tick_ms = time.get_clock_info("perf_counter").resolution * 1e3
    return max(tick_ms, _perf_counter_overhead_ms())


def _perf_counter_overhead_ms(samples: int = 201) -> float:
    """Median cost of an empty CpuTimer sample (measured once per process)."""
    if not _OVERHEAD_MS:
        timer = CpuTimer.__new__(CpuTimer)
        costs = sorted(timer.stop(timer.start()).wall_ns for _ in range(samples))
        _OVERHEAD_MS.append(max(costs[samples // 2], 1) / 1e6)
    return _OVERHEAD_MS[0]


class FakeKernel:
    """A callable that advances its FakeTimer's virtual clock when called."""

    def __init__(self, timer: FakeTimer, durations_ms: Iterator[float]) -> None:
        self._timer = timer
        self._durations = durations_ms
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        self._timer.advance_ms(next(self._durations))


class FakeTimer:
    """A deterministic virtual device for tests: kernels are scripted durations.

    ``timer.kernel(1.0, noise_rel=0.01)`` is a callable taking 1 ms ± 1 %
    (seeded normal noise) of virtual time; ``timer.kernel(durations_ms=[...])``
    cycles through a script.  Every host operation (start/stop/flush) costs
    ``host_overhead_ms`` of virtual time outside the samples.
    """

    name = "fake"

    def __init__(
        self,
        seed: int = 0,
        host_overhead_ms: float = 0.001,
        resolution_ms: float = 0.0005,
        device: str = "cpu",  # the device whose region guards the fake (a real one)
    ) -> None:
        self.device = device
        self.resolution_ms = resolution_ms
        self.host_overhead_ms = host_overhead_ms
        self.clock_ms = 0.0
        self.flushes = 0
        self.syncs = 0
        self.clock_script: list[dict[str, Any]] = []
        self._rng = random.Random(seed)

    def kernel(
        self,
        ms: float = 1.0,
        noise_rel: float = 0.0,
        durations_ms: Iterable[float] | None = None,
        drift: Callable[[float], float] | None = None,
    ) -> FakeKernel:
        """A fake kernel; ``drift(clock_s)`` multiplies its duration (machine drift)."""
        if durations_ms is not None:
            return FakeKernel(self, cycle(list(durations_ms)))
        return FakeKernel(self, self._gaussian(ms, noise_rel, drift))

    def _gaussian(self, ms: float, noise_rel: float, drift) -> Iterator[float]:
        while True:
            factor = drift(self.clock_ms / 1e3) if drift else 1.0
            yield max(0.0, ms * factor * (1.0 + self._rng.gauss(0.0, noise_rel)))

    def advance_ms(self, ms: float) -> None:
        self.clock_ms += ms

    def start(self) -> float:
        self.advance_ms(self.host_overhead_ms)
        return self.clock_ms

    def stop(self, start: float) -> float:
        elapsed = self.clock_ms - start
        self.advance_ms(self.host_overhead_ms)
        return elapsed

    def synchronize(self) -> None:
        self.syncs += 1

    def elapsed_ms(self, pending: float) -> float:
        return pending

    def now_s(self) -> float:
        return self.clock_ms / 1e3

    def clocks(self) -> dict[str, Any]:
        """Scripted clocks (``timer.clock_script``), else none: never the host's."""
        return self.clock_script.pop(0) if self.clock_script else {}

    def flush_cache(self) -> None:
        self.flushes += 1
        self.advance_ms(self.host_overhead_ms)


def make_timer(device: str | None) -> Timer:
    """The natural timer for a device string; :class:`~krex.errors.UnknownDevice` for a bad one
    (the same error ``krex.region`` raises)."""
    from krex.devices.discovery import parse_device

    name = parse_device(device or "cpu")
    kind, _, ordinal = name.partition(":")
    index = int(ordinal or 0)
    if kind == "cpu":
        return CpuTimer(name)
    from krex.measure import events

    if kind == "cuda":
        return events.CudaEventTimer(index)
    if kind == "rocm":
        return events.HipEventTimer(index)
    return events.FakegpuTimer(index)
