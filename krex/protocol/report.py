"""The region report: the evidence every region returns, typed and versioned.

The daemon builds one :class:`RegionReport` per region when it ends (the
client builds one for a region nested in another of the same thread, and
:mod:`krex.measure` one for a region taken without a daemon).  It is read by
the client (``Region.report``), the measurements (``Measurement.region``),
the eval and everything above them; on the wire and in results files it is
``to_dict()`` (format :data:`REPORT_FORMAT`, documented in docs/protocol.md)
and ``from_dict()`` turns it back.

A region is *clean* when it ended by release and no :class:`Reason` says
otherwise: ``clean`` is derived from ``outcome`` and ``reasons``, never
stored, so the two cannot disagree.  Every reason has a machine-readable
:class:`ReasonCode`, a one-line message and optional evidence.  A region
nested in an outer region of the same thread is judged by the outer one
and by its own holder's evidence: its ``clean`` is ``None`` unless that
evidence gives a reason, then ``False``.

Timings carry their unit in their name (``waited_s``, ``held_s``, ``apply_ms``);
timestamps say their clock (``*_mono_s``: ``time.monotonic()`` of this host,
comparable with the jobs' own; ``*_wall_s``: Unix time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

REPORT_FORMAT = 1


class Outcome(str, Enum):
    """How a region ended."""

    RELEASED = "released"  # its holder released it
    REVOKED = "revoked"  # held past its maximum hold: the daemon took it back
    OWNER_GONE = "owner_gone"  # the holder's connection closed while it was held
    DAEMON_STOPPED = "daemon_stopped"  # the daemon stopped while it was held
    CANCELLED = "cancelled"  # its requester cancelled the acquire as it was being granted
    NESTED = "nested"  # inside an outer region of the same thread: the outer one judges


class ReasonCode(str, Enum):
    """Why a region is not clean.  ``gap``: enforcement did not happen at all, on
    this machine or in this configuration, or the job's own environment changes what is
    timed — taking the region again would not help."""

    NOT_EXCLUSIVE = "not_exclusive"  # the job runs in mode none
    NO_DAEMON = "no_daemon"  # measured without a daemon: nothing was enforced
    MECHANISM_DISABLED = "mechanism_disabled"  # switched off by the daemon's configuration
    MECHANISM_UNAVAILABLE = "mechanism_unavailable"  # not possible on this machine / process
    LEASE_EXPIRED = "lease_expired"  # the guardian's lease ran out and it undid enforcement
    STEP_FAILED = "step_failed"  # an enforcement step reported an error
    REVOKED = "revoked"  # held past its maximum hold
    OWNER_GONE = "owner_gone"  # the holder went away without releasing
    DAEMON_STOPPED = "daemon_stopped"  # the daemon stopped while the region was held
    GATE_BYPASS = "gate_bypass"  # a sibling's GPU calls went around the interposer's gate
    DRAIN_INCOMPLETE = "drain_incomplete"  # a sibling acknowledged a drain that did not finish
    DEVICE_NOT_IDLE = "device_not_idle"  # locked siblings' submitted work not seen to finish
    CANCELLED = "cancelled"  # the requester cancelled: the region was never used
    FOREIGN_DAEMON = "foreign_daemon"  # another user's krex daemon ran on the node meanwhile
    HOLDER_PREEMPTED = "holder_preempted"  # the holder waited for its CPUs past the threshold
    FOREIGN_TASK = "foreign_task"  # another task was runnable on the holder's cores
    STEP_TIMEOUT = "step_timeout"  # an enforcement step did not finish in time
    DEVICE_PREEMPTED = "device_preempted"  # the device's own thread waited for its core (fakegpu)
    FOREIGN_DEVICE_WORK = "foreign_device_work"  # the device ran other contexts' work meanwhile
    FOREIGN_DEVICE_PROCESS = "foreign_device_process"  # an unmanaged process had a context on it
    THROTTLED = "throttled"  # the device throttled, or its clock fell, between grant and release
    JOB_ENVIRONMENT = "job_environment"  # launch blocking or a profiler in the job's environment
    SHARED_DEVICE = "shared_device"  # MIG or MPS: other contexts share the device by design

    @property
    def gap(self) -> bool:
        return self in _GAPS


_GAPS = frozenset({ReasonCode.NOT_EXCLUSIVE, ReasonCode.NO_DAEMON,
                   ReasonCode.MECHANISM_DISABLED, ReasonCode.MECHANISM_UNAVAILABLE,
                   ReasonCode.LEASE_EXPIRED, ReasonCode.JOB_ENVIRONMENT,
                   ReasonCode.SHARED_DEVICE})


@dataclass(frozen=True)
class Reason:
    """One reason a region is not clean."""

    code: ReasonCode
    message: str  # one line, for people
    evidence: dict[str, Any] = field(default_factory=dict)  # for programs

    @classmethod
    def mechanism(cls, mechanism: str, why: str, *, disabled: bool = False) -> Reason:
        """A mechanism (gate_drain, checkpoint_lock, freeze, isolate, ...) that was not applied."""
        code = ReasonCode.MECHANISM_DISABLED if disabled else ReasonCode.MECHANISM_UNAVAILABLE
        return cls(code, f"{mechanism}: {why}", {"mechanism": mechanism, "why": why})

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code.value, "message": self.message, "evidence": dict(self.evidence)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Reason:
        return cls(ReasonCode(data["code"]), str(data["message"]), dict(data.get("evidence") or {}))


@dataclass
class Step:
    """One enforcement step of a region, applied in order and reverted in reverse."""

    name: str  # gate_drain | checkpoint_lock | freeze | isolate | ...
    backend: str
    ok: bool = False
    apply_ms: float | None = None
    revert_ms: float | None = None
    error: str | None = None
    processes: int | None = None  # freeze: the processes it stopped
    timed_out: bool = False  # did not finish in time: the region ran with it incomplete
    kept: bool = False  # applied for the job's previous region and kept for this one

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Step:
        return cls(**{k: data[k] for k in _field_names(cls) if k in data})


@dataclass
class HostEvidence:
    """What the host side of enforcement did and saw during the region."""

    steps: list[Step] = field(default_factory=list)
    siblings_frozen: int = 0  # sibling jobs
    processes_frozen: int = 0
    freeze_backend: str = "off"  # cgroup2 | cgroup1 | signal | off
    holder_involuntary_switches: int | None = None  # the holder's, during the region
    holder_migrations: int | None = None  # None where the kernel does not count them
    holder_run_delay_ms: float | None = None  # runnable but waiting for a CPU (None: unknown)
    holder_cpu_ms: float | None = None  # the holder's threads' CPU time during the region
    run_delay_threshold_ms: float | None = None  # above it: holder_preempted
    holder_cores: list[int] | None = None  # where the holder could run
    gated_jobs: int | None = None  # gate/drain: sibling jobs whose gates were closed
    gate_idle_jobs: list[int] = field(default_factory=list)  # ... that never launched GPU work
    drain_acks_ms: dict[int, float] = field(default_factory=dict)  # pid -> ack latency
    locked_pids: list[int] = field(default_factory=list)  # checkpoint lock
    lock_skipped_pids: list[int] = field(default_factory=list)  # ... no CUDA context: not locked
    lock_acks_ms: dict[int, float] = field(default_factory=dict)  # pid -> lock latency
    shield: dict[str, Any] | None = None  # unmanaged tasks kept off the cores (shield.py)
    # taken over from the previous region on the device (a handoff: nothing set up anew)
    handed_over: bool = False
    # ... with its operations worked out after the previous grant (nothing built at the handoff)
    handover_prepared: bool = False
    # entered on the enforcement its job's previous region kept (nobody else came meanwhile)
    kept: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["steps"] = [s.to_dict() for s in self.steps]
        out["drain_acks_ms"] = {str(k): v for k, v in self.drain_acks_ms.items()}
        out["lock_acks_ms"] = {str(k): v for k, v in self.lock_acks_ms.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostEvidence:
        host = cls(**{k: data[k] for k in _field_names(cls) if k in data and k != "steps"})
        host.steps = [Step.from_dict(s) for s in data.get("steps") or []]
        host.drain_acks_ms = {int(k): float(v) for k, v in (host.drain_acks_ms or {}).items()}
        host.lock_acks_ms = {int(k): float(v) for k, v in (host.lock_acks_ms or {}).items()}
        return host



@dataclass
class DeviceAudit:
    """The device's own account of the region, sampled at start and end: NVIDIA's through
    NVML (:mod:`krex.devices.audit`), fakegpu's from its server and the kernel
    (:mod:`krex.enforce.devicewatch`).  Its findings are reasons of the report."""

    source: str  # nvml | fakegpu | fakegpu+nvml (the fake device with the NVML test hook)
    start: dict[str, Any]  # at grant: sm_clock_mhz, temperature_c, throttle_reasons, busy_ms...
    end: dict[str, Any]  # at release
    foreign_pids: list[int] = field(default_factory=list)  # GPU processes outside krex's jobs

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def joined(self, other: DeviceAudit) -> DeviceAudit:
        """One account of two sources of the same device's truth (their keys differ)."""
        return DeviceAudit(f"{self.source}+{other.source}", {**self.start, **other.start},
                           {**self.end, **other.end},
                           sorted(set(self.foreign_pids) | set(other.foreign_pids)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceAudit:
        return cls(str(data["source"]), dict(data.get("start") or {}),
                   dict(data.get("end") or {}), list(data.get("foreign_pids") or []))


@dataclass
class RegionReport:
    """Evidence of one region: who, when, what was enforced, and why it is not clean."""

    device: str
    region: int | None = None  # the daemon's id (nested: the outer region's; local: None)
    label: str | None = None
    job_id: int | None = None
    job: str | None = None  # the job's name
    mode: str | None = None  # the job's mode: region | command | none (None: not known)
    tenant: str | None = None  # whose share of the device it used (uid:N, or a service's id)
    outcome: Outcome = Outcome.RELEASED
    nested: bool = False  # inside an outer region (of the thread, or a whole-job hold)
    exclusive: bool = True
    waited_s: float = 0.0  # queued at the daemon, until the scheduler chose it
    enforce_s: float = 0.0  # then setting up its enforcement, until the grant was sent
    held_s: float = 0.0
    max_hold_s: float | None = None
    requested_mono_s: float | None = None
    granted_mono_s: float | None = None
    released_mono_s: float | None = None
    requested_wall_s: float | None = None
    jobs_served_while_waiting: int = 0
    # re-queued by the daemon at the job's last release (krex.daemon.holds): granted this
    # long before the job asked for it (its times and hold count from the ask)
    unclaimed_s: float = 0.0
    # how long it kept its siblings stopped (frozen, gated or locked): from its
    # enforcement's start until it released or handed the device over; 0: it stopped none
    frozen_s: float = 0.0
    host: HostEvidence | None = None
    device_audit: DeviceAudit | None = None
    reasons: list[Reason] = field(default_factory=list)

    # -- derived --------------------------------------------------------------------

    @property
    def clean(self) -> bool | None:
        """True: released with no reason against it; None: nested with no reason against
        it (the outer region judges the rest)."""
        if self.outcome is Outcome.NESTED:
            return False if self.reasons else None
        return self.outcome is Outcome.RELEASED and not self.reasons

    @property
    def revoked(self) -> bool:
        return self.outcome is Outcome.REVOKED

    @property
    def enforced(self) -> bool:
        """The daemon granted exclusivity (region- or command-granular)."""
        return self.mode in ("region", "command")

    def gaps(self) -> list[Reason]:
        """Reasons that say enforcement did not happen at all (a retry would not help)."""
        return [r for r in self.reasons if r.code.gap]

    def reason(self, code: ReasonCode) -> Reason | None:
        return next((r for r in self.reasons if r.code is code), None)

    def why_not_clean(self) -> str:
        """One line: the reasons' messages (empty when clean)."""
        return "; ".join(r.message for r in self.reasons)

    def with_reason(self, reason: Reason, outcome: Outcome | None = None) -> RegionReport:
        """A copy with one more reason (and another outcome)."""
        return replace(self, reasons=[*self.reasons, reason], outcome=outcome or self.outcome)

    # -- serialised form ----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": REPORT_FORMAT}
        for name in _field_names(type(self)):
            out[name] = getattr(self, name)
        out["outcome"] = self.outcome.value
        out["host"] = self.host.to_dict() if self.host is not None else None
        out["device_audit"] = self.device_audit.to_dict() if self.device_audit else None
        out["reasons"] = [r.to_dict() for r in self.reasons]
        out["clean"] = self.clean  # derived: written for readers, ignored by from_dict
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RegionReport:
        if data.get("format") != REPORT_FORMAT:
            raise ValueError(f"not a region report of format {REPORT_FORMAT}: "
                             f"format {data.get('format')!r}")
        report = cls(**{k: data[k] for k in _field_names(cls)
                        if k in data and k not in _TYPED_FIELDS})
        report.outcome = Outcome(data.get("outcome", Outcome.RELEASED.value))
        host, audit = data.get("host"), data.get("device_audit")
        report.host = HostEvidence.from_dict(host) if host is not None else None
        report.device_audit = DeviceAudit.from_dict(audit) if audit is not None else None
        report.reasons = [Reason.from_dict(r) for r in data.get("reasons") or []]
        return report

    def record(self) -> dict[str, Any]:
        """The short form the daemon keeps of finished regions (``regions`` request)."""
        out = {k: getattr(self, k) for k in _RECORD_FIELDS}
        out["outcome"] = self.outcome.value
        out["clean"] = self.clean
        out["reasons"] = [r.code.value for r in self.reasons]
        return out


_TYPED_FIELDS = {"outcome", "host", "device_audit", "reasons"}  # (de)serialised by hand
_RECORD_FIELDS = ("region", "job_id", "job", "tenant", "device", "label", "nested", "exclusive",
                  "waited_s", "enforce_s", "held_s", "requested_mono_s", "granted_mono_s",
                  "released_mono_s", "jobs_served_while_waiting", "frozen_s")


def _field_names(cls: type) -> tuple[str, ...]:
    """A report class's field names, looked up once: a thawed job decodes its previous
    region's report on its next grant's path, where ``fields()`` was half its Python."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def finite_or_none(seconds: float | None) -> float | None:
    """An infinite maximum hold (a whole-job hold) is written as None."""
    return None if seconds is None or math.isinf(seconds) else seconds
