"""A region's account from the device's management library (NVML), judged.

The daemon reads the device through NVML (:mod:`krex.devices.audit`) when a
region is granted and again when it ends, before the undo lets siblings run.
Both readings are the daemon's own: nothing the holder writes reaches them.

In: the device (:class:`~krex.devices.audit.NvmlDevice`) and who the daemon
manages (:class:`Managed`).  Out: a :class:`~krex.protocol.report.DeviceAudit`
(source ``nvml``: the device's state at grant and release) and its reasons:

- ``foreign_device_process``: a process with a context on the device that is
  not a managed job's, the daemon or its fakegpu server (its kernels cannot be
  gated or drained), seen at grant or at release.
- ``throttled``: a throttle reason other than idle or the applications clock
  setting at grant, at release or in any sample between (the daemon's sampler
  thread, :mod:`krex.devices.sampler`, every ``krex serve --device-sample-ms``),
  or an SM clock at release or between below ``clock_frac`` of the grant's
  (``krex serve --release-clock-frac``, default 0.9): the region's kernels ran
  slower than the device can.  The samples are its evidence.
- ``shared_device`` (a *gap*: the node's configuration, not this region): MIG is
  on, or an MPS server holds the device (its process in NVML's list, or NVML's
  MPS clients), at grant or at release.  krex gates and drains its own jobs'
  work only; the device's other tenants there run by design.

A region with an NVML account is never handed over (its window would need a
reading at the handoff): it is undone and set up again, with a fresh reading.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from krex.devices.audit import (
    DeviceProcess,
    DeviceReader,
    DeviceState,
    NvmlReading,
    Sharing,
    throttle_names,
)
from krex.devices.sampler import Sampler, Window
from krex.enforce.cooldown import Cooling
from krex.protocol.report import DeviceAudit, Reason, ReasonCode


@dataclass(frozen=True)
class Managed:
    """Who the daemon manages: its jobs' processes, itself and its fakegpu server."""

    jobs: tuple[Any, ...]  # daemon jobs (krex.daemon.jobs.Job): ``contains(pid)``
    own: frozenset[int]  # the daemon's own processes

    @classmethod
    def of(cls, jobs: Sequence[Any], own: Sequence[int]) -> Managed:
        return cls(tuple(jobs), frozenset(p for p in own if p))

    def __contains__(self, pid: object) -> bool:
        return isinstance(pid, int) and (
            pid in self.own or any(job.contains(pid) for job in self.jobs))


class Sightings:
    """What each audited device's latest region saw of processes krex does not manage and
    of sharing, for ``krex status`` (pids, uids and memory: no commands, which the
    report's evidence names only to whom may see them).  A region that saw nothing
    clears its device's entry."""

    def __init__(self) -> None:
        self.by_device: dict[str, dict[str, Any]] = {}

    def note(self, device: str, foreign: dict[int, tuple[DeviceProcess, list[str]]],
             sharing: list[Sharing]) -> None:
        if not foreign and not sharing:
            self.by_device.pop(device, None)
            return
        self.by_device[device] = {
            "at_wall_s": round(time.time(), 3),
            "foreign_processes": [{"pid": p.pid, "uid": p.uid, "used_memory_mib":
                                   p.used_memory_mib, "seen_at": seen}
                                  for p, seen in foreign.values()],
            "sharing": [m.mode for m in sharing]}

    def describe(self) -> dict[str, dict[str, Any]]:
        return dict(self.by_device)


class NvmlWatch:
    """One region's NVML window: :meth:`begin` at grant, :meth:`stop` at release."""

    hands_over = False

    def __init__(self, device: DeviceReader, managed: Managed, viewer_uid: int | None,
                 clock_frac: float, sampler: Sampler | None = None,
                 cooling: Cooling | None = None,
                 seen: tuple[Sightings, str] | None = None) -> None:
        self.device = device
        self.seen = seen  # where its findings are noted for status, under which name
        self.cooling = cooling  # the grant's wait for the device to cool, if any
        self.sampler = sampler
        self.window: Window | None = None  # the samples between grant and release
        self.managed = managed
        self.viewer_uid = viewer_uid  # the holder's user: whose commands it may see
        self.clock_frac = clock_frac  # an SM clock at release below this share of the grant's
        self.grant: NvmlReading | None = None
        self.release: NvmlReading | None = None

    @classmethod
    def begin(cls, device: DeviceReader, managed: Managed, viewer_uid: int | None = None,
              clock_frac: float = 0.9, sampler: Sampler | None = None,
              cooling: Cooling | None = None,
              seen: tuple[Sightings, str] | None = None) -> NvmlWatch:
        watch = cls(device, managed, viewer_uid, clock_frac, sampler, cooling, seen)
        watch.grant = device.read(viewer_uid)
        if sampler is not None:
            watch.window = sampler.open()
        return watch

    def stop(self) -> None:
        if self.release is None:
            if self.sampler is not None and self.window is not None:
                self.sampler.close(self.window)
            self.release = self.device.read(self.viewer_uid)

    def finish(self) -> tuple[DeviceAudit, list[Reason]]:
        """The audit and the reasons the device's readings give against the region."""
        self.stop()
        assert self.grant is not None and self.release is not None
        foreign = self._foreign()
        audit = DeviceAudit(self.device.source, self.grant.state.to_dict(),
                            self.release.state.to_dict(),
                            sorted(foreign))
        if self.window is not None:
            audit.end["between"] = self.window.to_dict()
        if self.cooling is not None:
            audit.start["cool_down"] = self.cooling.to_dict()
        reasons = []
        if foreign:
            reasons.append(foreign_reason(foreign))
        throttled = throttle_reason(self.grant.state, self.release.state, self.clock_frac,
                                    self.window)
        if throttled is not None:
            reasons.append(throttled)
        shared = {when: reading.sharing for when, reading in
                  (("grant", self.grant), ("release", self.release)) if reading.sharing}
        if self.seen is not None:
            self.seen[0].note(self.seen[1], foreign, self.release.sharing)
        if shared:
            audit.start["sharing"] = [m.to_dict() for m in self.grant.sharing]
            audit.end["sharing"] = [m.to_dict() for m in self.release.sharing]
            reasons.append(sharing_reason(shared))
        return audit, reasons

    def _foreign(self) -> dict[int, tuple[DeviceProcess, list[str]]]:
        """pid -> (the process, when it was seen: grant, release) for unmanaged ones."""
        out: dict[int, tuple[DeviceProcess, list[str]]] = {}
        for when, reading in (("grant", self.grant), ("release", self.release)):
            for proc in reading.processes if reading else []:
                if proc.pid not in self.managed:
                    out.setdefault(proc.pid, (proc, []))[1].append(when)
        return out


