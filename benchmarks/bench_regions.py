"""Region round trip and handoff latency (issue: krex core, issue 18).

* round trip: one process, uncontended ``acquire`` + ``release`` (p50/p95/p99);
* handoff: two processes contend; time from the holder sending ``release`` to
  the waiter returning from ``acquire`` (both on CLOCK_MONOTONIC); again with
  each release asking for the job's next region (``krex.regions``: pipelined);
* held fraction: JOBS processes take back-to-back HOLD_MS regions for
  SECONDS; the share of that time the device was held (sum of grant → release
  spans over first grant → last release); again with each release asking for
  the job's next region too (``krex.regions``: the job is queued again before
  the device is handed on, so a chain of handoffs never ends with the device
  waiting for a frozen job to ask).

Bare (every mechanism off: the machine floor, measured in the same run) and
enforced (the default daemon, with the shield as configured by default and
with ``KREX_SHIELD=off``, and the default daemon with ``--requeue-ms 0``: plain
loops as they were before the daemon re-queued a releasing job).  For the enforced
runs also the gap between regions and each enforcement step's p50 apply time, for grants handed over
(overlapped handoff, issue 18) and grants set up from scratch apart.
Writes results/regions.json (or --out) and prints markdown tables.
Usage: python benchmarks/bench_regions.py [--n 2000] [--jobs 4] [--hold-ms 5] [--seconds 5]
       [--out results/regions.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import md_table, private_daemon, write_results

from krex.client.connection import Client
from krex.measure.stats import quantiles


def round_trip(n: int) -> list[float]:
    from krex.client.connection import Client

    c = Client(autostart=False)
    job = c.register()["job_id"]
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        rid = c.acquire(job)["region"]
        c.release(rid)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    # Ended: a registered job lives as long as its process (this one, the driver), and
    # would be a job frozen in every later region that never asks (each chain of
    # re-queued handoffs then ends after MAX_REQUEUED_CHAIN, as it must for such a job).
    c.end_job(job, 0)
    c.close()
    return samples


# argv: regions (or 0: run for SECONDS), hold seconds, SECONDS, pipelined (0/1: each
# release asks for the job's next region too, as krex.regions does), the results file
# Each row: the client's grant and release times, the grant's step times, and for the
# per-step breakdown ("x"): when the acquire was sent, the client thread's run delay
# while it waited in acquire, and the daemon's times of the region from its report.
# Like krex.region(), a release does not wait for its reply (the report): it is read
# once here, so the job's next request leaves before the handoff freezes the job.
CONTENDER = r"""
import json, sys, time
from krex.client.connection import Client
from krex.protocol import messages as m

def run_delay():
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1])

def row(rep, sent, rd):
    host = rep.get("host") or {}
    steps = {st["name"]: st["apply_ms"] for st in host.get("steps", [])}
    return steps, {"sent": sent, "rd": rd, "rq": rep.get("requested_mono_s"),
                   "handed": bool(host.get("handed_over")),
                   "prep": bool(host.get("handover_prepared")),
                   "g": rep.get("granted_mono_s"), "rl": rep.get("released_mono_s"),
                   "en": rep.get("enforce_s"), "un": rep.get("unclaimed_s") or 0.0,
                   "rv": sum(st.get("revert_ms") or 0 for st in host.get("steps", []))}

def settle():
    while owed and c.conn.replied(owed[0][1]):
        r, rel_id, s0, d0 = owed.pop(0)
        r[2], r[3] = row(c.conn.wait_reply(rel_id).get("report") or {}, s0, d0)

