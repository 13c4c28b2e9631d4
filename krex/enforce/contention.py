"""Contention evidence: was the holder kept off its CPUs during the region?

Enforcement moves and freezes only krex jobs; anything else on the machine
(other users' programs, unmanaged shells, system services) may still run on
the holder's cores.  This module judges, from the holder's own scheduler
counters (:mod:`krex.enforce.schedstat`, read once at region start and once
at region end), whether that happened enough to matter:

* **run delay** — nanoseconds the holder's threads were runnable but waiting
  for a CPU.  A CPU-bound competitor gets the CPU from a CPU-bound holder at
  a scheduler tick and keeps it until the next one, so each of its turns
  costs the holder about one tick (measured: 3.98–4.0 ms per hit at 250 Hz);
  a kernel thread's wake-up costs microseconds; the grant itself costs the
  holder up to ~1.7 ms of waiting while the daemon finishes on its core
  (measured over 200 empty regions on the 2-core VM: p95 1.35–1.7 ms).  The
  threshold is therefore **three quarters of a tick** — above the grant's own
  cost, below one competitor turn — plus :data:`BACKGROUND_FRACTION` of the
  region's span for the background of short kernel wake-ups.
* **self-contention** is told apart: when the holder is confined to known
  cores and its own threads used all but less than the threshold of their
  CPU time, nothing else can have run there, and the wait was among its own
  threads.
* **who** — only when the threshold is crossed (so the clean path costs
  nothing more), tasks in state ``R`` whose last CPU is one of the holder's
  cores are listed from ``/proc/*/task/*/stat``.

Involuntary switches and migrations are reported as evidence, not judged:
on the development VM a quiet 10 ms region has up to 4 involuntary switches
(kernel threads, microseconds each) and one with a CPU hog pinned on its core
1–2 (a tick each): a switch count cannot tell a 5 µs from a 4 ms switch; the
run delay can.  The tick comes from the kernel's ``CONFIG_HZ``
(``/proc/config.gz`` or ``/boot/config-<release>``), else from counting
jiffies in ``/proc/timer_list`` for 50 ms, else 250 Hz is assumed (and said).
"""

from __future__ import annotations

import functools
import gzip
import os
import time
from dataclasses import dataclass

from krex.enforce.process import task_stat
from krex.enforce.schedstat import Counts, HolderCounters
from krex.protocol.report import HostEvidence, Reason, ReasonCode

TICK_FRACTION = 0.75  # of one scheduler tick: less than one competitor turn
BACKGROUND_FRACTION = 0.001  # of the region's span: short kernel wake-ups (measured ~0.015 %)
DEFAULT_HZ = 250
MAX_TASKS_LISTED = 8
_STANDARD_HZ = (100, 250, 300, 1000)


@functools.cache
def kernel_tick() -> tuple[float, str]:
    """(the scheduler tick in seconds, where that figure came from)."""
    hz, source = _config_hz()
    if hz is None:
        hz, source = _counted_hz()
    if hz is None:
        hz, source = DEFAULT_HZ, "assumed (CONFIG_HZ not readable)"
    return 1.0 / hz, source


def _config_hz() -> tuple[int | None, str]:
    paths = ("/proc/config.gz", f"/boot/config-{os.uname().release}")
    for path in paths:
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt") as f:
                for line in f:
                    if line.startswith("CONFIG_HZ="):
                        return int(line.split("=")[1]), f"CONFIG_HZ ({path})"
        except (OSError, ValueError, EOFError):
            continue
    return None, ""


