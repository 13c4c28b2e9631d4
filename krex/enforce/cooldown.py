"""Cool-down before a GPU grant: the region starts on a device that is not hot or throttled.

A kernel timed on a device that is still hot from the previous holder's work runs at
whatever clock the device's thermal and power limits leave it, and the next region
pays for the last one's heat.  With ``krex serve --cool-below-c C`` the daemon holds a
GPU grant, after the other jobs are stopped (so the device idles and cools) and before
the grant is sent, until NVML reads the device at or below C degrees with no throttle
reason (other than idle and the applications clock setting) — bounded by
``--cool-timeout-s``, after which it grants anyway and says so.  The wait is the
daemon's, read from NVML by the daemon; nothing the holder writes reaches it.

With ``--min-clock-frac F`` (which needs ``--lock-clocks``) it also waits for an SM
clock of at least F times the locked one.  Without a lock the clock is not waited
for: an idle device runs at its idle clock, so "at clock" cannot be read before work
starts; a clock that falls during the region is ``throttled``
(:mod:`krex.enforce.nvmlwatch`).

In: the device (:class:`~krex.devices.audit.NvmlDevice`).  Out: :class:`Cooling`, in
the region's ``device_audit.start.cool_down``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from krex.devices.audit import DeviceReader, DeviceState, throttle_names

POLL_S = 0.05  # NVML's temperature moves in whole degrees over seconds


@dataclass(frozen=True)
class Readiness:
    """What a grant waits for: at or below ``below_c`` (None: any temperature), no
    throttle reason, and an SM clock at ``min_mhz`` or more (None: any clock)."""

    below_c: float | None = None
    min_mhz: int | None = None

    def met(self, state: DeviceState) -> bool:
        """A temperature or a clock the device does not give counts as met."""
        hot = self.below_c is not None and state.temperature_c is not None \
            and state.temperature_c > self.below_c
        slow = self.min_mhz is not None and state.sm_clock_mhz is not None \
            and state.sm_clock_mhz < self.min_mhz
        return not hot and not slow and not state.throttling


@dataclass(frozen=True)
class Cooling:
    """How a grant's cool-down went."""

    want: Readiness
    waited_s: float
    cooled: bool  # False: the timeout ended the wait with the device not ready
    temperature_c: int | None  # at the end of the wait
    sm_clock_mhz: int | None
    throttling: list[str]  # the throttle reasons still set then

    def to_dict(self) -> dict[str, Any]:
        return {"below_c": self.want.below_c, "min_clock_mhz": self.want.min_mhz,
                "waited_s": round(self.waited_s, 4), "cooled": self.cooled,
                "temperature_c": self.temperature_c, "sm_clock_mhz": self.sm_clock_mhz,
                "throttling": self.throttling}


def cool_down(device: DeviceReader, want: Readiness, timeout_s: float,
              waiting: Callable[[DeviceState, float], None] | None = None) -> Cooling:
    """Wait until the device meets ``want``, at most ``timeout_s``; ``waiting`` is told
    of each reading that does not (the state and the seconds waited so far)."""
    t0 = time.monotonic()
    while True:
        state = device.state()
        waited = time.monotonic() - t0
        if want.met(state) or waited >= timeout_s:
            return Cooling(want, waited, want.met(state), state.temperature_c,
                           state.sm_clock_mhz, throttle_names(state.throttling))
        if waiting is not None:
            waiting(state, waited)
        time.sleep(min(POLL_S, max(0.0, timeout_s - waited)))