n, hold_s, seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
pipelined, out = sys.argv[4] == "1", sys.argv[5]
c = Client(autostart=False)
job = c.register()["job_id"]
rows = []
owed = []  # (row, release request id, sent, run delay): reports not read yet
print(json.dumps({"ready": c.conn.welcome.get("daemon_pid")}), flush=True)
sys.stdin.readline()
stop = time.monotonic() + seconds
pending = None
go_on = n > 0 or seconds > 0
while go_on:
    sent, rd0 = time.monotonic_ns(), run_delay()
    if pending is None:
        rid = c.conn.acquire(m.Acquire(job_id=job), while_waiting=settle)["region"]
    else:
        settle()
        sent, rid = pending[0], c.conn.await_grant(pending[1])["region"]
    pending = None
    granted = time.monotonic_ns()
    rd = run_delay() - rd0
    end = time.perf_counter() + hold_s
    while time.perf_counter() < end:
        pass
    released = time.monotonic_ns()
    # Decided once: a pipelined acquire sent here is always awaited by the next turn
    # (asking "more?" again there let the clock pass the stop in between, and the job
    # left a granted region unused for the daemon's whole --max-hold-s: a 60 s stall).
    go_on = (len(rows) + 1 < n) if n else (time.monotonic() < stop)
    # As krex.region() does: the release is not waited for (the job's next request goes
    # out before the handoff freezes the job); its report is read once the next request
    # has left.
    if pipelined and go_on:
        rel, nxt = c.conn.release_again(rid)
        pending = (time.monotonic_ns(), nxt)
    else:
        rel = c.conn.send(m.Release(region=rid))
    c.conn.pipelined(rel)
    rows.append([granted, released, None, None])
    owed.append((rows[-1], rel, sent, rd))
for r, rel_id, s0, d0 in owed:
    r[2], r[3] = row(c.conn.wait_reply(rel_id).get("report") or {}, s0, d0)
with open(out, "w") as f:  # not the pipe: a frozen writer's partial write split a line
    json.dump(rows, f)
print("done", flush=True)
sys.stdin.readline()  # stay connected until the daemon's threads have been read
"""


def contend(jobs: int, n: int, hold_s: float = 0.0005, seconds: float = 0.0,
            threads: dict | None = None, pipelined: bool = False) -> list[tuple]:
    """(granted ns, released ns, which process, {step: apply ms}, x) of every region,
    in grant order (``x``: see CONTENDER).  ``threads``: filled with the daemon's
    threads' CPU time and run delay over the run (see :func:`daemon_threads`)."""
    tmp = tempfile.mkdtemp(prefix="krex-contend-")
    outs = [os.path.join(tmp, f"{i}.json") for i in range(jobs)]
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(n), str(hold_s),
                               str(seconds), "1" if pipelined else "0", out],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for out in outs]
    pids = {json.loads(p.stdout.readline())["ready"] for p in procs}
    daemon = pids.pop() if len(pids) == 1 else None
    before = daemon_threads(daemon)
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    spans = []
    for who, p in enumerate(procs):
        if p.stdout.readline().strip() != "done":
            raise RuntimeError(f"contender {who} ended without its results")
        with open(outs[who]) as f:
            rows = json.load(f)
        spans += [(g, r, who, steps, x) for g, r, steps, x in rows]
    if threads is not None:
        threads.update(thread_delta(before, daemon_threads(daemon)))
    for p in procs:
        p.stdin.write("bye\n")
        p.stdin.flush()
        p.wait()
    shutil.rmtree(tmp, ignore_errors=True)
    spans.sort(key=lambda s: s[0])
    return spans


def daemon_threads(pid: int | None) -> dict:
    """tid -> (name, CPU ns, run delay ns) of every thread of the daemon, now."""
    out: dict = {}
    if pid is None:
        return out
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/{tid}/schedstat") as f:
                cpu, delay = (int(v) for v in f.read().split()[:2])
        except OSError:
            continue
        out[tid] = (name, cpu, delay)
    return out


def thread_delta(before: dict, after: dict) -> dict:
    """Per daemon thread that ran (``name:tid``) and in total: ms of CPU and of run delay
    (time runnable but waiting for a CPU) over a run."""
    out: dict = {"total": {"cpu_ms": 0.0, "run_delay_ms": 0.0}}
    for tid, (name, cpu, delay) in after.items():
        _, cpu0, delay0 = before.get(tid, (name, 0, 0))
        if cpu == cpu0:
            continue
        row = {"cpu_ms": round((cpu - cpu0) / 1e6, 2),
               "run_delay_ms": round((delay - delay0) / 1e6, 2)}
        out[f"{name}:{tid}"] = row
        for k in row:
            out["total"][k] = round(out["total"][k] + row[k], 2)
    return out


