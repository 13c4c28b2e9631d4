"""Where a plain handoff's time goes, seen from the kernel (issue 18; root, tracefs).

Runs ``bench_regions.held_fraction`` (4 jobs, back-to-back 5 ms plain regions) on a
private daemon and records, for a fraction of a second in the middle, the scheduler's
switches and wake-ups, the socket and file syscalls and the cgroup moves
(``/sys/kernel/tracing``).  Each handoff is then cut at these marks, from the outgoing
job's release ``sendto``:

- ``release_read``: a daemon thread returns from ``recvfrom`` with it;
- ``first_file_op``: the daemon's first ``openat`` after that (Python before it);
- ``incoming_moved``: the next job's processes are moved (``cgroup_attach_task``);
- ``reply_read``: that job, thawed, reads its previous release's reply;
- ``ask_sent``: it sends its ``acquire``;
- ``ask_read`` / ``grant_sent``: the daemon reads it and answers;
- ``grant_read``: the job has its grant (its region starts).

Only handoffs to a re-queued region with every mark in order are counted.  Prints
the median of each segment; writes results/trace_handoff.json.  Tracing adds a few
µs to every marked step.

Usage: python benchmarks/trace_handoff.py [--seconds S] [--trace-s T]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_regions as br  # noqa: E402
from common import md_table, private_daemon, write_results  # noqa: E402

from krex.measure import stats  # noqa: E402

TRACING = "/sys/kernel/tracing"
EVENTS = ("sched:sched_switch", "sched:sched_wakeup", "syscalls:sys_enter_sendto",
          "syscalls:sys_exit_recvfrom", "syscalls:sys_enter_openat",
          "cgroup:cgroup_attach_task")
MARKS = ("release_read", "first_file_op", "incoming_moved", "reply_read", "ask_sent",
         "ask_read", "grant_sent", "grant_read")
LINE = re.compile(r"\s*.+?-(\d+)\s+\[\d+\]\s+\S+\s+([\d.]+):\s+(\w+):?\s*(.*)")


def _tracefs() -> None:
    if not os.path.exists(f"{TRACING}/trace"):
        subprocess.run(["mount", "-t", "tracefs", "nodev", TRACING], check=True)


def _set(name: str, value: str) -> None:
    with open(f"{TRACING}/{name}", "w") as f:
        f.write(value)


def record(seconds: float, trace_s: float) -> tuple[str, dict, dict[int, tuple[str, set[int]]]]:
    """(the trace's text, held_fraction's result, pid -> (its command line, thread ids))
    of the processes alive when the trace stopped)."""
    _tracefs()
    _set("tracing_on", "0")
    _set("trace", "")
    _set("buffer_size_kb", "16384")
    _set("set_event", "\n".join(EVENTS) + "\n")
    tasks: dict[int, tuple[str, set[int]]] = {}

    def window() -> None:
        time.sleep(seconds / 2)
        _set("tracing_on", "1")
        time.sleep(trace_s)
        _set("tracing_on", "0")
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    tasks[int(pid)] = (_cmdline(int(pid)),
                                       {int(t) for t in os.listdir(f"/proc/{pid}/task")})
                except OSError:
                    pass

    try:
        with private_daemon():
            th = threading.Thread(target=window)
            th.start()
            result = br.held_fraction(4, 5, seconds)
            th.join()
        with open(f"{TRACING}/trace") as f:
            text = f.read()
    finally:
        _set("tracing_on", "0")
        _set("set_event", "")
        _set("trace", "")
    return text, result, tasks


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").replace("\0", " ")
    except OSError:
        return ""


def handoffs(text: str, daemon: set[int], jobs: set[int]) -> list[dict[str, float]]:
    """Per counted handoff: µs from the release ``sendto`` to each mark."""
    ev = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m and not line.startswith("#"):
            tid, ts, name, rest = m.groups()
            if name == "sys_recvfrom" and rest.startswith("->"):
                name = "sys_exit_recvfrom"  # the exit event prints as "sys_recvfrom -> N"
            ev.append((float(ts) * 1e6, int(tid), name, rest))
    out = []
    for i, (t0, tid, name, _) in enumerate(ev):
        if tid not in jobs or name != "sys_sendto" or not _is_release(ev, i, tid):
            continue
        marks = _marks(ev, i, tid, daemon, jobs)
        if marks is not None:
            out.append({k: v - t0 for k, v in marks.items()})
    return out


def _is_release(ev: list, i: int, tid: int) -> bool:
    """A job's send after its region: ≥ 3 ms since its last grant read (a busy hold)."""
    for t, who, name, _ in reversed(ev[:i]):
        if who == tid and name == "sys_exit_recvfrom":
            return ev[i][0] - t > 3000
    return False


