"""Turns a grant into enforcement on real processes, and back.

The daemon core speaks in jobs; this module owns everything a job needs to
be enforceable — its cgroups, its GPU gate file and interposer environment,
the node's fakegpu server — and turns jobs into :mod:`krex.enforce` targets.
On a grant it runs gate → drain → freeze → isolate through the
:class:`~krex.enforce.enforcer.Enforcer`; the :class:`Held` it returns
undoes them and returns the region's :class:`Evidence` (host evidence,
device audit, reasons not clean).  A guardian
process started here holds a lease on every region's enforcement.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple, Protocol

from krex.daemon.config import DaemonConfig
from krex.devices.amdaudit import AmdsmiDevice, amdsmi_device
from krex.devices.audit import DeviceReader, NvmlDevice, nvml_device
from krex.devices.sampler import Sampler
from krex.enforce.cgroups import CgroupLayout, JobCgroups, instance_name
from krex.enforce.checkpointlock import CheckpointLock, FakegpuIdle, NvmlIdle, load_driver
from krex.enforce.clocklock import ClockLocks
from krex.enforce.cooldown import Cooling, Readiness, cool_down
from krex.enforce.devicewatch import FakegpuWatch, finish_all
from krex.enforce.enforcer import EnforceConfig, Enforcement, Enforcer
from krex.enforce.gate import GateFile
from krex.enforce.gatedrain import GatedJob, GateDrain
from krex.enforce.guardian import GuardianClient
from krex.enforce.guardian import sweep as sweep_journal
from krex.enforce.handoff import job_key, prepare, take_prepared
from krex.enforce.job import JobTarget
from krex.enforce.jobenv import JobEnvironments
from krex.enforce.nvmlwatch import Managed, NvmlWatch, Sightings
from krex.enforce.process import PROTECTED, ProcessRef
from krex.enforce.slot import HolderSlot
from krex.errors import KrexError
from krex.protocol.report import DeviceAudit, HostEvidence, Reason, ReasonCode

log = logging.getLogger("krex.daemon")
GPU_KINDS = ("cuda", "rocm", "fakegpu")
MAX_LEASE_S = 7 * 24 * 3600.0  # a whole-job hold has no maximum; the lease needs one
Watch = FakegpuWatch | NvmlWatch  # a source of the device's own account of a region


class Evidence(NamedTuple):
    """What a region's enforcement did and saw, for its report."""

    host: HostEvidence
    device_audit: DeviceAudit | None
    reasons: list[Reason]


class Held(Protocol):
    def exit(self) -> Evidence: ...


class _Unenforced:
    """Every mechanism is switched off: the region is granted bare, and says so."""

    def __init__(self, reasons: list[Reason]) -> None:
        self.reasons = reasons

    def exit(self) -> Evidence:
        return Evidence(HostEvidence(), None, list(self.reasons))


