"""``measure`` (a :class:`Measurement` with evidence) and ``bench`` (do_bench's shape)."""

from __future__ import annotations

import math
import warnings as _warnings
from collections.abc import Callable, Sequence
from typing import Any

from krex.measure import checks, graphs, loop, stats
from krex.measure.options import TimingOptions
from krex.measure.regions import RegionFactory
from krex.measure.result import Measurement, split_findings
from krex.measure.stopping import CountRule, NoiseRule
from krex.measure.timers import Timer

RETURN_MODES = ("min", "max", "mean", "median", "all")


class BenchWarning(UserWarning):
    """The Python warning ``bench`` issues (it returns bare floats) for each
    :class:`~krex.measure.checks.MeasureWarning` of its measurement."""


class BenchCostHint(UserWarning):
    """Issued by ``bench``, once per process and kind, when flushes dominate the hold.

    A hint is about cost, not trust: the number is as good as without it.
    """


_HINTED: set[str] = set()


def measure(
    fn: Callable[[], Any],
    *,
    device: str | None = None,
    warmup_ms: float = 25.0,
    rep_ms: float | None = None,
    noise_target: float = 0.005,
    min_time_s: float = 0.1,
    max_time_s: float = 1.0,
    timeout_s: float = 5.0,
    cache: str = "cold",
    grad_to_none: Sequence[Any] | None = None,
    cuda_graph: str | bool = "auto",
    retries: int = 2,
    label: str | None = None,
    max_hold_s: float | None = None,
    inregion_warmup_ms: float = 1.0,
    timer: Timer | None = None,
    region: RegionFactory | None = None,
) -> Measurement:
    """Time ``fn`` inside a region and return samples, statistics and warnings.

    Outside the region: first call, estimate, ``warmup_ms`` of warm-up.  Inside:
    ``inregion_warmup_ms`` of warm-up, then samples until the noise rule stops
    (or, with ``rep_ms``, a fixed count from that budget, as do_bench does).
    """
    opts = TimingOptions(device=device, warmup_ms=warmup_ms, cache=cache, retries=retries,
                         label=label, max_hold_s=max_hold_s, timeout_s=timeout_s, timer=timer,
                         region=region)
    if rep_ms is None and min_time_s > max_time_s:
        raise ValueError(f"min_time_s ({min_time_s}) is above max_time_s ({max_time_s})")
    timer, device = opts.resolve()
    plan = loop.Plan(fn, timer, cold=opts.cold, grad_to_none=grad_to_none)
    estimate = loop.first_call_and_estimate(plan)
    plan, estimate, graphed = _maybe_graph(plan, estimate, cuda_graph, device)
    warmups = loop.warm_up(plan, warmup_ms, estimate.call_ms)

    def rule() -> Any:  # a fresh one per region: the noise rule keeps history
        return _rule(rep_ms, inregion_warmup_ms, estimate, noise_target, min_time_s,
                     max_time_s, timeout_s)

    def body(hold: loop.Hold) -> loop.LoopResult:
        loop.warm_up(plan, inregion_warmup_ms, estimate.call_ms)
        return loop.timed_loop(plan, rule(), estimate, hold)

    run = loop.timed_region(body, opts, device, timer, budget_s=rule().limit()[0])
    target = None if rep_ms is not None else noise_target
    return _build(run, timer, device, cache, target, warmups, estimate, graphed, label)


def _rule(rep_ms, inregion_warmup_ms, estimate, noise_target, min_time_s, max_time_s, timeout_s):
    """do_bench's count from ``rep_ms`` (a sample's estimate includes its flush, as in
    triton; raised in the region from the samples' own wall time: ``CountRule.refit``),
    bounded by ``rep_ms`` of hold after the in-region warm-up (``inregion_warmup_ms`` or
    one call); else the noise rule."""
    if rep_ms is not None:
        count = max(1, int(rep_ms / estimate.sample_wall_ms))
        warm_ms = max(inregion_warmup_ms, estimate.call_ms)
        return CountRule(count, timeout_s=timeout_s, max_time_s=(rep_ms + warm_ms) / 1e3,
                         rep_ms=rep_ms)
    return NoiseRule(noise_target, min_time_s, max_time_s, timeout_s)


def _maybe_graph(plan, estimate, mode, device):
    if not graphs.wanted(mode, device, estimate.call_ms):
        return plan, estimate, False
    captured = graphs.capture(plan.fn, estimate.call_ms)
    if captured is None:
        return plan, estimate, False
    replay, inner = captured
    graphed = loop.Plan(replay, plan.timer, plan.cold, plan.grad_to_none, inner=inner)
    return graphed, loop.first_call_and_estimate(graphed), True