def gap_parts(a: tuple, b: tuple) -> dict | None:
    """Where one release-to-next-grant gap went (µs), from the two contenders' clocks and
    the daemon's times in the reports (all CLOCK_MONOTONIC of this host)."""
    xa, xb = a[4], b[4]
    if None in (xa["rl"], xb["g"], xb["en"], xb["rq"]):
        return None
    rl, g = xa["rl"] * 1e9, xb["g"] * 1e9
    if xb["un"]:  # re-queued, granted before its job asked: the grant, then the ask
        g -= xb["un"] * 1e9
        return {"release_sent_to_handled": (rl - a[1]) / 1e3,
                "handled_to_requeued_grant": (g - rl) / 1e3,
                "enforce_steps": xb["en"] * 1e6,
                "requeued_grant_to_asked": xb["un"] * 1e6,
                "asked_to_next_holder_returns": (b[0] - xb["rq"] * 1e9) / 1e3,
                "outgoing_undo_revert_sum": xa["rv"] * 1e3,
                "total": (b[0] - a[1]) / 1e3}
    enter = g - xb["en"] * 1e9
    parts = {"release_sent_to_handled": (rl - a[1]) / 1e3,
             # the next holder's acquire reached the daemon this long after the release
             # was handled (<= 0: it was queued already)
             "next_asked_after_release": max(0.0, xb["rq"] * 1e9 - rl) / 1e3,
             "to_set_up_start": (enter - max(rl, xb["rq"] * 1e9)) / 1e3,
             "enforce_steps": xb["en"] * 1e6,
             "grant_to_next_holder_returns": (b[0] - g) / 1e3,
             "next_holder_run_delay_in_acquire": xb["rd"] / 1e3,
             "outgoing_undo_revert_sum": xa["rv"] * 1e3,
             "total": (b[0] - a[1]) / 1e3}
    return parts


def gap_breakdown(spans: list) -> dict:
    """p50 of each part of the gap, for handed-over and set-up grants apart, and apart
    from both the re-queued grants their job asked for after they were granted."""
    out: dict = {}
    pairs = [(a, b) for a, b in itertools.pairwise(spans) if a[2] != b[2]]

    def kind_of(b: tuple) -> str:
        return "requeued" if b[4]["un"] else "handed_over" if carried(b) else "set_up"

    for kind in ("handed_over", "requeued", "set_up"):
        rows = [p for a, b in pairs if kind_of(b) == kind and (p := gap_parts(a, b))]
        out[kind] = {"gaps": len(rows), **{
            k: round(quantiles([r[k] for r in rows])["p50"], 1) for k in (rows[0] if rows else {})}}
    return out


def handoff(n: int, pipelined: bool = False) -> list[float]:
    return handoffs(contend(2, n, pipelined=pipelined))


def handoffs(spans: list) -> list[float]:
    """µs from a release to the grant to the other process right after it."""
    return [(b[0] - a[1]) / 1e3 for a, b in itertools.pairwise(spans) if a[2] != b[2]]


def carried(span: tuple) -> bool:
    """A grant handed over (its report's ``host.handed_over``: nothing set up anew)."""
    return bool(span[4].get("handed"))


def breakdown(spans: list) -> dict:
    """Per enforcement step, p50 apply ms, for handed-over and set-up grants apart."""
    out: dict = {}
    for kind, rows in (("handed_over", [s[3] for s in spans if carried(s)]),
                       ("set_up", [s[3] for s in spans if s[3] and not carried(s)])):
        names = sorted({k for r in rows for k in r})
        out[kind] = {"regions": len(rows), **{
            k: round(quantiles([r[k] for r in rows if r.get(k) is not None])["p50"], 3)
            for k in names}}
    return out


