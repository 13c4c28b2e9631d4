"""The device's state between a region's grant and release: a sampler thread of the daemon's.

Two readings (at grant, at release) cannot see throttling that starts and ends inside
a region, nor a clock that dips and recovers.  One thread per audited device reads
its state (clocks, temperature, power, throttle reasons: :meth:`NvmlDevice.state`)
every ``interval_s`` while at least one region's window is open, and folds each
sample into every open :class:`Window`: how many were taken, the lowest SM clock, the
hottest and the most power, the throttle bits seen and the first throttled sample.
It sleeps while no window is open.  The thread is the daemon's: nothing a job writes
reaches it.

In: an :class:`~krex.devices.audit.NvmlDevice`.  Out: :class:`Window` summaries, judged
with the two readings by :mod:`krex.enforce.nvmlwatch`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from krex.devices.audit import BENIGN_THROTTLE, DeviceReader, DeviceState, throttle_names


@dataclass
class Window:
    """One region's samples between grant and release, summarised as they come."""

    opened_mono_s: float = field(default_factory=time.monotonic)
    samples: int = 0
    min_sm_clock_mhz: int | None = None
    max_temperature_c: int | None = None
    max_power_w: float | None = None
    throttle_seen: int = 0  # every throttling bit of any sample (idle and app clocks left out)
    first_throttled: dict[str, Any] | None = None  # that sample, and when (ms after opening)
    closed: bool = False

    def add(self, state: DeviceState, now: float) -> None:
        self.samples += 1
        if state.sm_clock_mhz is not None:
            self.min_sm_clock_mhz = min(self.min_sm_clock_mhz or state.sm_clock_mhz,
                                        state.sm_clock_mhz)
        if state.temperature_c is not None:
            self.max_temperature_c = max(self.max_temperature_c or state.temperature_c,
                                         state.temperature_c)
        if state.power_w is not None:
            self.max_power_w = max(self.max_power_w or state.power_w, state.power_w)
        if state.throttling:
            self.throttle_seen |= state.throttling
            if self.first_throttled is None:
                self.first_throttled = {**state.to_dict(),
                                        "at_ms": round((now - self.opened_mono_s) * 1e3, 3)}

    def to_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "min_sm_clock_mhz": self.min_sm_clock_mhz,
                "max_temperature_c": self.max_temperature_c, "max_power_w": self.max_power_w,
                "throttle_names": throttle_names(self.throttle_seen & ~BENIGN_THROTTLE),
                "first_throttled": self.first_throttled}


class Sampler:
    """One device's sampling thread, started at the first window and asleep without one."""

    def __init__(self, device: DeviceReader, interval_s: float) -> None:
        self.device = device
        self.interval_s = interval_s
        self._cond = threading.Condition()
        self._windows: list[Window] = []
        self._thread: threading.Thread | None = None

    def open(self) -> Window:
        window = Window()
        with self._cond:
            self._windows.append(window)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="krex-device-sampler")
                self._thread.start()
            self._cond.notify_all()
        return window

    def close(self, window: Window) -> None:
        with self._cond:
            window.closed = True
            if window in self._windows:
                self._windows.remove(window)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._windows:
                    self._cond.wait()
            state = self.device.state()
            now = time.monotonic()
            with self._cond:
                for window in self._windows:
                    window.add(state, now)
            time.sleep(self.interval_s)
