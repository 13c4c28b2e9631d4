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
- ``ask_sent``: it sends its ``acquire``.  When it took the daemon's offer (docs/
  protocol.md, "Offers") that is a ``claim`` and its region starts here: it reads
  nothing more until its release;
- else ``ask_read`` / ``grant_sent``: the daemon reads it and answers, and
  ``grant_read``: the job has its grant (its region starts).

Only handoffs to a re-queued region with every mark in order are counted, each flow
(offered, asked) apart.  Prints the median of each segment; writes
results/trace_handoff.json.  Tracing adds a few µs to every marked step.

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
MARKS = ("release_read", "first_file_op", "incoming_moved", "reply_read", "ask_sent")
ASKED = ("ask_read", "grant_sent", "grant_read")  # after an ask that did not take an offer
BUSY_US = 3000  # a job that reads or sends nothing for this long holds its region
LINE = re.compile(r"\s*.+?-(\d+)\s+\[\d+\]\s+\S+\s+([\d.]+):\s+(\w+):?\s*(.*)")


def _tracefs() -> bool:
    """Mount tracefs where it is not; True when mounted here (unmounted at the end)."""
    if os.path.exists(f"{TRACING}/trace"):
        return False
    subprocess.run(["mount", "-t", "tracefs", "nodev", TRACING], check=True)
    return True


def _set(name: str, value: str) -> None:
    with open(f"{TRACING}/{name}", "w") as f:
        f.write(value)


def record(seconds: float, trace_s: float) -> tuple[str, dict, dict[int, tuple[str, set[int]]]]:
    """(the trace's text, held_fraction's result, pid -> (its command line, thread ids))
    of the processes alive when the trace stopped)."""
    mounted = _tracefs()
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
        if mounted:
            subprocess.run(["umount", TRACING], check=False)
    return text, result, tasks


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").replace("\0", " ")
    except OSError:
        return ""


def handoffs(text: str, daemon: set[int], jobs: set[int]) -> list[dict[str, float]]:
    """Per counted handoff: µs from the release ``sendto`` to each mark, and to
    ``region_start`` (``ask_sent`` for an offered one, ``grant_read`` else); ``offered``:
    1.0 when the next job's ask was a claim of its offer."""
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
            out.append({k: v if k == "offered" else v - t0 for k, v in marks.items()})
    return out


def _is_release(ev: list, i: int, tid: int) -> bool:
    """A job's send after its region: ≥ 3 ms since its last grant read (a busy hold)."""
    for t, who, name, _ in reversed(ev[:i]):
        if who == tid and name == "sys_exit_recvfrom":
            return ev[i][0] - t > BUSY_US
    return False


def _marks(ev: list, i: int, out_tid: int, daemon: set[int],
           jobs: set[int]) -> dict[str, float] | None:
    marks: dict[str, float] = {}
    nxt: int | None = None
    want = iter(MARKS + ASKED)
    mark = next(want)
    for t, tid, name, rest in ev[i + 1:]:
        if t - ev[i][0] > 20000:
            return None
        if mark in ASKED and tid == nxt and t - marks["ask_sent"] > BUSY_US:
            # its next call comes after a region held since its ask: a claim of an offer
            return _started({k: marks[k] for k in MARKS}, "ask_sent", offered=True)
        hit = False
        if mark == "release_read":
            hit = tid in daemon and name == "sys_exit_recvfrom"
        elif mark == "first_file_op":
            hit = tid in daemon and name == "sys_openat"
        elif mark == "incoming_moved" and name == "cgroup_attach_task":
            pid = int(re.search(r" pid=(\d+)", rest).group(1))  # type: ignore[union-attr]
            if pid in jobs and pid != out_tid:
                nxt, hit = pid, True
        elif mark == "reply_read":
            hit = tid == nxt and name == "sys_exit_recvfrom"
        elif mark == "ask_sent" and tid == nxt and name == "sys_sendto":
            if t - marks["reply_read"] > BUSY_US:
                return None  # its grant was the reply read, this is its release: not re-queued
            hit = True  # (reads in between: its offer)
        elif mark in ("ask_read", "grant_read") and tid == nxt and name == "sys_exit_recvfrom":
            if mark == "ask_read":
                return None  # the job read before the daemon answered: not traced whole
            hit = True
        elif mark == "ask_read":
            hit = tid in daemon and name == "sys_exit_recvfrom"
        elif mark == "grant_sent":
            hit = tid in daemon and name == "sys_sendto"
        if hit:
            marks[mark] = t
            mark = next(want, "")
            if not mark:
                return _started(marks, "grant_read", offered=False)
    return None


def _started(marks: dict[str, float], start: str, offered: bool) -> dict[str, float]:
    return {**marks, "region_start": marks[start], "offered": float(offered)}


def _segments(rows: list[dict[str, float]], marks: tuple[str, ...]) -> dict:
    seg = {}
    prev = "release_sent"
    for mark in marks:
        seg[f"{prev} → {mark}"] = stats.quantiles([r[mark] - r.get(prev, 0.0) for r in rows],
                                                  (0.5, 0.9))
        prev = mark
    seg["release_sent → region start (total)"] = stats.quantiles(
        [r["region_start"] for r in rows], (0.5, 0.9))
    return seg


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
    flows = {"offered (claim)": ([r for r in rows if r["offered"]], MARKS),
             "asked (acquire, grant)": ([r for r in rows if not r["offered"]], MARKS + ASKED)}
    segments = {name: {"handoffs": len(flow), "segments_us": _segments(flow, marks)}
                for name, (flow, marks) in flows.items() if flow}
    path = write_results("trace_handoff", {
        "seconds": args.seconds, "trace_s": args.trace_s, "handoffs": len(rows),
        "held_fraction": result["held_fraction"], "flows": segments})
    print(f"{len(rows)} handoffs traced; held {100 * result['held_fraction']:.1f} %")
    for name, flow in segments.items():
        print(f"\n{name}: {flow['handoffs']} handoffs\n")
        print(md_table(["segment", "p50 µs", "p90 µs"],
                       [[k, f"{q['p50']:.0f}", f"{q['p90']:.0f}"]
                        for k, q in flow["segments_us"].items()]))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