def _build(run, timer, device, cache, target, warmups, estimate, graphed, label) -> Measurement:
    result: loop.LoopResult = run.value
    summary = stats.summarize(result.samples_ms)
    findings = _findings(run, result, summary, timer, target)
    warnings, details = split_findings(findings)
    overhead_ms = loop.overhead_per_sample_ms(result.samples_ms, result.elapsed_s)
    flush_bytes = getattr(timer, "flush_bytes", None) if cache == "cold" else None
    return Measurement(
        samples_ms=result.samples_ms,
        device=device,
        timer=timer.name,
        **summary,
        stop_reason=result.stop_reason,
        noise_target=target,
        cache=cache,
        warmup_iterations=warmups,
        estimate_ms=estimate.call_ms,
        elapsed_s=result.elapsed_s,
        region=run.report,
        attempts=run.attempts,
        rejected_regions=run.rejected,
        clocks_start=run.clocks_start,
        clocks_end=run.clocks_end,
        offcpu_fraction=_offcpu_fraction(result),
        cuda_graph=graphed,
        label=label,
        warnings=warnings,
        warning_details=details,
        flush_bytes=flush_bytes,
        overhead_ms=overhead_ms,
        hints=checks.cost_hints(cache, flush_bytes, overhead_ms, summary["median_ms"]),
    )


def _findings(run, result, summary, timer, target) -> list[checks.Finding]:
    return [
        *checks.region(run.report),
        *checks.plausibility(result.samples_ms, run.report.held_s),
        *checks.timer_resolution(summary["median_ms"], timer.resolution_ms),
        *checks.noise(result.stop_reason, result.samples_ms, summary["noise_rel"], target),
        *checks.throttle(run.clocks_start, run.clocks_end, run.report),
    ]


def _offcpu_fraction(result: loop.LoopResult) -> float | None:
    if not result.offcpu_ms:
        return None
    wall = math.fsum(result.samples_ms)
    return math.fsum(result.offcpu_ms) / wall if wall > 0 else None


def bench(
    fn: Callable[[], Any],
    warmup: float = 25,
    rep: float = 100,
    grad_to_none: Sequence[Any] | None = None,
    quantiles: Sequence[float] | None = None,
    return_mode: str = "mean",
    *,
    device: str | None = None,
    cache: str = "cold",
    retries: int = 2,
    timeout_s: float = 60.0,
    timer: Timer | None = None,
    region: RegionFactory | None = None,
) -> float | list[float]:
    """``triton.testing.do_bench`` inside a krex region: same arguments, same returns.

    ``warmup`` and ``rep`` are budgets in ms; returns ms as a float, a list for
    ``quantiles`` (a float when one quantile is asked) or ``return_mode="all"``.
    Warnings of the measurement are issued as :class:`BenchWarning`.
    """
    if return_mode not in RETURN_MODES:
        raise ValueError(f"return_mode must be one of {RETURN_MODES}, not {return_mode!r}")
    m = measure(
        fn, device=device, warmup_ms=warmup, rep_ms=rep, grad_to_none=grad_to_none,
        cache=cache, retries=retries, timeout_s=timeout_s, timer=timer, region=region,
    )  # fmt: skip
    _issue_warnings(m)
    return summarize_like_do_bench(m.samples_ms, quantiles, return_mode)


def summarize_like_do_bench(
    times_ms: Sequence[float], quantiles: Sequence[float] | None, return_mode: str
) -> float | list[float]:
    """triton's ``_summarize_statistics``: torch.quantile / torch.median semantics."""
    if quantiles is not None:
        values = [stats.quantile(times_ms, q) for q in quantiles]
        return values[0] if len(values) == 1 else values
    if return_mode == "all":
        return list(times_ms)
    reducers: dict[str, Callable[[Sequence[float]], float]] = {
        "min": min, "max": max, "mean": stats.mean, "median": stats.lower_median}
    return float(reducers[return_mode](times_ms))


def _issue_warnings(m: Measurement) -> None:
    for w in m.warnings:
        detail = m.warning_details.get(w.name, "")
        text = f"krex.bench: {w.summary} ({detail}) (hint: {w.next_action})"
        _warnings.warn(text, BenchWarning, stacklevel=3)
    for hint in m.hints:
        kind = hint.split(":", 1)[0]
        if kind not in _HINTED:
            _HINTED.add(kind)
            _warnings.warn(f"krex.bench: {hint}", BenchCostHint, stacklevel=3)