def _jiffies() -> int | None:
    try:
        with open("/proc/timer_list") as f:
            for line in f:
                if line.startswith("jiffies:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _counted_hz() -> tuple[int | None, str]:
    j0, t0 = _jiffies(), time.monotonic()
    if j0 is None:
        return None, ""
    time.sleep(0.05)
    j1, t1 = _jiffies(), time.monotonic()
    if j1 is None or j1 <= j0:
        return None, ""
    rate = (j1 - j0) / (t1 - t0)
    return min(_STANDARD_HZ, key=lambda hz: abs(hz - rate)), "jiffies counted in /proc/timer_list"


@functools.cache
def delay_measurable() -> bool:
    """Whether this kernel reports run delay (CONFIG_SCHED_INFO)."""
    return os.path.exists(f"/proc/{os.getpid()}/schedstat")


def delay_threshold_ns(span_ns: int) -> int:
    """Run delay above which a region of ``span_ns`` counts as preempted."""
    tick_s, _ = kernel_tick()
    return int(TICK_FRACTION * tick_s * 1e9 + BACKGROUND_FRACTION * span_ns)


@dataclass
class Contention:
    """The holder's counters over a region and what they say."""

    totals: Counts
    span_ns: int
    cores: list[int]  # where the holder could run
    confined: bool  # the holder was held to ``cores`` (isolation applied)

    @property
    def threshold_ns(self) -> int:
        return delay_threshold_ns(self.span_ns)

    @property
    def others_bound_ns(self) -> int | None:
        """At most this much CPU time on the holder's cores went to other tasks."""
        if not self.confined or self.totals.cpu_ns is None:
            return None
        return max(0, len(self.cores) * self.span_ns - self.totals.cpu_ns)

    def preempted(self) -> bool:
        delay = self.totals.delay_ns
        if delay is None or delay <= self.threshold_ns:
            return False
        bound = self.others_bound_ns
        return bound is None or bound > self.threshold_ns  # else: its own threads filled them

    def evidence(self) -> dict:
        tick_s, source = kernel_tick()
        t = self.totals
        return {"run_delay_ms": ns_to_ms(t.delay_ns),
                "threshold_ms": ns_to_ms(self.threshold_ns),
                "span_ms": ns_to_ms(self.span_ns), "holder_cpu_ms": ns_to_ms(t.cpu_ns),
                "involuntary_switches": t.switches, "migrations": t.migrations,
                "cores": list(self.cores), "tick_ms": round(tick_s * 1e3, 3),
                "tick_source": source}


def ns_to_ms(ns: int | None) -> float | None:
    return None if ns is None else round(ns / 1e6, 3)


def judge(contention: Contention, holder_pids: set[int]) -> list[Reason]:
    """``holder_preempted`` (and ``foreign_task`` with who) when the run delay says so."""
    if contention.totals.delay_ns is None:
        return []
    if not contention.preempted():
        return []
    ev = contention.evidence()
    tasks = runnable_on(contention.cores, holder_pids | {os.getpid()})
    out = [Reason(ReasonCode.HOLDER_PREEMPTED,
                  f"holder: waited {ev['run_delay_ms']} ms for its CPUs {ev['cores']} "
                  f"(threshold {ev['threshold_ms']} ms: {TICK_FRACTION:g} of a "
                  f"{ev['tick_ms']} ms tick "
                  f"+ {BACKGROUND_FRACTION:.1%} of {ev['span_ms']} ms)", ev)]
    if tasks:
        who = ", ".join(f"{t['pid']} ({t['comm']})" for t in tasks[:3])
        out.append(Reason(ReasonCode.FOREIGN_TASK,
                          f"holder's cores: other runnable tasks at region end: {who}",
                          {"tasks": tasks, "cores": list(contention.cores)}))
    return out


def unmeasurable() -> Reason:
    """The gap when this kernel reports no run delay: preemption cannot be judged."""
    return Reason.mechanism("contention_check",
                            "this kernel reports no run delay (/proc/PID/schedstat missing: "
                            "CONFIG_SCHED_INFO off): preemption of the holder cannot be judged")


def runnable_on(cores: list[int], exclude_pids: set[int]) -> list[dict]:
    """Tasks in state R whose last CPU is one of ``cores`` (one /proc scan)."""
    wanted = set(cores)
    out: list[dict] = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude_pids:
            continue
        try:
            tids = os.listdir(f"/proc/{name}/task")
        except OSError:
            continue
        for tid in tids:
            task = _runnable(int(name), int(tid), wanted)
            if task is not None:
                out.append(task)
                if len(out) >= MAX_TASKS_LISTED:
                    return out
    return out


def _runnable(pid: int, tid: int, cores: set[int]) -> dict | None:
    try:
        st = task_stat(pid, tid)
    except OSError:  # unreadable now: not listed
        return None
    if st is None or st.state != "R" or st.processor not in cores:
        return None
    return {"pid": pid, "tid": tid, "comm": st.comm, "cpu": st.processor,
            "cmdline": _cmdline(pid)}


def _cmdline(pid: int) -> str:
    """The command line's first 160 characters ('' for kernel threads, or when gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(160).replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class SelfWatch:
    """The calling process's own counters over a region nested in another (a thread's
    outer region, or a whole-job hold): judged like a daemon region's holder."""

    def __init__(self) -> None:
        from krex.enforce.process import ProcessRef

        self.pid = os.getpid()
        self.counters = HolderCounters.begin([ProcessRef.of(self.pid)])
        self.cores = sorted(os.sched_getaffinity(0))
        self.t0_ns = time.monotonic_ns()

    def finish(self) -> tuple[HostEvidence, list[Reason]]:
        """The nested region's host evidence (counters only) and reasons against it."""
        span = time.monotonic_ns() - self.t0_ns
        online = os.sysconf("SC_NPROCESSORS_ONLN")
        contention = Contention(self.counters.totals(), span, self.cores,
                                confined=len(self.cores) < online)
        reasons = judge(contention, {self.pid}) if delay_measurable() else [unmeasurable()]
        t = contention.totals
        host = HostEvidence(holder_involuntary_switches=t.switches, holder_migrations=t.migrations,
                            holder_run_delay_ms=ns_to_ms(t.delay_ns),
                            holder_cpu_ms=ns_to_ms(t.cpu_ns),
                            run_delay_threshold_ms=ns_to_ms(contention.threshold_ns),
                            holder_cores=list(self.cores))
        return host, reasons