class _Region:
    """One region's applied enforcement plus what the gate/drain step saw."""

    def __init__(self, enforcement: Enforcement, drain: GateDrain | CheckpointLock | None,
                 watches: tuple[Watch, ...]) -> None:
        self.enforcement = enforcement
        self.drain = drain
        self.watches = watches
        if isinstance(drain, CheckpointLock):
            enforcement.gaps.extend(Reason.mechanism(d["what"], d["why"])
                                    for d in drain.not_locked)

    def slot_paths(self) -> dict[str, str]:
        """kind -> the holder's slot directory, for the hierarchies it was moved in."""
        return {kind: dst for op in self.enforcement.applied if isinstance(op, HolderSlot)
                for kind, (_, dst) in op.moves.items()}

    def can_hand_over(self) -> bool:
        """Whether the next holder of the device may take this enforcement over."""
        return (not isinstance(self.drain, CheckpointLock)
                and all(watch.hands_over for watch in self.watches)
                and self.enforcement.report is None)

    def lease(self) -> None:
        """A handed-over region's lease to the guardian (after its grant is sent)."""
        if self.enforcement.pending_lease is not None:
            from krex.enforce.handoff import lease_handed

            lease_handed(self.enforcement)

    def may_keep(self) -> bool:
        """Whether its enforcement may be kept for its holder's next region
        (:mod:`krex.daemon.keep`): it stopped nothing of another job, watches no device,
        and is its own (not handed over, not undone)."""
        e = self.enforcement
        return (self.drain is None and not self.watches and not e.siblings
                and e.report is None and e.pending_lease is None and e.handed_from is None
                and e.keepable())

    def checkpoint(self) -> Evidence:
        """The region's evidence, its enforcement kept applied (:meth:`renew` or
        :meth:`exit` next)."""
        host = self.enforcement.checkpoint()
        return Evidence(host, None, list(self.enforcement.reasons))

    def stopped(self) -> bool:
        """Whether it stopped its siblings (as its report will say), before its undo."""
        gated = isinstance(self.drain, GateDrain) and bool(self.drain.jobs)
        return gated or (self.enforcement.freeze_step is not None
                         and bool(self.enforcement.siblings))

    def exit(self) -> Evidence:
        for watch in self.watches:
            watch.stop()  # before the undo lets the siblings' work run again
        host = self.enforcement.exit()
        audit, found = finish_all(self.watches)
        if isinstance(self.drain, CheckpointLock):
            host.locked_pids = list(self.drain.acks_s)
            host.lock_skipped_pids = list(self.drain.skipped)  # no CUDA context
            host.lock_acks_ms = _ms(self.drain.acks_s)
        elif self.drain is not None:
            host.gated_jobs = len(self.drain.jobs)
            host.gate_idle_jobs = list(self.drain.idle_jobs)
            host.drain_acks_ms = _ms(self.drain.acks)
        reasons = list(self.enforcement.reasons) + found
        if self.drain is not None:
            # what the GPU step saw go around it: a sibling's ungated entry points or
            # calls, a drain acknowledged as incomplete, unconfirmed device idleness
            reasons += [gpu_finding(f) for f in self.drain.findings()]
        return Evidence(host, audit, reasons)


_FINDING_CODES = {"drain": ReasonCode.DRAIN_INCOMPLETE, "gate_bypass": ReasonCode.GATE_BYPASS,
                  "checkpoint_lock": ReasonCode.DEVICE_NOT_IDLE}


def gpu_finding(finding: dict[str, str]) -> Reason:
    """A finding of the GPU step (``what``, ``why``) as a typed reason not clean."""
    code = _FINDING_CODES.get(finding["what"], ReasonCode.STEP_FAILED)
    return Reason(code, f"{finding['what']}: {finding['why']}", dict(finding))


def _ms(seconds: dict[int, float]) -> dict[int, float]:
    return {pid: round(s * 1e3, 3) for pid, s in seconds.items()}


def is_gpu(device: str) -> bool:
    return device.split(":")[0] in GPU_KINDS


