"""A/B comparison inside one region: interleaved samples, a paired interval, a verdict.

Baseline (A) and candidate (B) samples alternate in ABBA blocks (or a seeded
random AB/BA order), so each A sample has a B neighbour taken moments apart;
machine drift (±30 % between minutes here) cancels within a pair.  The
estimate is the median of paired log-ratios ``ln(a/b)``; its interval is the
distribution-free sign-test interval of that median, so a few 50 ms
scheduler hits move neither.  ``speedup = exp(median)``: above 1 the
candidate is faster.

Verdict: ``same`` when the whole interval lies within ``±same_within``;
``faster`` / ``slower`` when it excludes 1 (and is not ``same``); else
``unclear``.  Sampling stops early once a verdict is clear at a stricter
confidence (``1 - (1 - confidence) / 5``, a guard against optional-stopping
false alarms), or at the time limits; not before ``min_pairs`` — except that a
*material* effect, whose stricter interval lies wholly outside
``±same_within`` (e.g. beyond 1.06 with a 6 % band), may stop after
``early_pairs``: a large true effect needs few pairs, a verdict near the band
keeps the floor.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from krex.measure import checks, loop, stats, stopping
from krex.measure.options import TimingOptions
from krex.measure.regions import RegionFactory
from krex.measure.result import Comparison, split_findings
from krex.measure.timers import Timer

FASTER, SLOWER, SAME, UNCLEAR = "faster", "slower", "same", "unclear"
EARLY_STOP_ALPHA_DIVISOR = 5.0
MEASURED_LOOK_MS = 2.5  # without an estimate: wall time between two looks, as measured
OFFCPU_MIN_MS = 0.05  # a sample whose thread was off its CPU longer than this ...
OFFCPU_SHARE = 0.02  # ... and than this share of the sample was preempted (screen_offcpu)


def preempted(offcpu_ms: float, wall_ms: float) -> bool:
    """The timed thread was off its CPU for a material part of the sample: a scheduler
    slice lost to another task (~ a 4 ms tick here), not a kernel thread's microseconds."""
    return offcpu_ms > max(OFFCPU_MIN_MS, OFFCPU_SHARE * wall_ms)


def verdict(ci_low: float, ci_high: float, same_within: float) -> str:
    """faster / slower / same / unclear from a speedup interval."""
    if ci_low >= 1.0 / (1.0 + same_within) and ci_high <= 1.0 + same_within:
        return SAME
    if ci_low > 1.0:
        return FASTER
    if ci_high < 1.0:
        return SLOWER
    return UNCLEAR


def speedup_interval(log_ratios: list[float], confidence: float) -> tuple[float, float, float]:
    """(speedup, low, high) from paired ln(baseline / candidate) values."""
    low, high = stats.median_ci(log_ratios, confidence)
    return math.exp(stats.median(log_ratios)), math.exp(low), math.exp(high)


@dataclass
class _Limits:
    min_pairs: int
    min_time_s: float
    max_time_s: float
    timeout_s: float
    confidence: float
    same_within: float
    early_pairs: int | None = None
    decisive_only: bool = False
    same_at_confidence: bool = False
    screen_offcpu: bool = False


def material(low: float, high: float, same_within: float) -> bool:
    """The whole interval lies beyond the ±same_within band: a difference, and a large one."""
    return low > 1.0 + same_within or high < 1.0 / (1.0 + same_within)


def covering_pairs(confidence: float) -> int:
    """Fewest pairs whose sign-test interval reaches ``confidence`` at all: below it the
    interval is the whole range of the ratios, and all of a few pairs on one side of a
    band happens by chance far more often than ``1 - confidence``."""
    return math.ceil(math.log2(2.0 / (1.0 - confidence)) - 1e-9)


