"""The daemon's threads get a CPU before the programs they arbitrate.

A handoff is a chain of wake-ups: the releasing session's thread, the next
holder's grant, the outgoing region's report.  On a loaded machine each of
them waits for a CPU behind the contenders' own busy loops (and everything
else the machine runs): measured under ``bench_regions.py``'s held run, the
daemon's threads spent more time runnable-but-waiting than running
(docs/notes/handoff.md, "Where the enforced handoff's time goes").  So each
daemon thread that serves requests or runs a device's enforcement can put
itself in ``SCHED_RR`` (``krex serve --rt-priority N``) when it starts:
woken, it preempts a CFS task at once.  (A nice value, ``--nice``, is the
fallback: under EEVDF a woken nice -10 thread may still wait for the running
task's slice, and measured with the shield it made round trips slower.)  Off
by default: on the loaded 2-core development machine neither gave a gain
that stood out of the noise, and with the shield (the daemon and every
contender not holding the device share the other core) RR's daemon kept the
thawed contenders waiting (docs/notes/handoff.md).

Policies are per thread on Linux and a new thread inherits its creator's, as
does a child process.  Every elevated thread also sets
``SCHED_RESET_ON_FORK``, so whatever it starts — a worker, the guardian, the
fake device server, a thread of its own — begins at ``SCHED_OTHER``, nice 0:
a benchmark never runs at the daemon's priority (the guardian then lowers itself to
``SCHED_BATCH``: krex.enforce.guardian).  (The flag resets new
threads too, which is why each daemon thread elevates itself.)  An elevated
thread keeps off the holders' reserved cores (its affinity: the rest), where
it would take the core from a holder the moment it wakes; a worker it forks
widens itself again before ``exec`` (:func:`widen`).

Needs root (``CAP_SYS_NICE``) or ``RLIMIT_RTPRIO`` / ``RLIMIT_NICE``; where
it is not permitted the daemon runs as started and ``krex status`` says why
(``daemon.priority``).  The kernel's RT throttling (``sched_rt_runtime_us``)
bounds what a runaway RR thread could take.
"""

from __future__ import annotations

import os
import threading

_state: dict[str, object] = {"nice": 0, "rt": 0, "applied": False, "why": "not configured"}
_cores: dict[str, list[int]] = {"all": [], "rest": []}


def configure(nice: int, rt: int = 0, reserved: list[int] | tuple = ()) -> None:
    """The nice value the daemon's threads take (0: leave them as they are); ``rt`` > 0:
    ``SCHED_RR`` at that priority instead (``krex serve --rt-priority``).  ``reserved``:
    the region holders' cores, which an elevated thread keeps off (it would preempt the
    holder there); what it starts is widened again by :func:`widen`."""
    _state["nice"], _state["rt"] = int(nice), int(rt)
    _state["why"] = "" if nice or rt else "disabled by configuration (--rt-priority 0 --nice 0)"
    every = sorted(os.sched_getaffinity(0))
    _cores["all"] = every
    _cores["rest"] = [c for c in every if c not in set(reserved)] if reserved else []


def elevate() -> bool:
    """Give the calling thread the configured priority (``SCHED_RR`` at ``rt``, else the
    nice value; with ``rt`` refused, the nice value), reset in whatever it starts; False
    (and the reason kept for :func:`describe`) when not configured or refused."""
    nice = int(_state["nice"])  # type: ignore[call-overload]
    rt = int(_state["rt"])  # type: ignore[call-overload]
    if not nice and not rt:
        return False
    tid = threading.get_native_id()
    why = []
    for policy in (["rr"] if rt else []) + (["nice"] if nice else []):
        try:
            _set(tid, policy, rt, nice)
        except (OSError, AttributeError) as exc:  # EPERM without CAP_SYS_NICE; not Linux
            why.append(f"{policy} not permitted here: {exc}")
            continue
        _state["applied"], _state["policy"] = True, policy
        _state["why"] = "; ".join(why)
        _keep_off_reserved(tid)
        return True
    _state["applied"], _state["why"] = False, "; ".join(why)
    return False


def _keep_off_reserved(tid: int) -> None:
    """An elevated thread never runs on a holder's reserved core: there it would take
    the core from the holder the moment it wakes (after a grant, say)."""
    if _cores["rest"]:
        try:
            os.sched_setaffinity(tid, _cores["rest"])
        except OSError:
            pass


def widen() -> None:
    """The calling thread (or a child between fork and exec) gets every core again: a
    worker forked by a daemon thread that keeps off the reserved cores calls this in its
    ``preexec_fn`` (its policy and nice were reset by the fork already)."""
    if _cores["rest"] and _cores["all"]:
        try:
            os.sched_setaffinity(0, _cores["all"])  # the calling thread
        except OSError:
            pass


def _set(tid: int, policy: str, rt: int, nice: int) -> None:
    if policy == "rr":
        os.sched_setscheduler(tid, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(rt))
        return
    os.sched_setscheduler(tid, os.SCHED_OTHER | os.SCHED_RESET_ON_FORK, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, tid, nice)


def describe() -> dict[str, object]:
    """For ``krex status``: the configured nice, whether it took, and why not."""
    return {"nice": _state["nice"], "rt_priority": _state["rt"], "applied": _state["applied"],
            "policy": _state.get("policy"), "why": _state["why"] or None}


def thread_nice(pid: int, tid: int) -> int:
    """A thread's nice value as the kernel reports it (tests, benchmarks)."""
    from krex.enforce.process import task_stat

    st = task_stat(pid, tid)
    if st is None:
        raise ProcessLookupError(f"thread {tid} of process {pid} is gone")
    return st.nice


__all__ = ["configure", "describe", "elevate", "thread_nice", "widen"]
