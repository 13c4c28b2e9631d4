"""Where measurements get their region: an injectable factory.

The default factory is ``krex.client.region.region`` (the daemon-backed
region).  Tests and embedders replace it with ``region=`` on each call or
:func:`set_region_factory` for the process.  A factory is called as
``factory(device, max_hold_s=..., label=...)`` and returns a context manager
whose value has a ``report`` (a :class:`~krex.protocol.report.RegionReport`)
after exit.

When the client cannot be imported, measurements fall back to
:class:`LocalRegion`: no exclusivity, ``mode: "none"``, not clean, with the
reason ``no_daemon`` — so every result still carries a report and says that
enforcement was impossible.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from krex.protocol.report import Reason, ReasonCode, RegionReport

RegionFactory = Callable[..., AbstractContextManager[Any]]

_factory: RegionFactory | None = None


def set_region_factory(factory: RegionFactory | None) -> None:
    """Use ``factory`` for every later measurement (None: back to the default)."""
    global _factory
    _factory = factory


def get_region_factory(override: RegionFactory | None = None) -> RegionFactory:
    if override is not None:
        return override
    if _factory is not None:
        return _factory
    try:
        from krex.client.region import region
    except ImportError:
        return LocalRegion
    return region


class LocalRegion:
    """A region without a daemon: times itself and reports that nothing was enforced."""

    def __init__(
        self,
        device: str | None = None,
        *,
        max_hold_s: float | None = None,
        label: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
        why: str = "krex.client is not available in this process",
    ) -> None:
        self.device = device or "cpu"
        self.label = label
        self.max_hold_s = max_hold_s
        self._clock = clock
        self._why = why
        self._start = 0.0
        self.report: RegionReport | None = None

    def __enter__(self) -> LocalRegion:
        self._start = self._clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.report = self._base_report(self._clock() - self._start)

    def _base_report(self, held_s: float) -> RegionReport:
        return RegionReport(device=self.device, label=self.label, mode="none", exclusive=False,
                            held_s=held_s, reasons=[no_daemon(self._why)])


def no_daemon(why: str) -> Reason:
    return Reason(ReasonCode.NO_DAEMON, f"exclusivity: {why}",
                  {"mechanism": "exclusivity", "why": why})


class ScriptedRegions:
    """A factory of local regions whose reports are scripted (for tests and demos).

    Each region taken gets the next dict of ``overrides`` (the last one
    repeats): :class:`~krex.protocol.report.RegionReport` fields set over a
    clean ``mode: "region"`` report timed by ``clock``.  ``taken`` counts
    regions, ``reports`` keeps them.
    """

    def __init__(
        self,
        overrides: list[dict[str, Any]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._overrides = list(overrides or [{}])
        self._clock = clock
        self.taken = 0
        self.reports: list[RegionReport] = []

    def __call__(self, device: str | None = None, **kwargs: Any) -> _ScriptedRegion:
        index = min(self.taken, len(self._overrides) - 1)
        self.taken += 1
        return _ScriptedRegion(self, device, self._overrides[index], kwargs.get("label"))


class _ScriptedRegion(LocalRegion):
    def __init__(
        self, owner: ScriptedRegions, device: str | None, overrides: dict[str, Any], label: Any
    ) -> None:
        super().__init__(device, label=label, clock=owner._clock)
        self._owner = owner
        self._overrides = overrides

    def __exit__(self, *exc: object) -> None:
        clean = dataclasses.replace(self._base_report(self._clock() - self._start),
                                    region=self._owner.taken, mode="region", exclusive=True,
                                    reasons=[])
        self.report = dataclasses.replace(clean, **self._overrides)
        self._owner.reports.append(self.report)