@dataclass
class _PairLoop:
    """Samples A and B alternately and decides when the verdict is clear."""

    a: loop.Plan
    b: loop.Plan
    limits: _Limits
    order: str
    rng: random.Random
    a_ms: list[float] = field(default_factory=list)
    b_ms: list[float] = field(default_factory=list)
    stop_reason: str = ""
    elapsed_s: float = 0.0
    discarded_a_ms: list[float] = field(default_factory=list)  # pairs screened out
    discarded_b_ms: list[float] = field(default_factory=list)
    set_aside_s: float = 0.0  # the time their samples took
    waited_at_start_s: float | None = None  # the timer's waited_s() when the loop began

    def block(self) -> None:
        """Two pairs: ABBA, or two independently shuffled AB/BA pairs.  With
        ``screen_offcpu`` a pair either of whose samples was preempted is set aside."""
        if self.order == "abba":
            sequence = "ABBA"
        else:
            sequence = "".join(self.rng.choice(("AB", "BA")) for _ in range(2))
        pending = [(kind, loop.take_sample(self.a if kind == "A" else self.b)) for kind in sequence]
        self.a.timer.synchronize()
        offcpu = getattr(self.a.timer, "offcpu_ms", None) if self.limits.screen_offcpu else None
        read = []
        for kind, p in pending:
            plan = self.a if kind == "A" else self.b
            ms = plan.timer.elapsed_ms(p) / plan.inner
            read.append((kind, ms, offcpu is not None and preempted(offcpu(p), ms * plan.inner)))
        for first in (0, 2):  # the two pairs of the block
            pair = read[first:first + 2]
            kept = not any(hit for _, _, hit in pair)
            if not kept:  # (a sample's wall time includes the wait that set it aside)
                self.set_aside_s += sum(ms for _, ms, _ in pair) / 1e3
            for kind, ms, _ in pair:
                into = (self.a_ms, self.b_ms) if kept else (self.discarded_a_ms,
                                                            self.discarded_b_ms)
                into[0 if kind == "A" else 1].append(ms)

    @property
    def screened(self) -> bool:
        """Pairs were screened for preemption (the timer can tell off-CPU time)."""
        return self.limits.screen_offcpu and hasattr(self.a.timer, "offcpu_ms")

    def kept_most(self) -> bool:
        """Screened, and at least half the pairs kept (the rest set aside)."""
        return self.screened and len(self.discarded_a_ms) <= len(self.a_ms)

    def keep_all_if_too_few(self) -> None:
        """At the end: too few clean pairs for any interval -- use every pair, screened
        or not (``screened`` then reports nothing was set aside)."""
        if self.discarded_a_ms and len(self.a_ms) < covering_pairs(self.limits.confidence):
            self.a_ms += self.discarded_a_ms
            self.b_ms += self.discarded_b_ms
            self.discarded_a_ms, self.discarded_b_ms = [], []
            self.limits = replace(self.limits, screen_offcpu=False)

    def limit(self) -> tuple[float, str]:
        """The hold's limit and its stop reason: ``max_time_s`` plus, when screening, the
        time the pairs set aside took and the time the timing thread waited for its CPU
        between samples (the timer's ``waited_s``; other tasks had its core: the kept
        pairs get the budget an undisturbed loop's pairs would), never past ``timeout_s``."""
        lim = self.limits
        credit = self.set_aside_s
        waited = getattr(self.a.timer, "waited_s", None) if self.screened else None
        if waited is not None and self.waited_at_start_s is not None:
            credit += max(0.0, waited() - self.waited_at_start_s)
        return stopping.wall_limit(lim.max_time_s + credit, lim.timeout_s)

    def decide(self, held_s: float) -> str | None:
        """``held_s``: time since the region was entered."""
        lim = self.limits
        limit_s, reason = self.limit()
        if held_s >= limit_s:
            return reason
        measured_s = (math.fsum(self.a_ms) + math.fsum(self.b_ms)) / 1e3
        strict = 1.0 - (1.0 - lim.confidence) / EARLY_STOP_ALPHA_DIVISOR
        early = max(lim.early_pairs or lim.min_pairs, covering_pairs(strict))
        if len(self.a_ms) < min(lim.min_pairs, early) or measured_s < lim.min_time_s:
            return None
        _, low, high = speedup_interval(self.log_ratios(), strict)
        if len(self.a_ms) < lim.min_pairs:
            return "clear" if material(low, high, lim.same_within) else None
        if lim.same_at_confidence and self.same_as_reported():
            return "clear"
        found = verdict(low, high, lim.same_within)
        if lim.decisive_only and found in (FASTER, SLOWER):  # 1 excluded: not enough
            return "clear" if material(low, high, lim.same_within) else None
        return "clear" if found != UNCLEAR else None

    def same_as_reported(self) -> bool:
        """The interval at ``confidence`` -- the one the result reports -- lies within the
        band: ``same`` is what the result will say, whatever more pairs would add."""
        _, low, high = speedup_interval(self.log_ratios(), self.limits.confidence)
        return verdict(low, high, self.limits.same_within) == SAME

    def blocks_to_next_look(self, per_block_s: float | None) -> int:
        """Without an estimate: one block first; then about ``MEASURED_LOOK_MS`` of blocks
        as measured in the region (the estimate before it, taken while others still ran,
        made the groups of the other way one or two blocks of kernels near a
        millisecond), cut so that a look falls on the pair counts where :meth:`decide`
        may first stop (the early floor, ``min_pairs``) -- not a group past them."""
        if not per_block_s:
            return 1
        lim, have = self.limits, len(self.a_ms)
        strict = 1.0 - (1.0 - lim.confidence) / EARLY_STOP_ALPHA_DIVISOR
        early = max(lim.early_pairs or lim.min_pairs, covering_pairs(strict))
        wanted = loop.batch_size(per_block_s * 1e3, MEASURED_LOOK_MS)
        for floor in sorted({min(lim.min_pairs, early), lim.min_pairs}):
            if floor > have:
                return max(1, min(wanted, math.ceil((floor - have) / 2)))
        return wanted

    def log_ratios(self) -> list[float]:
        return [
            math.log(a / b) for a, b in zip(self.a_ms, self.b_ms, strict=True) if a > 0 and b > 0
        ]

    def run(self, blocks_per_check: int | None, block_wall_s: float | None,
            hold: loop.Hold) -> tuple[str, float]:
        """Blocks until a reason to stop; a group of blocks is cut to what fits in the
        hold's limit (at least one block is taken).  Without an estimate
        (``blocks_per_check`` None) the first group is one block and each later one is
        sized from the blocks measured so far (:meth:`blocks_to_next_look`)."""
        timer = self.a.timer
        start_s = timer.now_s()
        waited = getattr(timer, "waited_s", None) if self.screened else None
        self.waited_at_start_s = waited() if waited is not None else None
        blocks = 0
        while True:
            limit_s, limit_reason = self.limit()
            limit_s = hold.limit(limit_s)
            now = timer.now_s()
            per_block_s = (now - start_s) / blocks if blocks else block_wall_s
            wanted = blocks_per_check or self.blocks_to_next_look(per_block_s)
            n = loop.samples_that_fit(limit_s - (now - hold.start_s), per_block_s or 0.0,
                                      wanted)
            if n < 1 and blocks:
                return limit_reason, timer.now_s() - start_s
            for _ in range(max(1, n)):
                self.block()
            blocks += max(1, n)
            reason = self.decide(timer.now_s() - hold.start_s)
            if reason:
                return reason, timer.now_s() - start_s


