"""When to stop sampling: pure logic, no clocks of its own.

Two rules share one interface, ``decide(samples_ms, elapsed_s) -> reason | None``:

- :class:`CountRule` stops after a fixed number of samples (the
  ``triton.testing.do_bench`` way: the count comes from the ``rep`` budget).
- :class:`NoiseRule` stops like nvbench's stdrel criterion: once at least
  ``min_time_s`` of measured time is collected and the relative noise is
  under ``noise_target`` (``converged``); or once the noise estimate has
  *settled* above the target — it moved less than ``settle_rel`` since half
  and three quarters of the samples — because more
  samples would not make the kernel less noisy (``settled``); or at
  ``max_time_s`` of measured time (``max_time``); or at ``timeout_s`` of wall
  time in the region, flushes and overheads included (``timeout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from krex.measure import stats

CONVERGED = "converged"
SETTLED = "settled"
MAX_TIME = "max_time"
TIMEOUT = "timeout"
COUNT = "count"
MAX_SAMPLES = "max_samples"

QUIET_REASONS = frozenset({CONVERGED, COUNT})


@dataclass
class CountRule:
    """Stop after ``count`` samples (or at ``timeout_s`` of wall time)."""

    count: int
    timeout_s: float = 60.0

    def decide(self, samples_ms: Sequence[float], elapsed_s: float) -> str | None:
        if len(samples_ms) >= self.count:
            return COUNT
        if elapsed_s >= self.timeout_s:
            return TIMEOUT
        return None


@dataclass
class NoiseRule:
    """Stop on a relative-noise target, on settled noise, or on time limits."""

    noise_target: float = 0.005
    min_time_s: float = 0.1
    max_time_s: float = 1.0
    timeout_s: float = 5.0
    min_samples: int = 10
    max_samples: int = 1_000_000
    settle_rel: float = 0.10
    history: list[tuple[int, float]] = field(default_factory=list)

    def decide(self, samples_ms: Sequence[float], elapsed_s: float) -> str | None:
        measured_s = sum(samples_ms) / 1e3
        if elapsed_s >= self.timeout_s:
            return TIMEOUT
        if len(samples_ms) >= self.max_samples:
            return MAX_SAMPLES
        if measured_s >= self.max_time_s:
            return MAX_TIME
        if len(samples_ms) < self.min_samples:
            return None
        noise = stats.relative_noise(samples_ms)
        self.history.append((len(samples_ms), noise))
        if measured_s < self.min_time_s:
            return None
        if noise <= self.noise_target:
            return CONVERGED
        if self.settled():
            return SETTLED
        return None

    def settled(self) -> bool:
        """The noise estimate at n/2 and 3n/4 samples is within ``settle_rel`` of now.

        Judged on sample counts, not on how often ``decide`` is called: a noise
        that still grows (drift, warming up) has moved since half the samples.
        """
        n, now = self.history[-1]
        if n < 2 * self.min_samples or not 0 < now < float("inf"):
            return False
        for fraction in (0.5, 0.75):
            earlier = self._noise_at(int(n * fraction))
            if earlier is None or abs(earlier - now) > self.settle_rel * now:
                return False
        return True

    def _noise_at(self, count: int) -> float | None:
        """The last noise estimate taken with at most ``count`` samples."""
        found = None
        for n, noise in self.history:
            if n > count:
                break
            found = noise
        return found