def foreign_reason(foreign: dict[int, tuple[DeviceProcess, list[str]]]) -> Reason:
    procs = [proc.to_dict(seen) for proc, seen in foreign.values()]
    named = ", ".join(f"{p['pid']} ({p['command'] or 'uid ' + str(p['uid'])}; at "
                      f"{' and '.join(p['seen_at'])})" for p in procs[:4])
    return Reason(ReasonCode.FOREIGN_DEVICE_PROCESS,
                  f"device: {len(procs)} process(es) krex does not manage had a context on "
                  f"the device: {named}", {"processes": procs})


def sharing_reason(seen: dict[str, list[Sharing]]) -> Reason:
    """``shared_device``: the modes seen at grant and/or release (``seen``: when -> modes)."""
    modes: dict[str, dict[str, Any]] = {}
    for when, found in seen.items():
        for m in found:
            entry = modes.setdefault(m.mode, {**m.to_dict(), "seen_at": []})
            entry["seen_at"].append(when)
            entry["pids"] = sorted(set(entry["pids"]) | set(m.pids))
    named = "; ".join(f"{m['mode'].upper()}: {m['detail']}" for m in modes.values())
    return Reason(ReasonCode.SHARED_DEVICE,
                  f"device: shared by design ({named}); krex cannot gate or drain the "
                  "other tenants' work", {"modes": list(modes.values())})


def throttle_reason(grant: DeviceState, release: DeviceState, clock_frac: float,
                    between: Window | None = None) -> Reason | None:
    """``throttled`` when a sample (grant, release, or ``between`` them) has a throttling
    reason, or the SM clock at release or between is below ``clock_frac`` of the grant's
    (0: not compared); else None."""
    ratio = low_between = None
    if grant.sm_clock_mhz and release.sm_clock_mhz is not None:
        ratio = round(release.sm_clock_mhz / grant.sm_clock_mhz, 3)
    if grant.sm_clock_mhz and between is not None and between.min_sm_clock_mhz is not None:
        low_between = round(between.min_sm_clock_mhz / grant.sm_clock_mhz, 3)
    low = ratio is not None and ratio < clock_frac
    dipped = low_between is not None and low_between < clock_frac
    seen_between = between.throttle_seen if between is not None else 0
    if not (grant.throttling or release.throttling or low or seen_between or dipped):
        return None
    whys = [f"throttling at {when} ({', '.join(throttle_names(state.throttling))})"
            for when, state in (("grant", grant), ("release", release)) if state.throttling]
    if seen_between:
        assert between is not None and between.first_throttled is not None
        whys.append(f"throttling between grant and release "
                    f"({', '.join(throttle_names(seen_between))}; first "
                    f"{between.first_throttled['at_ms']:.0f} ms in, {between.samples} samples)")
    if low:
        whys.append(f"SM clock at release {release.sm_clock_mhz} MHz, {ratio:.0%} of the "
                    f"grant's {grant.sm_clock_mhz} MHz (below {clock_frac:.0%})")
    if dipped and not low:
        assert between is not None
        whys.append(f"SM clock fell to {between.min_sm_clock_mhz} MHz between grant and "
                    f"release, {low_between:.0%} of the grant's (below {clock_frac:.0%})")
    return Reason(ReasonCode.THROTTLED, "device: " + "; ".join(whys),
                  {"grant": grant.to_dict(), "release": release.to_dict(),
                   "between": between.to_dict() if between is not None else None,
                   "throttling_at_grant": throttle_names(grant.throttling),
                   "throttling_at_release": throttle_names(release.throttling),
                   "throttling_between": throttle_names(seen_between),
                   "clock_ratio": ratio, "min_clock_ratio_between": low_between,
                   "min_clock_frac": clock_frac})
