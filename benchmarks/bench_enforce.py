"""Latency of host enforcement per region: freeze + isolate, and thaw.

For each available freeze backend and 1, 4, 16 and 64 busy sibling processes
(each its own job, in its own cgroup for the cgroup backends), enters and
exits REGIONS regions around a sleeping holder and records the wall time of
``Enforcer.enter`` (freeze + isolate) and ``Enforcement.exit`` (thaw +
restore); for the cgroup backends also overlapped handoffs between two holders
(``Enforcer.hand_over``: to the next grant, then the outgoing report).  Writes
``results/enforce.json`` (format version 1, written
atomically) and prints a markdown table.

The measuring thread runs at the daemon's priority (``--rt-priority``,
``--nice``: the daemon's defaults, neither raised:
:mod:`krex.daemon.priority`), as the daemon's enforcement does (on any core:
its holders sleep); the siblings and holders it starts run at SCHED_OTHER,
nice 0.  ``--rt-priority 1`` measures the enforcer in SCHED_RR.

``--slot-moves N`` measures a handed-over grant's cgroup work in the freezing
hierarchies, side by side (interleaved, N each): as krex does it (one slot per
device: the outgoing holder moved back into its job cgroup under the frozen
device parent, the incoming one moved out into the slot) and as a second slot
per device would (the outgoing holder's slot frozen by one write, the incoming
holder moved into the other slot; the outgoing one moved back after the grant);
results in ``results/slot_moves.json``.

``--migrations N`` measures instead what one handoff's cgroup moves cost in the
kernel: moving a sleeping process between two cgroups of each v1/v2 hierarchy
(freezer, cpuset, the unified one), and rewriting its v1 cpuset's ``cpuset.cpus``
in place (no migration), N times each, after a gap of 5 ms (a move happened
recently) and of 50 ms (none did); results in ``results/migrations.json``.

``--warm-moves N`` measures what the daemon's warm pings (:mod:`krex.enforce.warm`)
do to a move after a quiet spell: N moves of a sleeping process between two cgroup2
cgroups, each after 100-120 ms without a move of its own (at a random phase of the
pings), with no pings and with a ``MoveWarmer`` pinging every 2, 4, 8 and 16 ms
(interleaved rounds); the ping's own cost too; and what a warmer in a process of its own
does to other processes' thread starts and forks; results in ``results/warm_moves.json``.

    .venv/bin/python benchmarks/bench_enforce.py [--regions 50] [--out results/enforce.json]
    .venv/bin/python benchmarks/bench_enforce.py --migrations 60
    .venv/bin/python benchmarks/bench_enforce.py --warm-moves 20
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import subprocess
import sys
import threading
import time

from krex import resultfile
from krex.daemon import priority
from krex.daemon.config import DaemonConfig
from krex.enforce.cgroups import CgroupLayout, JobCgroups, instance_name, move_all, read, write
from krex.enforce.enforcer import EnforceConfig, Enforcer
from krex.enforce.job import JobTarget
from krex.enforce.process import ProcessRef
from krex.enforce.warm import MoveWarmer
from krex.measure import stats

SIBLINGS = (1, 4, 16, 64)
BUSY = "while True: pass"
HOLDER = "import time; time.sleep(3600)"


def _spawn(code: str, cgroups: JobCgroups | None) -> subprocess.Popen:
    pre = cgroups.join_self if cgroups else None
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, preexec_fn=pre)


def _target(job_id: int, proc: subprocess.Popen, cgroups: JobCgroups | None) -> JobTarget:
    return JobTarget(job_id, root=ProcessRef.of(proc.pid), pgid=proc.pid, cgroups=cgroups)


def _summary(xs: list[float]) -> dict:
    q = stats.quantiles(xs, (0.5, 0.95))
    return {"p50_ms": round(q["p50"], 3), "p95_ms": round(q["p95"], 3)}


def run_case(layout: CgroupLayout, backend: str, n: int, regions: int) -> dict:
    # the name must end in this process's pid-starttime, or daemons' sweeps remove it
    instance = instance_name(f"bench{backend}{n}x")
    cg = (lambda i: layout.create_job(instance, i)) if backend != "signal" else (lambda i: None)
    procs: list[subprocess.Popen] = []
    try:
        holder_cg = cg(0)
        procs.append(_spawn(HOLDER, holder_cg))
        holder = _target(0, procs[0], holder_cg)
        siblings = []
        for i in range(1, n + 1):
            job_cg = cg(i)
            procs.append(_spawn(BUSY, job_cg))
            siblings.append(_target(i, procs[-1], job_cg))
        time.sleep(0.3)  # let them start and get busy
        row = _measure(layout, backend, holder, siblings, regions)
        if backend != "signal":  # a second holder, sleeping too, for the handoffs
            other_cg = cg(n + 1)
            procs.append(_spawn(HOLDER, other_cg))
            other = _target(n + 1, procs[-1], other_cg)
            row["handoff"] = _handoffs(layout, backend, [holder, other], siblings, regions)
        return row
    finally:
        for p in procs:
            p.kill()
            p.wait()
        layout.remove_instance(instance)


def _measure(layout, backend, holder, siblings, regions) -> dict:
    enforcer = Enforcer(EnforceConfig(freeze=backend), layout, None)
    enter_ms, exit_ms, clean = [], [], 0
    for _ in range(regions):
        t0 = time.perf_counter()
        region = enforcer.enter(holder, siblings, max_hold_s=10)
        t1 = time.perf_counter()
        report = region.exit()
        t2 = time.perf_counter()
        enter_ms.append((t1 - t0) * 1e3)
        exit_ms.append((t2 - t1) * 1e3)
        clean += not region.reasons
        time.sleep(0.005)  # siblings run between regions
    return {
        "backend": report.freeze_backend,
        "siblings": len(siblings),
        "regions": regions,
        "freeze_isolate": _summary(enter_ms),
        "thaw": _summary(exit_ms),
        "clean": clean,
    }


def _handoffs(layout, backend, holders, siblings, regions) -> dict | None:
    """Overlapped handoffs between two holders with ``siblings`` frozen throughout:
    the time to the next holder's grant (``Enforcer.hand_over``) and, after it, the
    outgoing region's report (``exit``); then, as the daemon does for the job queued
    next, the frozen outgoing holder's counters are read (``prefetch``)."""
    enforcer = Enforcer(EnforceConfig(freeze=backend), layout, None)
    region = enforcer.enter(holders[0], siblings + [holders[1]], max_hold_s=10)
    grant_ms, report_ms, carried = [], [], 0
    for i in range(1, regions + 1):
        time.sleep(0.005)  # the region is held
        nxt, prev = holders[i % 2], holders[(i - 1) % 2]
        t0 = time.perf_counter()
        new = enforcer.hand_over(region, nxt, siblings + [prev], max_hold_s=10)
        t1 = time.perf_counter()
        if new is None:
            region.exit()
            new = enforcer.enter(nxt, siblings + [prev], max_hold_s=10)
        else:
            carried += 1
            grant_ms.append((t1 - t0) * 1e3)
        t2 = time.perf_counter()
        region.exit()
        report_ms.append((time.perf_counter() - t2) * 1e3)
        new.prefetch(prev)  # as the daemon does after a grant for the job queued next
        region = new
    region.exit()
    if not grant_ms:
        return None
    return {"grant": _summary(grant_ms), "outgoing_report": _summary(report_ms),
            "carried": carried, "regions": regions}


