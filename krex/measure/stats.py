"""Statistics of timing samples: pure functions on lists of floats — krex's one vocabulary.

Every quantile krex reports (measurements, the eval, the benchmarks, the GPU
check) comes from :func:`quantile`: ``q`` in [0, 1], linear interpolation
between order statistics (numpy's and torch's default, "type 7"), so "p95"
means the same in every results file; :func:`quantiles` names them
``p50``/``p95``/``p99``.  ``lower_median`` follows ``torch.median`` (the
lower of the two middle values), which ``bench`` needs to keep the exact
contract of ``triton.testing.do_bench``.

Inflation (how much slower a kernel ran under load than alone) is read three
ways, all in percent against a *reference* measured alone
(docs/benchmarks.md):

- per sample (:func:`per_sample_inflation_pct`): each sample ÷ the
  reference median — a sample's own jitter counts;
- quantile (:func:`quantile_inflation_pct`): the loaded run's quantile ÷ the
  reference run's same quantile — equal distributions read 0 everywhere;
- reported (:func:`inflation_pct` of two medians): a measurement's median ÷
  the reference median — what a user of ``krex.measure`` sees.

No numpy: the core of krex stays light.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

MAD_TO_SD = 1.4826  # MAD of a normal distribution times this is its standard deviation


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation between order statistics."""
    if not values:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} outside [0, 1]")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


DEFAULT_QS = (0.5, 0.95, 0.99)


def quantile_name(q: float) -> str:
    """``0.95`` -> ``"p95"``, ``0.999`` -> ``"p99.9"``."""
    return f"p{q * 100:g}"


def quantiles(values: Sequence[float], qs: Sequence[float] = DEFAULT_QS) -> dict[str, float]:
    """Named quantiles (``p50``, ``p95``, ...) of the finite values; NaN when there are none."""
    finite = [v for v in values if math.isfinite(v)]
    return {quantile_name(q): quantile(finite, q) if finite else math.nan for q in qs}


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def lower_median(values: Sequence[float]) -> float:
    """The median as ``torch.median`` defines it: the lower middle value."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def stdev(values: Sequence[float]) -> float:
    """Sample standard deviation (n - 1); 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1))


def mad(values: Sequence[float]) -> float:
    """Median absolute deviation from the median."""
    m = median(values)
    return median([abs(v - m) for v in values])


def relative_noise(values: Sequence[float]) -> float:
    """Robust relative noise: 1.4826 * MAD / median (stdev/mean without outliers).

    A single 50 ms scheduler hit among 1 ms samples moves ``stdev/mean``
    a lot and this estimate hardly at all; outliers are reported separately
    through the p99.
    """
    if len(values) < 2:
        return math.inf
    m = median(values)
    if m <= 0:
        return math.inf
    return MAD_TO_SD * mad(values) / m


def relative_stdev(values: Sequence[float]) -> float:
    """Classic stdev / mean (what nvbench calls noise)."""
    if len(values) < 2:
        return math.inf
    m = mean(values)
    return stdev(values) / m if m > 0 else math.inf


def slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against their index."""
    n = len(values)
    if n < 2:
        return 0.0
    x_mean = (n - 1) / 2
    y_mean = mean(values)
    num = math.fsum((i - x_mean) * (v - y_mean) for i, v in enumerate(values))
    den = math.fsum((i - x_mean) ** 2 for i in range(n))
    return num / den


def median_ci_ranks(n: int, confidence: float) -> tuple[int, int]:
    """0-based ranks (lo, hi) of a distribution-free confidence interval for a median.

    The sign-test interval: the number of values below the true median is
    Binomial(n, 1/2), so order statistics ``k`` and ``n-1-k`` cover the median
    with at least ``confidence``.  Uses the normal approximation with a
    continuity correction (exact enough for n >= 6, conservative below).
    """
    if n < 1:
        raise ValueError("no values")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    k = math.floor(n / 2 - 0.5 - z * math.sqrt(n) / 2)
    k = max(0, min(k, (n - 1) // 2))
    return k, n - 1 - k


def median_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median (robust to outliers)."""
    ordered = sorted(values)
    lo, hi = median_ci_ranks(len(ordered), confidence)
    return ordered[lo], ordered[hi]


def median_uncertainty_rel(values: Sequence[float], confidence: float = 0.95) -> float:
    """Half the width of the median's confidence interval, relative to the median."""
    if len(values) < 2:
        return math.inf
    m = median(values)
    if m <= 0:
        return math.inf
    low, high = median_ci(values, confidence)
    return (high - low) / 2 / m


def summarize(samples_ms: Sequence[float]) -> dict[str, float]:
    """min / median / mean / p95 / p99 / max and both noise figures of samples."""
    return {
        "min_ms": min(samples_ms),
        "median_ms": median(samples_ms),
        "mean_ms": mean(samples_ms),
        "p95_ms": quantile(samples_ms, 0.95),
        "p99_ms": quantile(samples_ms, 0.99),
        "max_ms": max(samples_ms),
        "stdev_ms": stdev(samples_ms),
        "noise_rel": relative_noise(samples_ms),
        "stdev_rel": relative_stdev(samples_ms),
    }


# -- inflation: loaded vs alone ----------------------------------------------------------


def inflation_pct(value: float, reference: float) -> float:
    """How much larger ``value`` is than ``reference``, in percent (0: the same)."""
    return (value / reference - 1.0) * 100.0


def per_sample_inflation_pct(samples: Sequence[float], reference: float) -> list[float]:
    """Each sample's inflation over ``reference`` (the median of the alone run), in %."""
    return [inflation_pct(s, reference) for s in samples]


def quantile_inflation_pct(samples: Sequence[float], reference_samples: Sequence[float],
                           qs: Sequence[float] = DEFAULT_QS) -> dict[str, float]:
    """Each quantile of ``samples`` over the same quantile of ``reference_samples``, in %."""
    loaded, alone = quantiles(samples, qs), quantiles(reference_samples, qs)
    return {name: inflation_pct(loaded[name], alone[name]) for name in loaded}


def reported_inflation_pct(samples: Sequence[float], reference_samples: Sequence[float]) -> float:
    """A measurement's median over the alone run's median, in % (what a user reads)."""
    return inflation_pct(median(samples), median(reference_samples))