def held_fraction(jobs: int, hold_ms: float, seconds: float, pipelined: bool = False) -> dict:
    """Back-to-back regions of ``jobs`` processes: how much of the time the device was held."""
    threads: dict = {}
    spans = contend(jobs, 0, hold_ms / 1e3, seconds, threads, pipelined)
    held = sum(s[1] - s[0] for s in spans)
    wall = spans[-1][1] - spans[0][0]
    overlaps = sum(b[0] < a[1] for a, b in itertools.pairwise(spans))
    per_job = [sum(1 for s in spans if s[2] == j) for j in range(jobs)]
    gaps = [(b[0] - a[1]) / 1e3 for a, b in itertools.pairwise(spans)]
    return {"jobs": jobs, "hold_ms": hold_ms, "seconds": round(wall / 1e9, 3),
            "regions": len(spans), "held_fraction": round(held / wall, 4),
            "regions_per_job": per_job, "overlaps": overlaps,
            "handed_over": sum(carried(s) for s in spans),
            "prepared": sum(bool(s[4].get("prep")) for s in spans),
            "gap_us": quantiles(gaps), **split_gaps(spans), "steps_p50_ms": breakdown(spans),
            "gap_parts_p50_us": gap_breakdown(spans), "daemon_threads": threads}


def split_gaps(spans: list) -> dict:
    """Release-to-next-grant gaps (µs) before handed-over grants and set-up grants."""
    pairs = list(itertools.pairwise(spans))
    return {"gap_us_handed_over": quantiles([(b[0] - a[1]) / 1e3 for a, b in pairs
                                             if carried(b)]),
            "gap_us_set_up": quantiles([(b[0] - a[1]) / 1e3 for a, b in pairs
                                        if not carried(b)])}