def compare(
    baseline: Callable[[], Any],
    candidate: Callable[[], Any],
    *,
    device: str | None = None,
    same_within: float = 0.01,
    confidence: float = 0.95,
    order: str = "abba",
    seed: int = 0,
    warmup_ms: float = 25.0,
    min_pairs: int = 10,
    early_pairs: int | None = None,
    min_time_s: float = 0.05,
    max_time_s: float = 2.0,
    timeout_s: float = 10.0,
    cache: str = "cold",
    retries: int = 2,
    label: str | None = None,
    max_hold_s: float | None = None,
    timer: Timer | None = None,
    region: RegionFactory | None = None,
    estimate_calls: int = loop.ESTIMATE_CALLS,
    decisive_only: bool = False,
    same_at_confidence: bool = False,
    screen_offcpu: bool = False,
) -> Comparison:
    """Is ``candidate`` faster than ``baseline``?  Both are timed in one region.

    ``estimate_calls``: samples per side, before the region, that size the batches between
    two stopping checks; 0: none -- each side is called once and warmed up for ``warmup_ms``
    by the clock (at least one call), and the batches are sized from the blocks measured in
    the region (the first check after one block; krex.evaluate, whose sides were called many
    times before, asks for this). ``decisive_only``: from ``min_pairs`` on, stop only when
    the interval lies within the band or wholly beyond it, not as soon as it excludes 1 —
    identical code under load has a median ratio ~1 % off 1 (position effects), and stopping
    at the first interval excluding it let noise decide a "slower" (krex.evaluate asks for
    this). ``same_at_confidence``: from ``min_pairs`` on, stop on ``same`` once the interval
    at ``confidence`` (the reported one) lies within the band, not only the stricter one:
    about a quarter fewer pairs for a same-speed candidate at 9 % pair noise; the looks add
    a little to the chance that a candidate just outside the band is called ``same`` (2 of
    400 simulated runs at a true 1.07x with a ±6 % band, none at 1.09x;
    tests/test_compare.py). ``faster``/``slower`` still stop only at the stricter confidence
    (krex.evaluate asks for this too).
    ``screen_offcpu`` (timers that tell a sample's off-CPU time: ``CpuTimer``, or any
    timer with ``offcpu_ms``): a pair either of whose samples was preempted
    (:func:`preempted`) is set aside and measured again -- the hold may run past
    ``max_time_s`` by the time the pairs set aside took, never past ``timeout_s``; the
    result counts them (``discarded_pairs``), and a region not clean only for the
    holder's contention is not retried when at least half the pairs were kept."""
    if order not in ("abba", "random"):
        raise ValueError(f"order must be 'abba' or 'random', not {order!r}")
    opts = TimingOptions(device=device, warmup_ms=warmup_ms, cache=cache, retries=retries,
                         label=label, max_hold_s=max_hold_s, timeout_s=timeout_s, timer=timer,
                         region=region)
    timer, device = opts.resolve()
    a, b = loop.Plan(baseline, timer, opts.cold), loop.Plan(candidate, timer, opts.cold)
    if estimate_calls < 0:
        raise ValueError(f"estimate_calls must be 0 or more, not {estimate_calls}")
    blocks: int | None = None
    block_wall_ms: float | None = None
    if estimate_calls:
        est_a, est_b = (loop.first_call_and_estimate(p, estimate_calls) for p in (a, b))
        for plan, est in ((a, est_a), (b, est_b)):
            loop.warm_up(plan, warmup_ms, est.call_ms)
        block_wall_ms = 2 * (est_a.sample_wall_ms + est_b.sample_wall_ms)
        blocks = max(1, loop.batch_size(block_wall_ms))
    else:
        for plan in (a, b):
            loop.first_call_and_warm_up(plan, warmup_ms)
    if early_pairs is not None and early_pairs < 1:
        raise ValueError(f"early_pairs must be at least 1, not {early_pairs}")
    limits = _Limits(min_pairs, min_time_s, max_time_s, timeout_s, confidence, same_within,
                     early_pairs, decisive_only, same_at_confidence, screen_offcpu)

    def body(hold: loop.Hold) -> _PairLoop:
        pairs = _PairLoop(a, b, limits, order, random.Random(seed))
        pairs.stop_reason, pairs.elapsed_s = pairs.run(
            blocks, block_wall_ms / 1e3 if block_wall_ms else None, hold)
        pairs.keep_all_if_too_few()
        return pairs

    budget_s = stopping.wall_limit(max_time_s, timeout_s)[0]
    run = loop.timed_region(body, opts, device, timer, budget_s=budget_s,
                            screened=_PairLoop.kept_most if screen_offcpu else None)
    return _build(run, timer, device, order, limits)