class Exclusivity:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.instance = instance_name("d")
        self.layout = CgroupLayout.probe() if config.cgroups else CgroupLayout.none()
        self._sweep_leftovers()
        PROTECTED.add(os.getpid())
        self.guardian = GuardianClient()
        self.guardian.start(self.instance, self.journal_path)
        self.enforcer = Enforcer(EnforceConfig(
            freeze=config.freeze, freeze_scope=config.freeze_scope, isolate=config.isolate,
            measure_cores=config.measure_cores), self.layout, self.guardian)
        self.gates: dict[int, GatedJob] = {}
        self._drivers: dict[str, Any] = {}
        self._readers: dict[str, DeviceReader | None] = {}
        self._samplers: dict[str, Sampler] = {}  # per audited device, between grant and release
        self.cooling: dict[str, dict[str, Any]] = {}  # device -> the grant waiting to cool
        self.clock_locks = ClockLocks(self.guardian)
        self.sightings = Sightings()  # what audited regions saw krex does not manage
        self.job_envs = JobEnvironments()
        self.fakegpu: Any = None
        self._fakegpu_start = threading.Lock()  # a pool starts its workers at once

    @property
    def journal_path(self) -> str:
        return os.path.join(self.config.runtime_dir, "guardian.journal")

    def _sweep_leftovers(self) -> None:
        """Thaw and remove what a crashed daemon (and its guardian) left behind."""
        swept = self.layout.sweep()
        errors = sweep_journal(self.journal_path)
        if swept or errors:
            log.info("swept leftovers of a previous daemon: %s %s", swept, errors)

    # -- per job -------------------------------------------------------------------

    def create_cgroups(self, job_id: int, device: str = "cpu") -> JobCgroups | None:
        """The job's cgroups, under its device's subtree: created while a region holds
        the device, they are frozen from birth, and so is whatever joins them."""
        try:
            cg = self.layout.create_job(self.instance, job_id, device)
        except OSError as exc:
            log.info("job %d gets no cgroup: %s", job_id, exc)
            return None
        return cg if cg.dirs() else None

    def adopt(self, cgroups: JobCgroups | None, process: ProcessRef) -> None:
        """Move a registered (ad-hoc) process into its job's cgroups."""
        if cgroups is not None:
            cgroups.adopt(process)

    def remove_cgroups(self, cgroups: JobCgroups | None) -> None:
        if cgroups is not None:
            try:
                cgroups.remove()
            except OSError as exc:
                log.info("could not remove %s: %s", cgroups.dirs(), exc)

    def cgroup_paths(self, cgroups: JobCgroups | None) -> dict[str, str | None]:
        if cgroups is None:
            return {}
        return cgroups.paths()  # in joining order: the freezing hierarchies last

    def job_env(self, job: Any) -> dict[str, str]:
        """What a job's processes need: the interposer on a gate file, the fake driver."""
        if not is_gpu(job.device) or not self.config.gate or self.config.gpu_lock != "interposer":
            return self._device_env(job.device)
        gated = self.gates.get(job.job_id)
        if gated is None:
            path = os.path.join(self.config.runtime_dir, "gates", f"job-{job.job_id}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.chmod(os.path.dirname(path), 0o711)  # each job opens its own by name
            gated = GatedJob(job.job_id, GateFile.create(path, ndev=1), path)
            if job.uid != os.getuid():  # the job's processes map it: another user's job
                os.chown(path, job.uid, -1)  # (a tenant user's worker, a node user's run)
            self.gates[job.job_id] = gated
        from krex.devices.native import preload_env

        return {**self._device_env(job.device), **preload_env(gated.path, 0, base={})}

    def _device_env(self, device: str) -> dict[str, str]:
        if not device.startswith("fakegpu"):
            return {}
        return self._fakegpu().env(base={})

    def _fakegpu(self) -> Any:
        """The node's fakegpu server, started on first use -- once: a pool's workers ask for
        the device's environment from threads of their own, and several servers started on
        one socket left the losers of the bind failing their workers (issue 41)."""
        with self._fakegpu_start:
            return self.fakegpu or self._start_fakegpu()

    def _start_fakegpu(self) -> Any:
        from krex.devices.fakegpu import FakeGpu

        sock = os.path.join(self.config.runtime_dir, "fakegpu.sock")
        self.fakegpu = FakeGpu(sock, core=self._fakegpu_core(),
                               ctx_delay_ms=self.config.fakegpu_ctx_delay_ms).start()
        # The fake device stands for a GPU: its execution thread keeps to its own core (off
        # the reserved ones), and its serving threads do the work a driver does in the
        # caller's thread, so they run where the caller runs: not shielded.
        self.enforcer.shield.exempt_device(self.fakegpu.proc.pid)
        # like a GPU, open to every job: tenant users (krex.daemon.users) and a node
        # daemon's users reach it through the runtime directory's group
        os.chmod(sock, 0o666)
        return self.fakegpu

    def _fakegpu_core(self) -> int | None:
        """The fake device's own core: as configured, else the first core that is not
        reserved for region holders (its kernels busy-wait there, off the holder's)."""
        if self.config.fakegpu_core is not None:
            return self.config.fakegpu_core
        reserved = set(self.enforcer.cores())
        free = [c for c in self.enforcer.all_cores if c not in reserved]
        return free[0] if free and reserved else None

    def _env_reasons(self, job: Any, device: str) -> list[Reason]:
        """``job_environment`` of a GPU region: what the holder job's root (an ad-hoc
        job's owner) was started with, read by the daemon (krex.enforce.jobenv)."""
        if not is_gpu(device):
            return []
        return self.job_envs.reasons(job.job_id, job.root or job.owner)

    def job_ended(self, job_id: int) -> None:
        self.job_envs.forget(job_id)
        gated = self.gates.pop(job_id, None)
        if gated is not None:
            gated.gate.unlink()

    # -- per region ----------------------------------------------------------------

    def sets_up_on_caller(self, device: str) -> bool:
        """Whether a grant's set-up on ``device`` may run on the requesting session's
        thread (when the device's lane is idle): not for GPU devices, whose drain may
        wait seconds while the session's thread must stay free to see its connection
        close; a cpu set-up is cgroup writes (a freeze that does not confirm is bounded
        by its step timeout and reported, never waited out)."""
        return not is_gpu(device)

    def enter(self, holder: Any, siblings: list[Any], request: Any,
              others: Sequence[Any] = ()) -> Held:
        if self._all_off(request.device):
            return _Unenforced(self._off_reasons(request.device)
                               + self._env_reasons(holder, request.device))
        drain = self._gpu_stop(siblings, request) if is_gpu(request.device) else None
        hold = request.max_hold_s if not math.isinf(request.max_hold_s) else MAX_LEASE_S
        holder_target = self.target(holder)
        enforcement = self.enforcer.enter(
            holder_target, [self.target(j) for j in siblings], max_hold_s=hold,
            pre_ops=[drain] if drain else [], others=[self.target(j) for j in others])
        if is_gpu(request.device) and not self.config.gate:
            enforcement.gaps.append(Reason.mechanism(
                "gate_drain", "disabled by configuration (--no-gate): siblings' queued and new "
                "GPU work may run during the region", disabled=True))
        enforcement.gaps.extend(self._env_reasons(holder, request.device))
        cooling = self._cool_down(request.device, holder)
        if cooling is not None and cooling.waited_s > 0:
            enforcement.renew(hold + self.enforcer.config.lease_margin_s)  # from the grant
        jobs = [holder, *siblings, *others]
        return _Region(enforcement, drain,
                       self._watches(request.device, enforcement, jobs, cooling))

    def keep(self, held: Held) -> Evidence | None:
        """A released region's evidence with its enforcement kept for its holder's next
        region (:mod:`krex.daemon.keep`); None: it may not be kept (undo it as usual)."""
        if not isinstance(held, _Region) or not held.may_keep():
            return None
        return held.checkpoint()

    def resume(self, held: Held, request: Any) -> Held:
        """The holder's next region on ``held``, kept by :meth:`keep`."""
        assert isinstance(held, _Region)
        hold = request.max_hold_s if not math.isinf(request.max_hold_s) else MAX_LEASE_S
        held.enforcement.renew(hold + self.enforcer.config.lease_margin_s)
        return held

    def _cool_down(self, device: str, holder: Any) -> Cooling | None:
        """With ``--cool-below-c`` or ``--min-clock-frac``: wait, the others stopped, until
        the device is ready (:mod:`krex.enforce.cooldown`); ``cooling`` in status
        meanwhile."""
        want = self._readiness(device)
        reader = self._reader(device) if want is not None else None
        if reader is None or want is None:
            return None

        def waiting(state: Any, waited_s: float) -> None:
            self.cooling[device] = {"job_id": getattr(holder, "job_id", None),
                                    "waited_s": round(waited_s, 3),
                                    "temperature_c": state.temperature_c,
                                    "sm_clock_mhz": state.sm_clock_mhz,
                                    "below_c": want.below_c, "min_clock_mhz": want.min_mhz,
                                    "timeout_s": self.config.cool_timeout_s}
        try:
            return cool_down(reader, want, self.config.cool_timeout_s, waiting)
        finally:
            self.cooling.pop(device, None)

    def _readiness(self, device: str) -> Readiness | None:
        locked = self.clock_locks.locks.get(device)
        min_mhz = None
        if self.config.min_clock_frac is not None and locked is not None \
                and locked[0].sm_mhz is not None:
            min_mhz = int(self.config.min_clock_frac * locked[0].sm_mhz)
        if self.config.cool_below_c is None and min_mhz is None:
            return None
        return Readiness(self.config.cool_below_c, min_mhz)

    def _watches(self, device: str, enforcement: Enforcement, jobs: list[Any],
                 cooling: Cooling | None = None) -> tuple[Watch, ...]:
        """The device's own account of the region, begun now (as the grant is sent):
        fakegpu's server, and NVML where it answers for the device.  ``jobs``: every
        job of the daemon, the holder first."""
        pids = {r.pid for r in enforcement.counters.refs} if enforcement.counters else set()
        out: list[Watch] = []
        if device.startswith("fakegpu") and self.fakegpu is not None:
            out.append(FakegpuWatch.begin(self.fakegpu, pids))
        nvml = self._reader(device)
        if nvml is not None:
            own = [os.getpid(), self.fakegpu.proc.pid if self.fakegpu is not None else 0]
            viewer = getattr(jobs[0], "uid", None)  # the holder's user
            out.append(NvmlWatch.begin(nvml, Managed.of(jobs, own), viewer,
                                       clock_frac=self.config.release_clock_frac,
                                       sampler=self._sampler(device, nvml), cooling=cooling,
                                       seen=(self.sightings, device)))
        return tuple(out)

    def _sampler(self, device: str, nvml: DeviceReader) -> Sampler | None:
        """The device's sampler thread (made once; None: ``--device-sample-ms 0``)."""
        if self.config.device_sample_ms <= 0:
            return None
        if device not in self._samplers:
            self._samplers[device] = Sampler(nvml, self.config.device_sample_ms / 1e3)
        return self._samplers[device]

    def _reader(self, device: str) -> DeviceReader | None:
        """The device's management library -- NVML (cuda) or amdsmi (rocm) -- looked up
        once (None: neither answers for it: no device audit)."""
        if device not in self._readers:
            self._readers[device] = nvml_device(device, self.config.fakegpu_nvml) \
                or amdsmi_device(device, self.config.fakegpu_amdsmi)
        return self._readers[device]

    def hand_over(self, held: Held, holder: Any, siblings: list[Any], request: Any,
                  others: Sequence[Any] = ()) -> _Region | None:
        """The next region on ``held``'s device, taken over from it without undoing
        what both need (the frozen subtree, the narrowed cpusets and shield): the
        outgoing holder is moved back among the frozen, the incoming one into the slot.
        None (nothing changed) when it cannot be; then ``held.exit()`` and
        :meth:`enter` as usual.  The interposer's gates carry over (only the outgoing
        holder's closes and drains, the incoming one's opens); regions with the
        checkpoint lock or a device audit are always undone and set up again."""
        if not isinstance(held, _Region) or not held.can_hand_over():
            return None
        drain = None
        if is_gpu(request.device) and self.config.gate:
            drain = self._gate_drain(siblings, request)
            if drain is None or not isinstance(held.drain, GateDrain):
                return None
        hold = request.max_hold_s if not math.isinf(request.max_hold_s) else MAX_LEASE_S
        ready = take_prepared(held.enforcement, job_key(holder, siblings, list(others)))
        if ready is not None:  # worked out after the previous grant (handoff.prepare)
            enforcement = self.enforcer.hand_over(
                held.enforcement, ready.holder, ready.siblings, max_hold_s=hold,
                others=ready.others, pre_ops=[drain] if drain else [], prepared=ready.ops)
        else:
            enforcement = self.enforcer.hand_over(
                held.enforcement, self.target(holder), [self.target(j) for j in siblings],
                max_hold_s=hold, others=[self.target(j) for j in others],
                pre_ops=[drain] if drain else [])
        if enforcement is None:
            return None
        if is_gpu(request.device) and not self.config.gate:
            enforcement.gaps.append(Reason.mechanism(
                "gate_drain", "disabled by configuration (--no-gate): siblings' queued and new "
                "GPU work may run during the region", disabled=True))
        enforcement.gaps.extend(self._env_reasons(holder, request.device))
        pids = {r.pid for r in enforcement.counters.refs} if enforcement.counters else set()
        return _Region(enforcement, drain, tuple(
            w.hand_over(pids) for w in held.watches if isinstance(w, FakegpuWatch)))

    def prefetch(self, held: Held, job: Any, siblings: Sequence[Any] | None = None,
                 others: Sequence[Any] = ()) -> bool:
        """After ``held``'s grant: read ``job``'s counters while it is frozen, for the
        handoff that may grant it next (:meth:`Enforcement.prefetch`); with its
        ``siblings`` and ``others`` then, work that handoff's operations out too
        (:func:`krex.enforce.handoff.prepare`)."""
        if not isinstance(held, _Region) or not held.can_hand_over():
            return False
        holder = self.target(job)
        if siblings is not None:
            prepare(held.enforcement, job_key(job, list(siblings), list(others)), holder,
                    [self.target(j) for j in siblings], [self.target(j) for j in others])
        return held.enforcement.prefetch(holder)

    def _all_off(self, device: str) -> bool:
        c = self.config
        return c.freeze == "off" and not c.isolate and not (c.gate and is_gpu(device))

    def _off_reasons(self, device: str) -> list[Reason]:
        names = ["freeze", "isolate", *(["gate_drain"] if is_gpu(device) else [])]
        return [Reason.mechanism(n, "disabled by configuration", disabled=True) for n in names]

    def _gpu_stop(self, siblings: list[Any], request: Any) -> GateDrain | CheckpointLock | None:
        """The GPU step before freezing: the interposer's gate and drain, or the driver's
        checkpoint lock of every sibling process."""
        if not self.config.gate:
            return None
        if self.config.gpu_lock == "checkpoint":
            pids = [r.pid for j in siblings for r in self.target(j).processes()]
            lib_path, env = self._driver(request.device)
            idle = (FakegpuIdle(self._fakegpu()) if request.device.startswith("fakegpu")
                    else NvmlIdle.for_device(request.device))
            return CheckpointLock(self._driver_lib(lib_path), lib_path, pids,
                                  timeout_s=self.config.drain_timeout_s, env=env, idle=idle)
        return self._gate_drain(siblings, request)

    def _driver(self, device: str) -> tuple[str, dict[str, str]]:
        """The CUDA driver the daemon itself loads, and the environment it needs."""
        if device.startswith("fakegpu"):
            from krex.devices.native import fakegpu_lib_dir

            env = {"KREX_FAKEGPU_SOCKET": self._fakegpu().socket_path}
            os.environ.update(env)
            return str(fakegpu_lib_dir() / "libcuda.so.1"), env
        return "libcuda.so.1", {}

    def _driver_lib(self, path: str) -> Any:
        if path not in self._drivers:
            self._drivers[path] = load_driver(path)
        return self._drivers[path]

    def _gate_drain(self, siblings: list[Any], request: Any) -> GateDrain | None:
        gated = [replace(self.gates[j.job_id], members=self.target(j).processes)
                 for j in siblings if j.job_id in self.gates]
        return GateDrain(gated, timeout_s=self.config.drain_timeout_s,
                         policy=self.config.drain_policy,
                         max_wait_s=min(request.max_hold_s, 3600.0))

    def target(self, job: Any) -> JobTarget:
        tracked = list(job.members)
        if job.kind == "adhoc":
            tracked.append(job.owner)
        # An ad-hoc job's process group is its caller's (a shell pipeline, say): it is
        # never signalled as a group, only the job's own processes and descendants.
        group = None if job.kind == "adhoc" else job.group
        operator = job.uid in (0, os.getuid())  # root or the daemon's user: anything
        return JobTarget(job.job_id, root=job.root, group=group, cgroups=job.cgroups,
                         tracked=tracked, uid=None if operator else job.uid)

    # -- the node --------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        backends = self.enforcer.backends()
        return {"freeze": backends["freeze_chosen"] or "off", "isolate": self.config.isolate,
                "measure_cores": backends["measure_cores"], "gate": self.config.gate,
                "guardian_pid": self.guardian.pid, "cgroups": self.layout.bases(),
                "cooling": dict(self.cooling), "clocks": self.clock_locks.describe(),
                "device_sightings": self.sightings.describe()}

    def backends(self) -> dict[str, Any]:
        return self.enforcer.backends()

    def check_guardian(self) -> bool:
        """Restart the guardian if it died (it gets every active lease); True if it did."""
        return self.guardian.ensure_alive()

    def guardian_restarts(self) -> int:
        return self.guardian.restarts

    def lock_clocks(self, devices: Sequence[str]) -> None:
        """``--lock-clocks``: lock every device NVML or amdsmi answers for (at start)."""
        if self.config.lock_clocks is None:
            return
        audited = {name: reader for name in devices
                   if isinstance(reader := self._reader(name), NvmlDevice | AmdsmiDevice)}
        self.clock_locks.lock_all(audited, self.config.lock_clocks)
        for name, why in self.clock_locks.errors.items():
            log.warning("%s: clocks not locked: %s", name, why)

    def close(self) -> None:
        self.clock_locks.reset_all()
        self.enforcer.shield.unpark()  # a lingering narrowing widens now, not on a timer
        for job_id in list(self.gates):
            self.job_ended(job_id)
        if self.fakegpu is not None:
            self.fakegpu.stop()
            self.fakegpu = None
        try:
            self.guardian.stop()
        except (KrexError, OSError):
            pass
        self.layout.remove_instance(self.instance)