def _marks(ev: list, i: int, out_tid: int, daemon: set[int],
           jobs: set[int]) -> dict[str, float] | None:
    marks: dict[str, float] = {}
    nxt: int | None = None
    want = iter(MARKS)
    mark = next(want)
    for t, tid, name, rest in ev[i + 1:]:
        if t - ev[i][0] > 20000:
            return None
        hit = False
        if mark == "release_read":
            hit = tid in daemon and name == "sys_exit_recvfrom"
        elif mark == "first_file_op":
            hit = tid in daemon and name == "sys_openat"
        elif mark == "incoming_moved" and name == "cgroup_attach_task":
            pid = int(re.search(r" pid=(\d+)", rest).group(1))  # type: ignore[union-attr]
            if pid in jobs and pid != out_tid:
                nxt, hit = pid, True
        elif mark in ("reply_read", "grant_read"):
            hit = tid == nxt and name == "sys_exit_recvfrom"
        elif mark == "ask_sent":
            if tid == nxt and name == "sys_sendto":
                hit = True
            elif tid == nxt and name == "sys_exit_recvfrom":
                return None  # a second reply before its ask: not a re-queued grant
        elif mark == "ask_read":
            hit = tid in daemon and name == "sys_exit_recvfrom"
        elif mark == "grant_sent":
            hit = tid in daemon and name == "sys_sendto"
        if hit:
            marks[mark] = t
            mark = next(want, "")
            if not mark:
                return marks
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4.0, help="the held run")
    ap.add_argument("--trace-s", type=float, default=0.5, help="traced, in its middle")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("trace_handoff: needs root (tracefs)")
    text, result, tasks = record(args.seconds, args.trace_s)
    tasks.pop(os.getpid(), None)
    daemon = {t for cmd, tids in tasks.values() if "krex serve" in cmd and "krex-bench" in cmd
              for t in tids}
    jobs = {pid for pid, (cmd, _) in tasks.items() if "krex.client.connection" in cmd}
    rows = handoffs(text, daemon, jobs)
    if not rows or not daemon:
        sys.exit(f"trace_handoff: no handoff traced ({len(jobs)} jobs, daemon threads "
                 f"{len(daemon)}); is the run too short?")
    seg = {}
    prev = "release_sent"
    for mark in MARKS:
        seg[f"{prev} → {mark}"] = stats.quantiles(
            [r[mark] - r.get(prev, 0.0) for r in rows], (0.5, 0.9))
        prev = mark
    seg["release_sent → grant_read (total)"] = stats.quantiles(
        [r["grant_read"] for r in rows], (0.5, 0.9))
    path = write_results("trace_handoff", {
        "seconds": args.seconds, "trace_s": args.trace_s, "handoffs": len(rows),
        "held_fraction": result["held_fraction"], "segments_us": seg})
    print(f"{len(rows)} handoffs traced; held {100 * result['held_fraction']:.1f} %\n")
    print(md_table(["segment", "p50 µs", "p90 µs"],
                   [[k, f"{q['p50']:.0f}", f"{q['p90']:.0f}"] for k, q in seg.items()]))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
