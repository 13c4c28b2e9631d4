"""Daemon settings: :class:`DaemonConfig`, the one place each setting, its default and its
choices are written.

Every field's metadata says how ``krex serve`` offers it (help, choices, how a
flag's text becomes the value); the CLI generates the flags from it
(:func:`krex.cli.daemon_cmds.add_config_flags`), so a default or a choice is
never restated.  The embedded daemon and harnesses build a ``DaemonConfig``
(or pass the same flags).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from krex.daemon.users import parse_range
from krex.enforce.enforcer import FREEZE_CHOICES
from krex.enforce.gatedrain import POLICIES as DRAIN_POLICIES
from krex.enforce.warm import DEFAULT_LINGER_S, DEFAULT_PERIOD_MS
from krex.protocol.address import SOCKET_NAME, group_id, node_dir, runtime_dir
from krex.protocol.runas import DEFAULT_UIDS

if TYPE_CHECKING:
    from krex.workers import PoolSpec

FREEZE_SCOPES = ("device", "node")
GPU_LOCKS = ("interposer", "checkpoint")


def parse_cores(text: str) -> list[int]:
    """``"1"``, ``"2-3"``, ``"0,2-3"`` -> core numbers."""
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def parse_list(text: str) -> list[str]:
    """``"numpy,torch"`` -> ``["numpy", "torch"]``."""
    return [item for item in text.split(",") if item]


def flag(help: str, *, choices: tuple[str, ...] | None = None,
         parse: Callable[[str], Any] | None = None, metavar: str | None = None,
         shown_default: str | None = None, cli: bool = True,
         hidden: bool = False) -> dict[str, Any]:
    """Field metadata: how ``krex serve`` offers the setting (``cli=False``: not a flag).

    ``help`` is the flag's own text: for a boolean that defaults to true the flag is
    ``--no-NAME``, so its help says what turning it off does."""
    return {"help": help, "choices": choices, "parse": parse, "metavar": metavar,
            "shown_default": shown_default, "cli": cli, "hidden": hidden}


@dataclass
class DaemonConfig:
    runtime_dir: str = field(default="", metadata=flag(
        "directory for the socket and logs", shown_default="with --node $KREX_NODE_DIR or "
        "/run/krex; else $KREX_RUNTIME_DIR, $XDG_RUNTIME_DIR/krex or /tmp/krex-UID"))
    node: bool = field(default=False, metadata=flag(
        "one daemon for the whole node (run as root or a service user): every user in the "
        "socket's group may connect, each acts on its own jobs and regions only"))
    group: str | None = field(default=None, metadata=flag(
        "the group whose members may connect (socket 0660, directory 0750)",
        shown_default="krex with --node, else owner-only"))
    socket_path: str = field(default="", metadata=flag("", cli=False))  # runtime_dir's socket
    max_hold_s: float = field(default=60.0, metadata=flag(
        "ceiling on any region's hold: a region held longer is revoked; clients may ask "
        "for less, never more"))
    fair_window_ms: float = field(default=20.0, metadata=flag(
        "after a release, how long jobs that were frozen through it may take to ask before "
        "the device is granted again (0: off)"))
    requeue_ms: float = field(default=5.0, metadata=flag(
        "a job that releases while others wait is queued again for its next region, "
        "before the device is handed on and the job frozen; granted in its turn, that "
        "region is offered to the job, and is the job's if it asks within this long; it "
        "lapses after twice this long (a claim's time to be read) (0: off)"))
    warm_moves_ms: float = field(default=DEFAULT_PERIOD_MS, metadata=flag(
        "while regions are taken, the daemon moves itself into its own cgroup this often "
        "so that the kernel's cgroup rwsem stays in its fast state: a region's cgroup moves "
        "after a pause then take ~0.2 ms, not an RCU grace period (~8 ms here) at set-up "
        "and again at undo (0: off; off by itself where the cgroup2 mount has "
        "favordynmods)", metavar="MS"))
    warm_linger_s: float = field(default=DEFAULT_LINGER_S, metadata=flag(
        "how long after a region's acquire or release, a job's registration or a program's "
        "start in a warm worker the daemon keeps cgroup moves warm (--warm-moves-ms); an "
        "idle daemon pings nothing", metavar="S"))
    tenant_max_jobs: int | None = field(default=None, metadata=flag(
        "jobs one tenant (a uid, or a service's tenant id) may run at once",
        shown_default="unlimited"))
    tenant_region_s_per_min: float | None = field(default=None, metadata=flag(
        "region-seconds one tenant may hold in any minute; past it, acquires fail with "
        "quota_exceeded", shown_default="unlimited"))
    tenant_max_hold_s: float | None = field(default=None, metadata=flag(
        "longest hold one tenant's region may ask for (within --max-hold-s)",
        shown_default="--max-hold-s"))
    tenant_uids: str = field(default=DEFAULT_UIDS, metadata=flag(
        "as root: the uids tenants' code runs as -- each tenant a trusted peer names (the "
        "HTTP/MCP service's API tokens) gets one of its own, never root; the first is the "
        "socket's group when there is no --group ('off': such programs are refused; "
        "'daemon': they run as this daemon's user, root included -- only where every "
        "tenant may have a shell as it)",
        metavar="FIRST-LAST"))
    max_connections_per_uid: int = field(default=256, metadata=flag(
        "connections one uid may keep open at once"))
    max_acquires_per_connection: int = field(default=64, metadata=flag(
        "regions one connection may hold or wait for at once"))
    max_execs_per_connection: int = field(default=16, metadata=flag(
        "programs one connection may run in warm workers at once"))
    event_log_queue: int = field(default=10000, metadata=flag(
        "events waiting to be written at most; more are dropped and counted"))
    event_log_max_mb: float = field(default=64.0, metadata=flag(
        "the event log (events.jsonl, on the runtime dir's tmpfs) starts afresh past this "
        "size, its previous part kept as events.jsonl.1: at most about twice this in "
        "memory (0: never rotated)", metavar="MB"))
    keep_regions: int = field(default=20000, metadata=flag(
        "finished regions' records kept for `krex regions` and the service's node page "
        "(compressed, about 63 B each); older ones are in the event log only"))
    keep_jobs: int = field(default=5000, metadata=flag(
        "ended jobs' records kept for `krex jobs` (about 0.6 KB each)"))
    idle_exit_s: float | None = field(default=None, metadata=flag(
        "exit after this long with nothing to do: no connection, region or job, and no "
        "program running in a warm worker (idle warm workers are stopped with it)"))
    exit_with: int | None = field(default=None, metadata=flag(
        "exit (cleanly: nothing left frozen) once this process is gone: the private "
        "daemon of a harness (krex eval, a benchmark, the tests) never outlives it, even "
        "when it is killed", metavar="PID"))
    group_access: bool = field(default=False, metadata=flag(
        "let the socket's group connect (owner-only by default)"))
    freeze: str = field(default="auto", metadata=flag(
        "freeze backend for siblings (auto: the best available)", choices=FREEZE_CHOICES))
    freeze_scope: str = field(default="device", metadata=flag(
        "freeze siblings on the same device or the whole node", choices=FREEZE_SCOPES))
    isolate: bool = field(default=True, metadata=flag("do not reserve CPU cores"))
    measure_cores: list[int] | None = field(default=None, metadata=flag(
        "cores reserved for region holders, e.g. 1 or 2-3", parse=parse_cores, metavar="CORES",
        shown_default="the last core, or the last quarter"))
    gate: bool = field(default=True, metadata=flag("do not gate/drain GPU work"))
    drain_timeout_s: float = field(default=5.0, metadata=flag(
        "how long a grant waits for siblings' queued GPU work to finish"))
    drain_policy: str = field(default="abort", metadata=flag(
        "a sibling that does not drain in time: abort the grant with drain_timeout, wait "
        "up to the region's maximum hold, or SIGKILL the processes that did not acknowledge",
        choices=DRAIN_POLICIES))
    gpu_lock: str = field(default="interposer", metadata=flag(
        "how siblings' GPU work is stopped: the LD_PRELOAD gate and drain, or the driver's "
        "cuCheckpointProcessLock (R570+; not yet measured on a GPU)", choices=GPU_LOCKS))
    cgroups: bool = field(default=True, metadata=flag(
        "give jobs no cgroups (freeze falls back to SIGSTOP, isolation to affinity)"))
    embedded: bool = field(default=False, metadata=flag(
        "started by a client: exit 0 when another daemon already serves", hidden=True))
    shutdown_grace_s: float = field(default=10.0, metadata=flag(
        "on the first SIGTERM or `krex stop`: how long held regions may still finish"))
    fakegpu_core: int | None = field(default=None, metadata=flag(
        "core the fakegpu server runs kernels on",
        shown_default="the first core not reserved for region holders"))
    fakegpu_ctx_delay_ms: int = field(default=0, metadata=flag(
        "fakegpu context-creation delay (serialised node-wide)"))
    release_clock_frac: float = field(default=0.9, metadata=flag(
        "a GPU region whose SM clock at release (NVML) is below this fraction of its clock "
        "at grant is not clean (throttled), as is one with a throttle reason other than "
        "idle or the applications clock setting (0: clocks not compared)", metavar="FRAC"))
    device_sample_ms: float = field(default=5.0, metadata=flag(
        "while a GPU region is held, read the device's clocks, temperature, power and "
        "throttle reasons (NVML) this often, from a thread of the daemon's: throttling or "
        "a clock dip between grant and release makes it not clean (0: only at grant and "
        "release)", metavar="MS"))
    cool_below_c: float | None = field(default=None, metadata=flag(
        "hold a GPU grant, once the other jobs are stopped, until NVML reads the device at "
        "or below this temperature (C) with no throttle reason, at most --cool-timeout-s",
        metavar="C", shown_default="off"))
    min_clock_frac: float | None = field(default=None, metadata=flag(
        "with --lock-clocks: also hold a GPU grant until the device's SM clock is at least "
        "this fraction of the locked clock (an idle device's clock is its idle clock "
        "unless locked), at most --cool-timeout-s", metavar="FRAC", shown_default="off"))
    cool_timeout_s: float = field(default=30.0, metadata=flag(
        "the longest a grant waits for the device to cool (then it is granted, and its "
        "report says it was not cooled)"))
    lock_clocks: str | None = field(default=None, metadata=flag(
        "lock each GPU's clock while the daemon runs, at its base clock (steady under "
        "load; AMD: STABLE_STD) or its maximum (AMD: STABLE_PEAK); reset at stop, and by "
        "the guardian if the daemon dies (root only)", choices=("base", "max"),
        shown_default="off"))
    fakegpu_nvml: int | None = field(default=None, metadata=flag(
        "test hook: also audit fakegpu devices through NVML device N, whatever module "
        "`pynvml` is on the daemon's path (tests put a fake one there)", metavar="N",
        hidden=True))
    fakegpu_amdsmi: int | None = field(default=None, metadata=flag(
        "test hook: audit fakegpu devices through amdsmi's device N, whatever module "
        "`amdsmi` is on the daemon's path (tests put a fake one there)", metavar="N",
        hidden=True))
    workers_min: int = field(default=1, metadata=flag("warm workers kept per device"))
    workers_max: int = field(default=2, metadata=flag("warm workers at most per device"))
    max_programs: int = field(default=100, metadata=flag(
        "programs a worker serves before it is recycled"))
    preload: list[str] = field(default_factory=lambda: ["numpy"], metadata=flag(
        "comma-separated modules each worker imports at start", parse=parse_list,
        metavar="MODULES", shown_default="numpy"))
    rt_priority: int = field(default=0, metadata=flag(
        "SCHED_RR priority of the daemon's threads (1-99; 0: off, the default), each set "
        "by the thread itself, kept off the holders' reserved cores; whatever they start "
        "begins at SCHED_OTHER, nice 0, on every core.  A woken daemon thread preempts the "
        "contenders at once (and keeps them waiting while it runs: not a measured gain "
        "on a loaded 2-core machine, docs/notes/handoff.md).  Needs root (CAP_SYS_NICE) or "
        "RLIMIT_RTPRIO, else --nice, else nothing (krex status: daemon.priority)",
        metavar="N"))
    nice: int = field(default=0, metadata=flag(
        "nice value of the daemon's threads when --rt-priority is 0 or refused (0: as "
        "started)", metavar="N"))
    worker_memory_cap_mb: float | None = field(default=None, metadata=flag(
        "device memory cap per warm worker (fakegpu: its driver; cuda: torch's allocator "
        "when torch is preloaded)"))

    def __post_init__(self) -> None:
        if not self.runtime_dir:
            self.runtime_dir = node_dir() if self.node else runtime_dir()
        if self.node and self.group is None:
            self.group = "krex"
        if self.keep_regions < 1 or self.keep_jobs < 1:
            raise ValueError("--keep-regions and --keep-jobs must be at least 1")
        if not 0 <= self.requeue_ms <= 10000:
            raise ValueError("--requeue-ms must be between 0 (off) and 10000")
        if self.warm_moves_ms < 0 or self.warm_linger_s < 0:
            raise ValueError("--warm-moves-ms and --warm-linger-s must be 0 or more")
        if 0 < self.warm_moves_ms < 0.5:
            raise ValueError("--warm-moves-ms below 0.5 would ping the kernel's cgroup "
                             "lock thousands of times a second; 4 keeps moves fast")
        if self.lock_clocks is not None and os.geteuid() != 0:
            raise ValueError("--lock-clocks needs root: NVML lets only root lock a GPU's "
                             "clocks (run krex serve as root, or leave clocks unlocked)")
        if self.event_log_max_mb < 0:
            raise ValueError("--event-log-max-mb must be 0 (never rotated) or more")
        if self.min_clock_frac is not None and not 0 < self.min_clock_frac <= 1:
            raise ValueError("--min-clock-frac must be above 0 and at most 1")
        if self.min_clock_frac is not None and self.lock_clocks is None:
            raise ValueError("--min-clock-frac needs --lock-clocks: an idle device runs at "
                             "its idle clock, so a clock before the grant means something "
                             "only when it is locked")
        if self.cool_timeout_s < 0:
            raise ValueError("--cool-timeout-s must be 0 or more")
        if self.device_sample_ms < 0:
            raise ValueError("--device-sample-ms must be 0 (off) or more")
        if not 0 <= self.release_clock_frac <= 1:
            raise ValueError("--release-clock-frac must be between 0 (off) and 1")
        if not self.socket_path:
            self.socket_path = os.path.join(self.runtime_dir, SOCKET_NAME)
        parse_range(self.tenant_uids)  # a bad range fails here, not at the first program

    def tenant_uid_range(self) -> range | None:
        """The uids for tenants' code (krex.daemon.users): only a root daemon can give
        them; None where it cannot or ``--tenant-uids off``."""
        return parse_range(self.tenant_uids) if os.geteuid() == 0 else None

    def socket_gid(self) -> int | None:
        """The group that may open the socket: ``--group``'s, else the tenant users'
        (the first of ``--tenant-uids``), else none (owner-only)."""
        if self.group:
            return group_id(self.group)
        uids = self.tenant_uid_range()
        return uids.start if uids is not None else None

    def pool_spec(self) -> PoolSpec:
        from krex.workers import PoolSpec

        return PoolSpec(device="cpu", min_workers=self.workers_min, max_workers=self.workers_max,
                        max_programs=self.max_programs, preload=list(self.preload),
                        device_memory_cap_mb=self.worker_memory_cap_mb)

    def reserved_cores(self) -> list[int]:
        """The holders' reserved cores (as the enforcer reserves them), for the daemon's
        elevated threads and its warm pings to keep off."""
        if not self.isolate:
            return []
        from krex.enforce.isolation import default_cores

        if self.measure_cores is not None:
            return sorted(self.measure_cores)
        return default_cores(sorted(os.sched_getaffinity(0)))

    @property
    def event_log(self) -> str:
        return os.path.join(self.runtime_dir, "events.jsonl")

    @property
    def lock_path(self) -> str:
        return os.path.join(self.runtime_dir, "krexd.lock")