def backends(layout: CgroupLayout) -> list[str]:
    out = ["signal"]
    if layout.v2_writable:
        out.insert(0, "cgroup2")
    if layout.freezer_writable:
        out.insert(1 if layout.v2_writable else 0, "cgroup1")
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| backend | siblings | freeze+isolate p50 / p95 (ms) | thaw p50 / p95 (ms) | clean "
        "| handoff to grant p50 / p95 (ms) | outgoing report p50 / p95 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fi, th, ho = r["freeze_isolate"], r["thaw"], r.get("handoff")
        hand = (f"{ho['grant']['p50_ms']:.2f} / {ho['grant']['p95_ms']:.2f} | "
                f"{ho['outgoing_report']['p50_ms']:.2f} / {ho['outgoing_report']['p95_ms']:.2f}"
                if ho else "– | –")
        lines.append(
            f"| {r['backend']} | {r['siblings']} | {fi['p50_ms']:.2f} / {fi['p95_ms']:.2f}"
            f" | {th['p50_ms']:.2f} / {th['p95_ms']:.2f} | {r['clean']}/{r['regions']} | {hand} |"
        )
    return "\n".join(lines)


def _timed_writes(paths_values: list[tuple[str, str]], gap_s: float) -> dict:
    """Each write alone after ``gap_s`` of quiet; p50/p95 µs."""
    took = []
    for path, value in paths_values:
        time.sleep(gap_s)
        t0 = time.perf_counter()
        write(path, value)
        took.append((time.perf_counter() - t0) * 1e6)
    return stats.quantiles(took)


