"""What every timing call shares — ``bench``, ``measure`` and ``compare`` — validated once.

:class:`TimingOptions` holds the device, timer, warm-up, cache mode, region
and retry settings; each public function builds one from its keyword
arguments (their signatures stay do_bench-shaped), so a bad value — a cache
mode of ``"warm"``, a negative timeout — is refused the same way by all three.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from krex.measure.regions import RegionFactory
from krex.measure.timers import Timer, make_timer

CACHE_MODES = ("cold", "hot")


def default_device() -> str:
    """$KREX_DEVICE; else cuda:0 when torch is imported and sees a GPU; else cpu.

    Never imports torch: if ``fn`` uses torch, torch is already imported.
    """
    if os.environ.get("KREX_DEVICE"):
        return os.environ["KREX_DEVICE"]
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return "cuda:0"
    except Exception:  # noqa: BLE001 - a broken CUDA install must not break CPU timing
        return "cpu"
    return "cpu"


@dataclass(frozen=True)
class TimingOptions:
    device: str | None = None  # None: the timer's, else default_device()
    warmup_ms: float = 25.0  # of calls before the region
    cache: str = "cold"  # cold: flush the cache between samples
    retries: int = 2  # regions taken again when one is not clean
    label: str | None = None
    max_hold_s: float | None = None  # None: the loop's timeout plus a margin
    timeout_s: float = 5.0  # of the timed loop, wall time
    timer: Timer | None = None
    region: RegionFactory | None = None

    def __post_init__(self) -> None:
        if self.cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, not {self.cache!r}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, not {self.retries}")
        if self.warmup_ms < 0:
            raise ValueError(f"warmup_ms must be >= 0, not {self.warmup_ms}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {self.timeout_s}")
        if self.max_hold_s is not None and not self.max_hold_s > 0:
            raise ValueError(f"max_hold_s must be positive, not {self.max_hold_s}")

    @property
    def cold(self) -> bool:
        return self.cache == "cold"

    def resolve(self) -> tuple[Timer, str]:
        """The timer to use and the device it times."""
        timer = self.timer or make_timer(self.device or default_device())
        return timer, self.device or timer.device
