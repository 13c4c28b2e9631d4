"""Cool-down before a GPU grant: the region starts on a device that is not hot or throttled.

A kernel timed on a device that is still hot from the previous holder's work runs at
whatever clock the device's thermal and power limits leave it, and the next region
pays for the last one's heat.  With ``krex serve --cool-below-c C`` the daemon holds a
GPU grant, after the other jobs are stopped (so the device idles and cools) and before
the grant is sent, until NVML reads the device at or below C degrees with no throttle
reason (other than idle and the applications clock setting) — bounded by
``--cool-timeout-s``, after which it grants anyway and says so.  The wait is the
daemon's, read from NVML by the daemon; nothing the holder writes reaches it.

The SM clock is not waited for: an idle device runs at its idle clock, so "at clock"
cannot be seen before work starts; a clock that falls during the region is
``throttled`` (:mod:`krex.enforce.nvmlwatch`).

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
class Cooling:
    """How a grant's cool-down went."""

    below_c: float
    waited_s: float
    cooled: bool  # False: the timeout ended the wait with the device still hot or throttled
    temperature_c: int | None  # at the end of the wait
    throttling: list[str]  # the throttle reasons still set then

    def to_dict(self) -> dict[str, Any]:
        return {"below_c": self.below_c, "waited_s": round(self.waited_s, 4),
                "cooled": self.cooled, "temperature_c": self.temperature_c,
                "throttling": self.throttling}


def ready(state: DeviceState, below_c: float) -> bool:
    """Cool enough and not throttled (a temperature NVML does not give counts as cool)."""
    hot = state.temperature_c is not None and state.temperature_c > below_c
    return not hot and not state.throttling


def cool_down(device: DeviceReader, below_c: float, timeout_s: float,
              waiting: Callable[[DeviceState, float], None] | None = None) -> Cooling:
    """Wait until the device is :func:`ready`, at most ``timeout_s``; ``waiting`` is told
    of each reading that is not (the state and the seconds waited so far)."""
    t0 = time.monotonic()
    while True:
        state = device.state()
        waited = time.monotonic() - t0
        if ready(state, below_c) or waited >= timeout_s:
            return Cooling(below_c, waited, ready(state, below_c), state.temperature_c,
                           throttle_names(state.throttling))
        if waiting is not None:
            waiting(state, waited)
        time.sleep(min(POLL_S, max(0.0, timeout_s - waited)))