def migrations(n: int, hierarchies: dict[str, str]) -> list[dict]:
    """A process moved between two cgroups of each hierarchy, and (v1 cpuset) its
    cgroup's ``cpuset.cpus`` rewritten in place, after short and long gaps."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER])
    rows = []
    try:
        for kind, root in hierarchies.items():
            base = f"{root}/krex-migrations-{os.getpid()}"
            dirs = [base, base + "/a", base + "/b"]
            for d in dirs:
                os.mkdir(d)
                if kind == "cpuset":
                    write(d + "/cpuset.mems", read(root + "/cpuset.mems"))
                    write(d + "/cpuset.cpus", read(root + "/cpuset.cpus"))
            try:
                for gap in (0.005, 0.05):
                    moves = [(f"{base}/{'ab'[i % 2]}/cgroup.procs", str(proc.pid))
                             for i in range(n)]
                    rows.append({"what": f"move ({kind})", "gap_ms": gap * 1e3,
                                 "us": _timed_writes(moves, gap)})
                    if kind == "cpuset":
                        cpus = [str(c) for c in sorted(os.sched_getaffinity(0))[:2]]
                        flips = [(f"{base}/a/cpuset.cpus", cpus[i % len(cpus)])
                                 for i in range(n)]  # one core, then the other
                        write(base + "/a/cgroup.procs", str(proc.pid))
                        rows.append({"what": "cpuset.cpus in place (v1)", "gap_ms": gap * 1e3,
                                     "us": _timed_writes(flips, gap)})
            finally:
                write(root + "/cgroup.procs", str(proc.pid))
                for d in reversed(dirs):
                    os.rmdir(d)
    finally:
        proc.kill()
        proc.wait()
    return rows


_FREEZE = {"v2": ("cgroup.freeze", "1", "0"), "freezer": ("freezer.state", "FROZEN", "THAWED")}


def slot_moves(n: int, hierarchies: dict[str, str]) -> list[dict]:
    """Pre-grant cgroup work of a handoff between two sleeping holders, with one slot
    (krex's :class:`~krex.enforce.slot.HolderSlot`) and with two, per freezing hierarchy;
    µs p50/p95 (see the module docstring)."""
    rows = []
    for kind in ("v2", "freezer"):
        root = hierarchies.get(kind)
        if root is None:
            continue
        control, frozen, thawed = _FREEZE[kind]
        base = f"{root}/krex-slotmoves-{os.getpid()}"
        dev, ja, jb, sa, sb = (base + "/dev", base + "/dev/a", base + "/dev/b", base + "/sa",
                               base + "/sb")
        dirs = [base, dev, ja, jb, sa, sb]
        procs = [subprocess.Popen([sys.executable, "-c", HOLDER]) for _ in range(2)]
        one, two, after = [], [], []
        try:
            for d in dirs:
                os.mkdir(d)
            write(f"{dev}/{control}", frozen)
            write(sa + "/cgroup.procs", str(procs[0].pid))  # a holds, b waits frozen
            write(jb + "/cgroup.procs", str(procs[1].pid))
            for _ in range(n):
                time.sleep(0.005)
                t0 = time.perf_counter_ns()
                move_all(sa, ja)  # one slot: a back among the frozen (HolderSlot.revert_lead)
                move_all(jb, sa, rounds=1)  # b out into the slot (HolderSlot.apply)
                one.append(time.perf_counter_ns() - t0)
                move_all(sa, jb)
                move_all(ja, sa, rounds=1)  # as before: a holds, b waits
                time.sleep(0.005)
                t0 = time.perf_counter_ns()
                write(f"{sa}/{control}", frozen)  # two slots: a's frozen where it is
                move_all(jb, sb, rounds=1)  # b into the other slot
                t1 = time.perf_counter_ns()
                move_all(sa, ja, rounds=1)  # after the grant: a among the frozen, slot thawed
                write(f"{sa}/{control}", thawed)
                two.append(t1 - t0)
                after.append(time.perf_counter_ns() - t1)
                move_all(sb, jb)
                move_all(ja, sa, rounds=1)
        finally:
            for d in (sa, dev):  # first: a task frozen in a v1 freezer cannot even die
                if os.path.exists(f"{d}/{control}"):
                    write(f"{d}/{control}", thawed)
            for d in reversed(dirs):
                if os.path.isdir(d):
                    move_all(d, root)
                    os.rmdir(d)
            for p in procs:
                p.kill()
                p.wait()
        us = [[v / 1e3 for v in xs] for xs in (one, two, after)]
        rows.append({"hierarchy": kind, "n": n, "one_slot_us": stats.quantiles(us[0]),
                     "two_slots_us": stats.quantiles(us[1]),
                     "two_slots_after_grant_us": stats.quantiles(us[2])})
    return rows


def warm_moves(n: int, layout: CgroupLayout, periods: tuple[float, ...] = (0, 2, 4, 8, 16),
               quiet_s: float = 0.1) -> list[dict]:
    """Moves after ``quiet_s`` without a move of their own, with no warm pings (period 0)
    and with pings every ``period`` ms; rounds interleaved so the machine's drift is
    shared; µs p50/p90 and the pings' cost."""
    root = layout.v2_base if layout.v2_writable else None
    if root is None:
        raise SystemExit("--warm-moves needs a writable cgroup2 hierarchy (root)")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER])
    base = f"{root}/krex-warmmoves-{os.getpid()}"
    dirs = [base, base + "/a", base + "/b"]
    took: dict[float, list[float]] = {p: [] for p in periods}
    phases = [random.Random(i).uniform(0.0, 0.02) for i in range(n)]
    pings: dict[float, dict] = {}
    try:
        for d in dirs:
            os.mkdir(d)
        for i in range(n):
            for period in periods:
                warmer = MoveWarmer.for_layout(layout, period, 60.0)
                warmer.start()
                warmer.touch()
                time.sleep(quiet_s + phases[i])  # at any phase of the pings' period
                t0 = time.perf_counter()
                write(f"{base}/{'ab'[i % 2]}/cgroup.procs", str(proc.pid))
                took[period].append((time.perf_counter() - t0) * 1e6)
                warmer.stop()
                was = pings.setdefault(period, {"pings": 0, "ping_ns": 0, "slow_pings": 0})
                was["pings"] += warmer.pings
                was["ping_ns"] += warmer.ping_ns
                was["slow_pings"] += warmer.slow_pings
    finally:
        proc.kill()
        proc.wait()
        for d in reversed(dirs):
            move_all(d, root)
            os.rmdir(d)
    return [{"period_ms": p, "quiet_ms": quiet_s * 1e3,
             "move_us": stats.quantiles(took[p], (0.5, 0.9)),
             "pings": pings[p]["pings"], "slow_pings": pings[p]["slow_pings"],
             "ping_mean_us": round(pings[p]["ping_ns"] / pings[p]["pings"] / 1e3, 1)
             if pings[p]["pings"] else None} for p in periods]


