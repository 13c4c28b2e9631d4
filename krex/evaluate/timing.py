"""The sealed A/B timing: ``krex.compare`` in the driver over dispatcher calls.

Both sides are callee processes (:mod:`krex.evaluate.sealed`); each sample is one
call as the driver's clock saw it, less the calibrated dispatch overhead.  After each
of the candidate's calls the driver decides -- with its own random numbers, after
the fact, invisibly to the candidate (every call's output is copied by the
dispatcher either way) -- whether to keep that output for checking: a uniform random
sample of all the calls (a reservoir), and always the last
:data:`KEEP_LAST`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from krex.errors import KrexError
from krex.evaluate import readings
from krex.evaluate.dispatch import OP_CALL, Refused

if TYPE_CHECKING:
    from krex.evaluate.callees import Callee
    from krex.evaluate.sealed import SealedRun

KEEP_RANDOM = 8  # timed calls whose outputs are kept for checking, a uniform sample
KEEP_LAST = 4  # ... and always the candidate's last calls (late ones included)
PROBE_HOLD_S = 20.0  # the region's maximum hold beyond the timing loop


@dataclass
class Span:
    ns: int
    offcpu_ns: int


class Side:
    """One side of the A/B for ``compare``: each call is one dispatcher call of its
    callee, over the rotation's argument sets."""

    def __init__(self, callee: Callee, slots: list[int], left: Any, keep: Any = None,
                 meter: Any = None) -> None:
        self.callee, self.slots, self.calls, self.left = callee, slots, 0, left
        self.spans: list[Span] = []
        self.keep = keep  # called after each call (candidate: maybe keep its output)
        self.meter = meter  # the callee's CPU time between its calls (GapMeter)

    def __call__(self) -> None:
        slot = self.slots[self.calls % len(self.slots)]
        self.calls += 1
        if self.meter is not None:
            self.meter.starting()
        delay0 = self.callee.run_delay_ns()
        record = self.callee.block.call(OP_CALL, slot, timeout_s=self.left())
        delay1 = self.callee.run_delay_ns()
        if self.meter is not None:
            self.meter.returned()
        if record.status != "ok":
            raise Refused(self.callee.role, "timing", record.status, record.message)
        offcpu = 0 if delay0 is None or delay1 is None else delay1 - delay0
        self.spans.append(Span(record.span_ns, offcpu))
        if self.keep is not None:
            self.keep(self.calls - 1, self.slots.index(slot))


class DispatchTimer:
    """The driver's clock for ``compare``: a sample is the calls made between start and
    stop, each from its request to its completion as this process saw them, minus the
    calibrated dispatch overhead; off-CPU time is the callee's run delay (the kernel's)."""

    name = "dispatch"
    resolution_ms = 0.001

    def __init__(self, device: str, sides: list[Side], overhead_ns: int) -> None:
        from krex.measure.timers import CpuTimer

        self.device, self.sides, self.overhead_ns = device, sides, overhead_ns
        self._flush = CpuTimer(device)

    def start(self) -> list[int]:
        return [len(s.spans) for s in self.sides]

    def stop(self, start: list[int]) -> list[Span]:
        return [x for s, n in zip(self.sides, start, strict=True) for x in s.spans[n:]]

    def elapsed_ms(self, pending: list[Span]) -> float:
        return sum(max(x.ns - self.overhead_ns, 1) for x in pending) / 1e6

    def offcpu_ms(self, pending: list[Span]) -> float:
        return sum(x.offcpu_ns for x in pending) / 1e6

    def synchronize(self) -> None:
        pass

    def now_s(self) -> float:
        return time.perf_counter()

    def flush_cache(self) -> None:
        self._flush.flush_cache()


class Keeper:
    """After each timed call of the candidate: keep its output or not; its mutation flag."""

    def __init__(self, run: SealedRun) -> None:
        self.run, self.block = run, run.cand.block
        self.random: list[tuple[str, Any]] = []  # a uniform sample of all calls so far
        self.last: list[tuple[str, Any]] = []
        self.mutated: set[str] = set()

    def __call__(self, call: int, rot: int) -> None:
        key = f"timed/{rot}/{call}"
        output = self.block.output(key)
        if call < KEEP_RANDOM:  # reservoir sampling: each call kept with the same chance
            self.random.append((key, output))
        else:
            j = self.run.rng.randrange(call + 1)
            if j < KEEP_RANDOM:
                self.random[j] = (key, output)
        self.last = [*self.last, (key, output)][-KEEP_LAST:]
        if self.block.mutated(self.run._left()):
            self.mutated.add(f"timed/{rot}")

    def kept(self) -> dict[str, Any]:
        return {**dict(self.random), **dict(self.last)}


class Reader:
    """The reference's side reads each output as the candidate's keeper does (and drops
    it): the driver's reads move the blocks' cache lines alike, so the next call's copy
    costs both sides the same (unread, the reference's copies ran ~1.5x faster: a true
    1x candidate read 0.66x)."""

    def __init__(self, block: Any) -> None:
        self.block = block

    def __call__(self, call: int, rot: int) -> None:
        self.block.output("r")
        self.block.mutated()


def timed(run: SealedRun) -> None:
    from krex.evaluate.worker import _timed_factory
    from krex.measure import compare
    from krex.measure.clocks import sample
    from krex.measure.regions import get_region_factory

    job, opts, parts = run.job, run.job["timing"], run.out["stage_s"]
    t0 = time.monotonic()
    rotation = job["cases"]["rotation"]
    keeper = Keeper(run)
    meters = [c.accounting.meter() if c.accounting is not None else None
              for c in (run.ref, run.cand)]  # both sides alike: the reference's is a control
    a = Side(run.ref, [run.ref.slots[c["id"]] for c in rotation], run._left,
             keep=Reader(run.ref.block), meter=meters[0])
    b = Side(run.cand, [run.cand.slots[c["id"]] for c in rotation], run._left, keep=keeper,
             meter=meters[1])
    timer = DispatchTimer(run.device, [a, b], run.overhead.quantile(0.5))
    factory = run.onecore.region(_timed_factory(get_region_factory(), parts))
    clocks_before = sample(run.device)
    parts["timing:setup"], t0 = time.monotonic() - t0, time.monotonic()
    try:
        result = compare(a, b, device=run.device, timer=timer, region=factory,
                         label=job.get("label"), retries=1,
                         max_hold_s=opts["timeout_s"] + PROBE_HOLD_S, **opts)
    except KrexError as exc:  # the region, not the candidate: no verdict, not a failure
        run.out["timing_error"] = f"{type(exc).__name__}: {exc}"
        return
    finally:
        parts["timing:compare"], t0 = time.monotonic() - t0, time.monotonic()
        for role, meter in zip(("reference", "candidate"), meters, strict=True):
            if meter is not None:
                meter.close()
                run.out["between_calls" if role == "candidate" else "reference_between_calls"] \
                    = {"cpu_ms": meter.outside_ns / 1e6, "gaps": meter.gaps}
    parts["timing:probe"] = 0.0  # the kernel's accounting (sealed.py) replaces the probe
    run.out["clocks"] = {"before": clocks_before, "after": sample(run.device)}
    run.out["comparison"] = readings.comparison(result)
    run.out["mutated"] += sorted(keeper.mutated)
    run.cand_out.update(keeper.kept())
    run.out["checked_timed"] = sorted(keeper.kept())
    parts["timing:outputs"] = time.monotonic() - t0