def _build(run: loop.RegionRun, timer: Timer, device: str, order: str, lim: _Limits):
    pairs: _PairLoop = run.value
    speedup, low, high = speedup_interval(pairs.log_ratios(), lim.confidence)
    decided = verdict(low, high, lim.same_within)
    findings = _findings(run, pairs, timer, decided, (low, high))
    warnings, details = split_findings(findings)
    samples = pairs.a_ms + pairs.b_ms
    overhead_ms = loop.overhead_per_sample_ms(samples, pairs.elapsed_s)
    flush_bytes = getattr(timer, "flush_bytes", None) if pairs.a.cold else None
    hints = checks.cost_hints("cold" if pairs.a.cold else "hot", flush_bytes, overhead_ms,
                              stats.median(samples))
    return Comparison(
        verdict=decided, speedup=speedup, ci_low=low, ci_high=high,
        confidence=lim.confidence, same_within=lim.same_within, pairs=len(pairs.a_ms),
        order=order, stop_reason=pairs.stop_reason,
        baseline=stats.summarize(pairs.a_ms), candidate=stats.summarize(pairs.b_ms),
        baseline_samples_ms=pairs.a_ms, candidate_samples_ms=pairs.b_ms,
        region=run.report, device=device, timer=timer.name, elapsed_s=pairs.elapsed_s,
        attempts=run.attempts, rejected_regions=run.rejected,
        warnings=warnings, warning_details=details,
        flush_bytes=flush_bytes, overhead_ms=overhead_ms, hints=hints,
        screened=pairs.screened, discarded_pairs=len(pairs.discarded_a_ms),
    )  # fmt: skip


def _findings(run, pairs: _PairLoop, timer: Timer, decided: str, ci) -> list[checks.Finding]:
    shortest = min(stats.median(pairs.a_ms), stats.median(pairs.b_ms))
    out = [
        *checks.region(run.report),
        *checks.plausibility(pairs.a_ms + pairs.b_ms, run.report.held_s),
        *checks.timer_resolution(shortest, timer.resolution_ms),
        *checks.throttle(run.clocks_start, run.clocks_end, run.report),
    ]
    if decided == UNCLEAR:
        detail = f"interval [{ci[0]:.4f}, {ci[1]:.4f}] after {len(pairs.a_ms)} pairs"
        out.append((checks.MeasureWarning.UNSTABLE, detail))
    return out