_WARMER = ("import sys\n"
           "from krex.enforce.cgroups import CgroupLayout\n"
           "from krex.enforce.warm import MoveWarmer\n"
           "w = MoveWarmer.for_layout(CgroupLayout.probe(), 4.0, 3600.0, keep_off=[1])\n"
           "w.start(); w.touch(); print('ready', flush=True); sys.stdin.read(); w.stop()\n")


def warm_side_effects(rounds: int = 10) -> list[dict]:
    """What a warm daemon does to other processes: thread start + join and fork + wait
    (µs each, p50/p90 over ``rounds`` rounds of 200 and 50), on the last core, with and
    without a warmer pinging every 4 ms in a process of its own (as the daemon's does),
    rounds interleaved."""
    def threads(n: int = 200) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            th = threading.Thread(target=lambda: None)
            th.start()
            th.join()
        return (time.perf_counter() - t0) / n * 1e6

    def forks(n: int = 50) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        return (time.perf_counter() - t0) / n * 1e6

    every = sorted(os.sched_getaffinity(0))
    took: dict[str, tuple[list[float], list[float]]] = {"none": ([], []), "4 ms": ([], [])}
    for _ in range(rounds):
        for mode, (ts, fs) in took.items():
            warmer = None
            if mode != "none":
                warmer = subprocess.Popen([sys.executable, "-c", _WARMER], text=True,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                assert warmer.stdout is not None and warmer.stdout.readline() == "ready\n"
            os.sched_setaffinity(0, every[-1:])
            try:
                ts.append(threads())
                fs.append(forks())
            finally:
                os.sched_setaffinity(0, every)
                if warmer is not None:
                    warmer.communicate("")
            time.sleep(0.05)
    return [{"pings": mode, "thread_start_join_us": stats.quantiles(ts, (0.5, 0.9)),
             "fork_wait_us": stats.quantiles(fs, (0.5, 0.9))} for mode, (ts, fs) in took.items()]


def _hierarchies() -> dict[str, str]:
    out = {}
    for kind, path in (("freezer", "/sys/fs/cgroup/freezer"), ("cpuset", "/sys/fs/cgroup/cpuset"),
                       ("v2", "/sys/fs/cgroup/unified")):
        if os.path.exists(path + "/cgroup.procs"):
            out[kind] = path
    return out


def _side_result(name: str, rows: list[dict], out: str) -> list[dict]:
    """Write ``rows`` of a measurement other than the default one (``results/NAME.json``
    unless ``--out`` says otherwise)."""
    path = f"results/{name}.json" if out == "results/enforce.json" else out
    resultfile.write(path, {"benchmark": name, "kernel": platform.release(),
                            "loadavg": os.getloadavg(), "results": rows}, format=1)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", type=int, default=50)
    parser.add_argument("--out", default="results/enforce.json")
    parser.add_argument("--siblings", default=",".join(map(str, SIBLINGS)),
                        help="sibling counts, comma-separated")
    parser.add_argument("--backends", default="", help="freeze backends (default: all usable)")
    parser.add_argument("--rt-priority", type=int, default=DaemonConfig.rt_priority,
                        help="SCHED_RR priority of the measuring thread (the daemon's default)")
    parser.add_argument("--nice", type=int, default=DaemonConfig.nice,
                        help="its nice value with --rt-priority 0 (the daemon's default)")
    parser.add_argument("--migrations", type=int, default=0,
                        help="measure N cgroup moves and cpuset.cpus writes instead")
    parser.add_argument("--warm-moves", type=int, default=0,
                        help="measure N moves after quiet with and without warm pings instead")
    parser.add_argument("--slot-moves", type=int, default=0,
                        help="measure N handoffs' cgroup moves with one and two slots instead")
    args = parser.parse_args()
    if args.slot_moves:
        rows = _side_result("slot_moves", slot_moves(args.slot_moves, _hierarchies()), args.out)
        for r in rows:
            print(f"{r['hierarchy']:8s} one slot p50 {r['one_slot_us']['p50']:6.0f} p95 "
                  f"{r['one_slot_us']['p95']:6.0f} µs; two slots p50 "
                  f"{r['two_slots_us']['p50']:6.0f} p95 {r['two_slots_us']['p95']:6.0f} µs "
                  f"(+ after the grant p50 {r['two_slots_after_grant_us']['p50']:6.0f} µs)")
        return 0
    if args.warm_moves:
        rows = _side_result("warm_moves", warm_moves(args.warm_moves, CgroupLayout.probe())
                            + warm_side_effects(), args.out)
        for r in rows:
            if "thread_start_join_us" in r:
                print(f"pings {r['pings']:>5s}: thread start + join p50 "
                      f"{r['thread_start_join_us']['p50']:6.1f} µs, fork + wait p50 "
                      f"{r['fork_wait_us']['p50']:7.1f} µs (another process's)")
                continue
            print(f"pings every {r['period_ms']:4.0f} ms (0: none): a move after "
                  f"{r['quiet_ms']:.0f} ms p50 {r['move_us']['p50']:7.0f} µs, p90 "
                  f"{r['move_us']['p90']:7.0f} µs; {r['pings']} pings, mean "
                  f"{r['ping_mean_us']} µs, {r['slow_pings']} slow")
        return 0
    if args.migrations:
        rows = _side_result("migrations", migrations(args.migrations, _hierarchies()), args.out)
        for r in rows:
            print(f"{r['what']:28s} gap {r['gap_ms']:4.0f} ms: p50 {r['us']['p50']:8.0f} µs, "
                  f"p95 {r['us']['p95']:8.0f} µs")
        return 0
    # Not kept off the reserved cores as the daemon's threads are: this thread starts the
    # holders and siblings (which would inherit that affinity) and builds the enforcers
    # (which read it); its holders sleep, so it takes no core from them.
    priority.configure(args.nice, args.rt_priority)
    elevated = priority.elevate()  # what it starts (siblings, holders) begins at nice 0
    layout = CgroupLayout.probe()
    counts = [int(x) for x in args.siblings.split(",")]
    chosen = args.backends.split(",") if args.backends else backends(layout)
    rows = [run_case(layout, b, n, args.regions) for b in chosen for n in counts]
    meta = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "root": os.geteuid() == 0,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "priority": priority.describe() if elevated else None,
        "loadavg": os.getloadavg(),
    }
    resultfile.write(args.out, {"benchmark": "enforce", "meta": meta, "results": rows}, format=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
