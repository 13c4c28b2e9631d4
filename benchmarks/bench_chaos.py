"""Chaos and load checks of the daemon (issue #12), each with a pass/fail figure.

* ``sigkill_daemon`` / ``sigkill_guardian`` / ``sigkill_both``: a region held, 8
  sibling jobs frozen; SIGKILL the daemon, its guardian, or both.  Every sibling
  runs again within 1 s (of the kill; for the guardian, of the holder's release,
  since the daemon restarts its guardian and the region goes on; for both, of a
  new daemon's start: its sweep is the only thing left that can thaw), and a
  daemon serves a new region.
* ``sigstop``: the same set-up, the daemon SIGSTOPped for 5 s: the holder's
  ``release``, a queued ``acquire`` and ``status`` callers all get
  ``daemon_unresponsive`` (client reply timeout 1 s here), none hangs; after
  SIGCONT every sibling runs again within 1 s and no process is stopped.
* ``load``: 500 concurrent clients (500 connections: 4 processes x 125 threads,
  since 2 cores cannot run 500 processes usefully) each take 20 regions,
  alternating between ``cpu`` and ``fakegpu:0``.  Zero overlaps, judged from the
  holders' own CLOCK_MONOTONIC stamps; every release answered ``released``; the
  daemon's counters agree; p50/p99 handoff (release sent -> next grant received).
  Run with ``--no-isolate``: CPU isolation re-pins every task off the holder's
  cores at each grant, which with 500 client threads on 2 cores dominates the
  handoff (bench_enforce measures it); ``load_isolated`` is the same with every
  mechanism on, 100 clients x 10 regions.
* ``malformed``: 10 000 malformed frames of 8 kinds (plus oversized and truncated
  ones that cost their connection) while a well-formed client keeps taking
  regions: every bad frame answered, every good request served.
* ``fd_exhaustion``: the daemon under ``RLIMIT_NOFILE=64`` gets 200 connections:
  accept() fails with EMFILE; a client connected before keeps being served, a new
  one gets a clean ``daemon_unresponsive`` (not a hang) while it lasts and is
  served once the hogs let go.
* ``disk_full``: the event log on a 64 KiB tmpfs (else under a file-size rlimit):
  2 000 regions after the disk is full all succeed, the log says how many events
  it lost.
* ``soak`` (``--soak-s``; a benchmark, not CI): agents taking regions, agents
  SIGKILLed mid-region, revocations (holds past ``--max-hold-s``) and operator
  revokes, for as long as asked; daemon RSS and fd count flat, nothing stopped.

Writes results/chaos.json and prints a markdown table.
Usage: python benchmarks/bench_chaos.py [--quick] [--only NAME[,NAME]] [--soak-s S]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chaos_load import check_load, judge_overlaps  # noqa: F401  (tests use them)
from chaos_rig import (
    PY,
    THAW_LIMIT_S,
    Krexd,
    frozen_siblings,
    holder_region,
    kill_tree,
    process_tree,
    serves_a_region,
    stopped_processes,
    wait_until,
)
from common import md_table, write_results

from krex.client.connection import Client
from krex.errors import DaemonNotRunning, DaemonUnresponsive, KrexError, LimitExceeded
from krex.measure.stats import quantiles
from krex.protocol import messages as m
from krex.protocol.framing import FrameReader, encode_frame

# -- the checks ---------------------------------------------------------------------------


def check_sigkill(victim: str, n: int = 8) -> dict[str, Any]:
    """SIGKILL the daemon, the guardian, or both while ``n`` siblings are frozen."""
    with frozen_siblings(n) as (d, sibs, holder, _):
        guardian = d.guardian()
        if victim == "both":  # at once: neither may notice the other's death and act
            guardian.suspend()
        killed = time.monotonic()
        if victim in ("daemon", "both"):
            d.proc.kill()  # type: ignore[union-attr]
            d.proc.wait(5)  # type: ignore[union-attr]
        if victim in ("guardian", "both"):
            guardian.kill()
        out: dict[str, Any] = {"victim": victim, "siblings": n}
        if victim == "guardian":
            restarted = wait_until(lambda: holder.status()["counters"]["guardian_restarts"] >= 1, 5)
            out["guardian_restart_s"] = round(restarted - killed, 3) if restarted else None
            origin = time.monotonic()
            out["release_outcome"] = holder.release(holder_region(holder))["report"]["outcome"]
            out["thaw_from"] = "release"
        elif victim == "both":
            guardian.wait(5)
            time.sleep(0.2)
            # The control: nothing of ours is left to thaw them.  Another daemon that
            # starts on the node meanwhile sweeps dead instances' cgroups, and thaws them.
            out["ran_with_both_dead"] = len(sibs.ran_after(killed + 0.1))
            d.stop()
            origin = time.monotonic()
            d.start()
            out["new_daemon_start_s"] = round(time.monotonic() - origin, 3)
            out["thaw_from"] = "new daemon serving"
        else:
            origin = killed
            out["thaw_from"] = "kill"
        holder.close()
        delays = sibs.delays_after(origin)
        out["thaw_max_s"] = round(max(delays), 3)
        if victim == "both":  # within 1 s of the new daemon serving (its start-up varies)
            out["thaw_after_serving_s"] = round(max(delays) - out["new_daemon_start_s"], 3)
        out["thaw_from_kill_max_s"] = round(max(delays) + origin - killed, 3)
        slack = out["new_daemon_start_s"] if victim == "both" else 0.0
        out["thawed"] = sum(x < THAW_LIMIT_S + slack for x in delays)
        if victim == "daemon":
            d.stop()
            t0 = time.monotonic()
            d.start()
            out["new_daemon_start_s"] = round(time.monotonic() - t0, 3)
        out["serves_after"] = serves_a_region(d)
        out["stopped_left"] = len(stopped_processes(sibs.pids()))
        out["passed"] = (out["thawed"] == n and out["serves_after"] and not out["stopped_left"]
                         and out.get("release_outcome", "released") == "released")
        return out


def check_sigstop(stop_s: float = 5.0, n: int = 8, reply_timeout_s: float = 1.0,
                  status_clients: int = 4) -> dict[str, Any]:
    """SIGSTOP the daemon for ``stop_s``: clients time out cleanly, nothing stays frozen."""
    with frozen_siblings(n) as (d, sibs, holder, _):
        region = holder_region(holder)
        waiter = Client(d.socket, autostart=False, reply_timeout_s=reply_timeout_s)
        wjob = waiter.register(name="waiter", device="cpu")["job_id"]
        pollers = [Client(d.socket, autostart=False, reply_timeout_s=reply_timeout_s)
                   for _ in range(status_clients)]
        results: dict[str, tuple[str, float]] = {}
        stopped_at = time.monotonic()

        def attempt(name: str, call: Callable[[], object]) -> None:
            t0 = time.monotonic()
            try:
                call()
                results[name] = ("answered", time.monotonic() - t0)
            except DaemonUnresponsive:
                results[name] = ("daemon_unresponsive", time.monotonic() - t0)
            except Exception as exc:  # noqa: BLE001  (anything else fails the check)
                results[name] = (type(exc).__name__, time.monotonic() - t0)

        os.kill(d.pid, signal.SIGSTOP)
        wait_until(lambda: all_threads_stopped(d.pid), 5)  # a group stop takes ms to land
        try:
            threads = [threading.Thread(target=attempt, args=("acquire", lambda: waiter.acquire(
                wjob, "cpu")))]
            threads += [threading.Thread(target=attempt, args=(f"status{i}", c.status))
                        for i, c in enumerate(pollers)]
            threads.append(threading.Thread(target=attempt, args=(
                "release", lambda: holder.release(region))))
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(stop_s - (time.monotonic() - stopped_at), 0.1))
            hung = [t.name for t in threads if t.is_alive()]
            time.sleep(max(stop_s - (time.monotonic() - stopped_at), 0))
        finally:
            os.kill(d.pid, signal.SIGCONT)
        resumed = time.monotonic()
        for t in threads:
            t.join(30)
        delays = sibs.delays_after(resumed)
        for c in (waiter, holder, *pollers):
            c.close()
        worst = max((s for _, s in results.values()), default=float("inf"))
        out = {"stopped_s": stop_s, "reply_timeout_s": reply_timeout_s,
               "outcomes": {k: v[0] for k, v in sorted(results.items())},
               "slowest_error_s": round(worst, 3), "hung": len(hung),
               "thaw_after_resume_max_s": round(max(delays), 3),
               "serves_after": serves_a_region(d),
               "stopped_left": len(stopped_processes(sibs.pids() + [d.pid]))}
        clean = all(v[0] == "daemon_unresponsive" for v in results.values())
        out["passed"] = (clean and not hung and worst < stop_s and out["serves_after"]
                         and max(delays) < THAW_LIMIT_S and not out["stopped_left"])
        return out


# -- bad input, resources -----------------------------------------------------------------

MALFORMED: list[Callable[[int], bytes]] = [
    lambda i: struct.pack(">I", 5) + b"{nope",  # not JSON
    lambda i: _raw(b"[1, 2, 3]"),  # not an object
    lambda i: _raw(b"\xff\xfe\x00garbage"),  # not UTF-8
    lambda i: encode_frame({"type": "no_such_message", "id": i}),
    lambda i: encode_frame({"type": "acquire", "id": i}),  # missing job_id
    lambda i: encode_frame({"type": "release", "region": "x", "id": i}),  # wrong type
    lambda i: encode_frame({"type": "release", "region": 10**9, "id": i}),  # unknown region
    lambda i: encode_frame({"id": i}),  # no type
]


def _raw(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _hello(sock: socket.socket, reader: FrameReader) -> None:
    sock.sendall(encode_frame({"type": "hello", "version": m.VERSION, "id": 0}))
    reader.read()


def well_formed_loop(sock: str, stop: threading.Event, out: dict[str, Any]) -> None:
    """A well-formed client taking regions until ``stop``; counts and latencies."""
    lat, fails = [], 0
    with Client(sock, autostart=False, reply_timeout_s=10) as c:
        job = c.register(name="good", device="cpu")["job_id"]
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                c.release(c.acquire(job, "cpu")["region"])
                lat.append(time.monotonic() - t0)
            except KrexError:
                fails += 1
            time.sleep(0.002)
    out.update(good_ops=len(lat), good_failed=fails,
               good_p99_ms=round(quantiles([x * 1e3 for x in lat], (0.99,))["p99"], 2))


def check_malformed(frames: int = 10_000) -> dict[str, Any]:
    d = Krexd().start()
    try:
        d.settled()  # a status answered: the daemon's start-up descriptors are all open
        rss0, fds0 = d.usage()  # (taken before, 5-6 of them read as a leak of 3 after)
        stop, good = threading.Event(), {}
        loop = threading.Thread(target=well_formed_loop, args=(d.socket, stop, good))
        loop.start()
        answered = sent = 0
        s = socket.socket(socket.AF_UNIX)
        s.connect(d.socket)
        reader = FrameReader(s)
        _hello(s, reader)
        for i in range(0, frames, 100):
            batch = b"".join(MALFORMED[(i + j) % len(MALFORMED)](i + j) for j in range(100))
            s.sendall(batch)
            sent += 100
            for _ in range(100):
                answered += reader.read().get("type") == "error"
        s.close()
        killers = 0
        for body in (struct.pack(">I", 1 << 30) + b"x", struct.pack(">I", 100) + b"{"):
            for _ in range(50):  # each costs its connection, never the daemon
                k = socket.socket(socket.AF_UNIX)
                k.connect(d.socket)
                k.sendall(body)
                k.close()
                killers += 1
        time.sleep(0.5)
        stop.set()
        loop.join(60)
        d.settled()
        rss1, fds1 = d.usage()
        out = {"malformed_frames": sent, "error_replies": answered,
               "connection_killers": killers, **good, "daemon_alive": d.proc.poll() is None,
               "rss_growth_mb": round((rss1 - rss0) / 2**20, 1), "fds_before": fds0,
               "fds_after": fds1}
        out["passed"] = (answered == sent and out["daemon_alive"] and good["good_ops"] > 0
                         and not good["good_failed"] and fds1 <= fds0 + 2 and d.serves())
        return out
    finally:
        d.close()


def check_fd_exhaustion(nofile: int = 64, hogs: int = 200) -> dict[str, Any]:
    d = Krexd(nofile=nofile).start()
    socks: list[socket.socket] = []
    try:
        early = Client(d.socket, autostart=False, reply_timeout_s=10)
        for _ in range(hogs):
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            try:
                s.connect(d.socket)
            except BlockingIOError:  # the backlog is full too
                s.close()
                break
            socks.append(s)
        def at_limit() -> bool:  # accept() failed, or a session had no descriptor left
            return "accept() failed" in d.log() or "shed a connection" in d.log()

        wait_until(at_limit, 10)
        exhausted = at_limit()
        try:
            early_ok: bool | str = bool(early.status()["daemon"]["pid"])
        except KrexError as exc:  # recorded: what a connected client got meanwhile
            early_ok = f"{exc.code}: {exc.message}"[:200]
        t0 = time.monotonic()
        try:
            Client(d.socket, autostart=False, reply_timeout_s=1.0).close()
            newcomer = "served"
        except DaemonUnresponsive:
            newcomer = "daemon_unresponsive"
        except LimitExceeded:  # accepted with the last descriptor, told why, closed
            newcomer = "shed"
        except DaemonNotRunning:  # accepted, then closed without a word
            newcomer = "closed"
        newcomer_s = time.monotonic() - t0
        for s in socks:
            s.close()
        socks = []
        recovered = wait_until(d.serves, 15)
        out = {"nofile": nofile, "hog_connections": hogs, "emfile_seen": exhausted,
               "connected_client_served": early_ok, "newcomer_during": newcomer,
               "newcomer_s": round(newcomer_s, 2), "serves_after_s":
               round(recovered - t0, 2) if recovered else None,
               "daemon_alive": d.proc.poll() is None}
        early.close()
        out["passed"] = bool(exhausted and early_ok is True and recovered
                             and out["daemon_alive"] and newcomer_s < 5)
        return out
    finally:
        for s in socks:
            s.close()
        d.close()


def all_threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` in state T: SIGSTOP's group stop is not synchronous, and a
    request sent before it reaches a session thread is still answered."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return bool(states) and all(st in ("T", "t") for st in states)


def _tiny_tmpfs(size_kb: int) -> str | None:
    path = tempfile.mkdtemp(prefix="krex-full-")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", path],
                          capture_output=True)
    if done.returncode:
        os.rmdir(path)
        return None
    return path


def check_disk_full(regions: int = 2000) -> dict[str, Any]:
    tiny = _tiny_tmpfs(64)
    rt = tempfile.mkdtemp(prefix="krex-chaos-")
    if tiny:
        os.symlink(os.path.join(tiny, "events.jsonl"), os.path.join(rt, "events.jsonl"))
        with open(os.path.join(tiny, "filler"), "wb") as f:  # leave ~8 KiB
            with contextlib.suppress(OSError):
                f.write(b"\0" * 56 * 1024)
        d = Krexd(runtime_dir=rt)
    else:  # no mount here: a file-size limit makes the log's writes fail (EFBIG)
        d = Krexd(runtime_dir=rt, fsize=16 * 1024)
    try:
        d.start()
        done = failed = 0
        t0 = time.monotonic()
        with Client(d.socket, autostart=False, reply_timeout_s=10) as c:
            job = c.register(name="logger", device="cpu")["job_id"]
            for _ in range(regions):
                try:
                    c.release(c.acquire(job, "cpu", label="x" * 200)["region"])
                    done += 1
                except KrexError:
                    failed += 1
        wall = time.monotonic() - t0
        time.sleep(1.0)
        warned = "write failed" in d.log()
        out = {"how": "tmpfs 64 KiB" if tiny else "RLIMIT_FSIZE 16 KiB", "regions": regions,
               "done": done, "failed": failed, "wall_s": round(wall, 1),
               "write_failure_logged": warned, "daemon_alive": d.proc.poll() is None}
        out["passed"] = done == regions and warned and out["daemon_alive"] and d.serves()
        return out
    finally:
        d.close()
        if tiny:
            subprocess.run(["umount", tiny], capture_output=True)
            with contextlib.suppress(OSError):
                os.rmdir(tiny)


# -- soak ---------------------------------------------------------------------------------

AGENT = ("import os, random, time, krex\n"
         "hold = float(os.environ.get('AGENT_HOLD_S', '0.005'))\n"
         "while True:\n"
         "    with krex.region('cpu', label='soak'):\n"
         "        time.sleep(hold * random.random() * 2)\n"
         "    time.sleep(random.random() * 0.05)\n")


def check_soak(seconds: float, agents: int = 6, sample_s: float = 10.0) -> dict[str, Any]:
    """Agents (regions in a loop), some holding past the maximum hold (revoked), crashes
    (SIGKILL of a random agent), operator revokes and warm-worker programs, mixed."""
    d = Krexd("--max-hold-s", "0.5").start()
    rng = random.Random(12)
    procs: list[subprocess.Popen[bytes]] = []
    samples: list[tuple[float, int, int]] = []
    counts = {"crashes": 0, "revokes": 0, "execs": 0, "agents_started": 0}
    env = {**os.environ, "KREX_SOCKET": d.socket}

    def agent() -> subprocess.Popen[bytes]:
        hold = "0.8" if rng.random() < 0.2 else "0.005"  # one in five is revoked
        counts["agents_started"] += 1
        return subprocess.Popen([PY, "-m", "krex", "run", "--device", "cpu", "--", PY, "-c",
                                 AGENT], env={**env, "AGENT_HOLD_S": hold},
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    prog = os.path.join(d.runtime_dir, "prog.py")
    with open(prog, "w") as f:
        f.write("print(sum(range(1000)))\n")
    try:
        procs = [agent() for _ in range(agents)]
        admin = Client(d.socket, autostart=False, reply_timeout_s=30)
        t_end = time.monotonic() + seconds
        next_sample = time.monotonic() + 20.0  # after warm-up
        while time.monotonic() < t_end:
            time.sleep(rng.uniform(0.5, 2.0))
            action = rng.random()
            if action < 0.3:
                victim = procs.pop(rng.randrange(len(procs)))
                kill_tree(victim)
                counts["crashes"] += 1
                procs.append(agent())
            elif action < 0.6:
                with contextlib.suppress(KrexError, RuntimeError):
                    admin.conn.call(m.Revoke(region=holder_region(admin), reason="soak"))
                    counts["revokes"] += 1
            else:
                with contextlib.suppress(KrexError):
                    admin.exec(prog, on_output=lambda s, t: None, timeout_s=30)
                    counts["execs"] += 1
            if time.monotonic() >= next_sample:
                samples.append((time.monotonic(), *d.usage()))
                next_sample += sample_s
        pids = [q for p in procs for q in process_tree(p)]
        st = admin.status()
        admin.close()
        stopped = stopped_processes(pids + [d.pid])
        return _soak_verdict(seconds, samples, counts, st, stopped)
    finally:
        for p in procs:
            kill_tree(p)
        d.close()


def _soak_verdict(seconds: float, samples: list[tuple[float, int, int]],
                  counts: dict[str, int], st: dict[str, Any],
                  stopped: list[int]) -> dict[str, Any]:
    """Flat: RSS over the last third within 5 % (the daemon's bounded stores of finished
    regions and jobs fill during the first minutes: growth there is not a leak), open
    fds at the end no more than at the start + 4, nothing stopped."""
    k = max(len(samples) // 6, 1)
    third = len(samples) * 2 // 3

    def med(xs: list[tuple[float, int, int]], i: int) -> int:
        vals = sorted(x[i] for x in xs)
        return vals[len(vals) // 2] if vals else 0

    rss_first, rss_mid, rss_last = (med(samples[:k], 1), med(samples[third:third + k], 1),
                                    med(samples[-k:], 1))
    fds_first = max((s[2] for s in samples[:k]), default=0)
    fds_last = max((s[2] for s in samples[-k:]), default=0)
    mb = 2**20
    out = {"seconds": seconds, **counts, "granted": st["counters"]["granted"],
           "revoked": st["counters"]["revoked"], "samples": len(samples),
           "rss_first_mb": round(rss_first / mb, 1), "rss_two_thirds_mb": round(rss_mid / mb, 1),
           "rss_last_mb": round(rss_last / mb, 1), "fds_first": fds_first,
           "fds_last": fds_last, "stopped_left": len(stopped),
           "series": [[round(t - samples[0][0], 1), r, f] for t, r, f in samples]}
    growth = round(100 * (rss_last - rss_mid) / rss_mid, 1) if rss_mid else None
    out["rss_growth_last_third_pct"] = growth
    out["passed"] = bool(samples and growth is not None and growth < 5
                         and fds_last <= fds_first + 4 and not stopped)
    return out


# -- main ---------------------------------------------------------------------------------

CHECKS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "sigkill_daemon": lambda quick: check_sigkill("daemon"),
    "sigkill_guardian": lambda quick: check_sigkill("guardian"),
    "sigkill_both": lambda quick: check_sigkill("both"),
    "sigstop": lambda quick: check_sigstop(2.0 if quick else 5.0),
    "load": lambda quick: check_load(100 if quick else 500, 10 if quick else 20),
    "load_isolated": lambda quick: check_load(100, 5 if quick else 10, isolate=True),
    "malformed": lambda quick: check_malformed(2000 if quick else 10_000),
    "fd_exhaustion": lambda quick: check_fd_exhaustion(),
    "disk_full": lambda quick: check_disk_full(500 if quick else 2000),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller load and frame counts")
    ap.add_argument("--only", help="comma-separated checks: " + ", ".join([*CHECKS, "soak"]))
    ap.add_argument("--soak-s", type=float, default=0.0, help="run the soak this long")
    ap.add_argument("--out", help="results file (default results/chaos.json)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CHECKS)
    results: dict[str, Any] = {}
    for name in names:
        if name == "soak":
            continue
        print(f"== {name}", flush=True)
        try:
            results[name] = CHECKS[name](args.quick)
        except Exception as exc:  # noqa: BLE001  (a check that crashes fails; others run)
            results[name] = {"passed": False, "crashed": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(results[name]), flush=True)
    if args.soak_s > 0:
        print(f"== soak ({args.soak_s:.0f} s)", flush=True)
        results["soak"] = check_soak(args.soak_s)
    path = write_results("chaos", {"quick": args.quick, "checks": results}, args.out)
    rows = [[name, "pass" if r.get("passed") else "FAIL", _figure(name, r)]
            for name, r in results.items()]
    print(md_table(["check", "result", "figure"], rows))
    print(f"written: {path}")
    return 0 if all(r.get("passed") for r in results.values()) else 1


def _figure(name: str, r: dict[str, Any]) -> str:
    if "crashed" in r:
        return r["crashed"]
    if name == "sigkill_both":
        return (f"{r['thawed']}/{r['siblings']} siblings ran within 1 s of the new daemon "
                f"serving (it served {r['new_daemon_start_s']} s after its start; they ran "
                f"{r['thaw_max_s']} s after its start, {r['thaw_from_kill_max_s']} s after the "
                f"kill; "
                f"{r['ran_with_both_dead']} ran before); new region served: "
                f"{r['serves_after']}")
    if name.startswith("sigkill"):
        return (f"{r['thawed']}/{r['siblings']} siblings ran within 1 s of the "
                f"{r['thaw_from']} (max {r['thaw_max_s']} s); new region served: "
                f"{r['serves_after']}")
    if name == "sigstop":
        return (f"{len(r['outcomes'])} calls → daemon_unresponsive in ≤ {r['slowest_error_s']} s "
                f"(timeout {r['reply_timeout_s']} s); thawed {r['thaw_after_resume_max_s']} s "
                f"after SIGCONT; stopped left: {r['stopped_left']}")
    if name.startswith("load"):
        return (f"{r['regions_done']} regions, {r['overlaps']} overlaps, {r['errors']} errors, "
                f"handoff p50 {r['handoff_p50_ms']} ms / p99 {r['handoff_p99_ms']} ms")
    if name == "malformed":
        return (f"{r['error_replies']}/{r['malformed_frames']} answered; good client "
                f"{r['good_ops']} ops, {r['good_failed']} failed (p99 {r['good_p99_ms']} ms)")
    if name == "fd_exhaustion":
        return (f"EMFILE: {r['emfile_seen']}; connected client served: "
                f"{r['connected_client_served']}; newcomer: {r['newcomer_during']} "
                f"({r['newcomer_s']} s); serves {r['serves_after_s']} s after")
    if name == "disk_full":
        return f"{r['done']}/{r['regions']} regions on a full disk ({r['how']})"
    if name == "soak":
        return (f"{r['seconds']:.0f} s: RSS {r['rss_first_mb']} → {r['rss_two_thirds_mb']} → "
                f"{r['rss_last_mb']} MB, "
                f"fds {r['fds_first']} → {r['fds_last']}, {r['crashes']} crashes, "
                f"{r['revoked']} revoked, stopped left {r['stopped_left']}")
    return ""


if __name__ == "__main__":
    sys.exit(main())