def enforced(args: argparse.Namespace, shield: str | None, *flags: str) -> dict:
    """The default daemon (every mechanism on); ``shield``: KREX_SHIELD for it; ``flags``:
    more of its options."""
    old = os.environ.get("KREX_SHIELD")
    if shield is not None:
        os.environ["KREX_SHIELD"] = shield
    try:
        extra = ("--nice", str(args.daemon_nice)) if args.daemon_nice is not None else ()
        extra += ("--rt-priority", str(args.daemon_rt)) if args.daemon_rt is not None else ()
        with private_daemon(*extra, *flags) as sock:
            rt = round_trip(args.n // 4)
            spans = contend(2, args.n // 4)
            ho = handoffs(spans)
            ho_split = split_gaps(spans)
            pipe = contend(2, args.n // 4, pipelined=True)  # as krex.regions(n) takes them
            held = held_fraction(args.jobs, args.hold_ms, args.seconds)
            held_p = held_fraction(args.jobs, args.hold_ms, args.seconds, pipelined=True)
            with Client(sock, autostart=False) as c:
                counters = c.status()["counters"]
    finally:
        if old is None:
            os.environ.pop("KREX_SHIELD", None)
        else:
            os.environ["KREX_SHIELD"] = old
    return {"round_trip_us": quantiles(rt), "handoff_us": quantiles(ho),
            "handoffs_measured": len(ho), "handoff_steps_p50_ms": breakdown(spans),
            "handoff_parts_p50_us": gap_breakdown(spans),
            "handoff_us_handed_over": ho_split["gap_us_handed_over"],
            "handoff_us_set_up": ho_split["gap_us_set_up"],
            "handoff_us_pipelined": quantiles(handoffs(pipe)),
            "handoffs_pipelined_handed_over":
                f"{sum(carried(s) for s in pipe[1:])}/{len(pipe) - 1}",
            "held": held, "held_pipelined": held_p, "daemon_counters": counters}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--hold-ms", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--out", default=None, help="results file (default results/regions.json)")
    ap.add_argument("--daemon-rt", type=int, default=None,
                    help="the enforced daemons' --rt-priority (default: not passed)")
    ap.add_argument("--daemon-nice", type=int, default=None,
                    help="the enforced daemons' --nice (default: theirs; a daemon without "
                         "the flag refuses it)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    # The machine floor: the bare protocol (every mechanism off) in the same run.
    with private_daemon("--freeze", "off", "--no-isolate", "--no-gate"):
        rt = round_trip(args.n)
        ho = handoff(args.n // 2)
        ho_p = handoff(args.n // 2, pipelined=True)
        held = held_fraction(args.jobs, args.hold_ms, args.seconds)
        held_p = held_fraction(args.jobs, args.hold_ms, args.seconds, pipelined=True)
    runs = {"shield default": enforced(args, None),
            "shield default, --requeue-ms 0": enforced(args, None, "--requeue-ms", "0"),
            "KREX_SHIELD=off": enforced(args, "off")}
    floor = {"round_trip_us": quantiles(rt), "handoff_us": quantiles(ho),
             "handoffs_measured": len(ho), "handoff_us_pipelined": quantiles(ho_p),
             "held": held, "held_pipelined": held_p}
    path = write_results("regions", {"n": args.n, "daemon_nice": args.daemon_nice,
                                     "daemon_rt": args.daemon_rt,
                                     "floor": floor, "enforced": runs,
                                     "loadavg_before": load_before,
                                     "loadavg_after": os.getloadavg()}, path=args.out)
    rows = [["bare (floor)", floor]] + [[f"enforced, {k}", v] for k, v in runs.items()]
    print(md_table(["daemon", "round trip p50/p95 µs", "handoff p50/p95/p99 µs",
                    "pipelined handoff p50/p95/p99 µs", "held % (jobs x hold)",
                    "gap p50/p95 µs", "handed over",
                    "pipelined: held %", "gap p50/p95 µs", "handed over"],
                   [[name, f"{r['round_trip_us']['p50']:.0f} / {r['round_trip_us']['p95']:.0f}",
                     "{p50:.0f} / {p95:.0f} / {p99:.0f}".format(**r["handoff_us"]),
                     "{p50:.0f} / {p95:.0f} / {p99:.0f}".format(**r["handoff_us_pipelined"]),
                     f"{100 * r['held']['held_fraction']:.1f} "
                     f"({r['held']['jobs']} x {r['held']['hold_ms']:g} ms)",
                     f"{r['held']['gap_us']['p50']:.0f} / {r['held']['gap_us']['p95']:.0f}",
                     _handed(r["held"]),
                     f"{100 * r['held_pipelined']['held_fraction']:.1f}",
                     "{p50:.0f} / {p95:.0f}".format(**r["held_pipelined"]["gap_us"]),
                     _handed(r["held_pipelined"])]
                    for name, r in rows]))
    for name, r in runs.items():
        print(f"\n{name}: step p50 ms (held runs): {json.dumps(r['held']['steps_p50_ms'])}")
        print(f"{name}: handoff µs handed over {_q(r['handoff_us_handed_over'])}, set up "
              f"{_q(r['handoff_us_set_up'])}; held-run gap µs handed over "
              f"{_q(r['held']['gap_us_handed_over'])}, set up {_q(r['held']['gap_us_set_up'])}")
        print(f"{name}: pipelined handoffs handed over: {r['handoffs_pipelined_handed_over']}")
        print(f"{name}: held-run grants handed over {r['held'].get('handed_over')}, of them "
              f"prepared after the previous grant {r['held'].get('prepared')}; pipelined "
              f"{r['held_pipelined'].get('handed_over')} / {r['held_pipelined'].get('prepared')}")
        print(f"{name}: handoff gap parts p50 µs: {json.dumps(r['handoff_parts_p50_us'])}")
        print(f"{name}: held-run gap parts p50 µs: {json.dumps(r['held']['gap_parts_p50_us'])}")
        c = r["daemon_counters"]
        print(f"{name}: re-queued {c.get('requeued')}, claimed {c.get('requeue_claimed')}, "
              f"lapsed {c.get('requeue_lapsed')} (the whole run)")
        print(f"{name}: daemon threads over the held run: "
              f"{json.dumps(r['held']['daemon_threads']['total'])}")
    print(f"\nload average before {load_before}, after {os.getloadavg()}; written {path}")


def _q(q: dict) -> str:
    return "p50 {p50:.0f} / p95 {p95:.0f}".format(**q)


def _handed(held: dict) -> str:
    b = held["steps_p50_ms"]
    return f"{b['handed_over']['regions']}/{held['regions']}"


if __name__ == "__main__":
    main()
