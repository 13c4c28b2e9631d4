"""``krex serve``, ``krex stop``, ``krex status``, ``krex doctor``."""

from __future__ import annotations

import argparse
import time
from typing import Any

import psutil

from krex.cli.output import console, ms, print_json, table
from krex.client.connection import Client
from krex.errors import DaemonNotRunning


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the node daemon in the foreground")
    p.add_argument("--runtime-dir", help="directory for the socket and logs")
    p.add_argument("--max-hold-s", type=float, default=60.0,
                   help="ceiling on any region's hold: a region held longer is revoked; "
                        "clients may ask for less, never more (default 60)")
    p.add_argument("--freeze", choices=["auto", "cgroup2", "cgroup1", "signal", "off"],
                   default="auto", help="freeze backend for siblings (default: best available)")
    p.add_argument("--freeze-scope", choices=["device", "node"], default="device",
                   help="freeze siblings on the same device (default) or the whole node")
    p.add_argument("--no-isolate", action="store_true", help="do not reserve CPU cores")
    p.add_argument("--measure-cores", help="cores reserved for region holders, e.g. 1 or 2-3")
    p.add_argument("--no-gate", action="store_true", help="do not gate/drain GPU work")
    p.add_argument("--drain-timeout-s", type=float, default=5.0,
                   help="how long a grant waits for siblings' queued GPU work to finish "
                        "(default 5)")
    p.add_argument("--drain-policy", choices=["abort", "wait", "kill"], default="abort",
                   help="a sibling that does not drain in time: abort the grant with "
                        "drain_timeout (default), wait up to the region's maximum hold, or "
                        "SIGKILL the processes that did not acknowledge")
    p.add_argument("--gpu-lock", choices=["interposer", "checkpoint"], default="interposer",
                   help="how siblings' GPU work is stopped: the LD_PRELOAD gate and drain "
                        "(default) or the driver's cuCheckpointProcessLock (R570+; not yet "
                        "measured on a GPU)")
    p.add_argument("--group-access", action="store_true",
                   help="let the socket's group connect (owner-only by default)")
    p.add_argument("--no-cgroups", action="store_true",
                   help="give jobs no cgroups (freeze falls back to SIGSTOP, isolation to "
                        "affinity)")
    p.add_argument("--workers-min", type=int, default=1, help="warm workers kept per device")
    p.add_argument("--workers-max", type=int, default=2, help="warm workers at most per device")
    p.add_argument("--max-programs", type=int, default=100,
                   help="programs a worker serves before it is recycled")
    p.add_argument("--preload", default="numpy",
                   help="comma-separated modules each worker imports at start (default numpy)")
    p.add_argument("--worker-memory-cap-mb", type=float,
                   help="device memory cap per warm worker (fakegpu: its driver; cuda: torch's "
                        "allocator when torch is preloaded)")
    p.add_argument("--fakegpu-core", type=int,
                   help="core the fakegpu server runs kernels on (default: the first core not "
                        "reserved for region holders)")
    p.add_argument("--fakegpu-ctx-delay-ms", type=int, default=0,
                   help="fakegpu context-creation delay (serialised node-wide)")
    p.add_argument("--idle-exit-s", type=float, help="exit after this long with nothing to do")
    p.add_argument("--embedded", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_serve)


def parse_cores(text: str | None) -> list[int] | None:
    if not text:
        return None
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def cmd_serve(args: argparse.Namespace) -> int:
    from krex.daemon.config import DaemonConfig
    from krex.daemon.server import serve
    from krex.protocol.address import runtime_dir

    config = DaemonConfig(
        runtime_dir=args.runtime_dir or runtime_dir(), max_hold_s=args.max_hold_s,
        idle_exit_s=args.idle_exit_s, group_access=args.group_access, freeze=args.freeze,
        freeze_scope=args.freeze_scope, isolate=not args.no_isolate,
        measure_cores=parse_cores(args.measure_cores), gate=not args.no_gate,
        drain_timeout_s=args.drain_timeout_s, drain_policy=args.drain_policy,
        gpu_lock=args.gpu_lock,
        embedded=args.embedded, cgroups=not args.no_cgroups, workers_min=args.workers_min,
        workers_max=args.workers_max, max_programs=args.max_programs,
        preload=[m for m in args.preload.split(",") if m], fakegpu_core=args.fakegpu_core,
        fakegpu_ctx_delay_ms=args.fakegpu_ctx_delay_ms,
        worker_memory_cap_mb=args.worker_memory_cap_mb,
    )
    return serve(config)


def add_stop(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stop", help="stop the node daemon cleanly")
    p.set_defaults(func=cmd_stop)


def cmd_stop(args: argparse.Namespace) -> int:
    try:
        client = Client(autostart=False, check_installation=False)
    except DaemonNotRunning:
        console.print("krex: no daemon running")
        return 0
    pid = client.conn.welcome.get("daemon_pid")
    client.stop()
    client.close()
    deadline = time.monotonic() + 15
    while pid and _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    console.print(f"krex: daemon {pid} stopped")
    return 0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="daemon, devices, holders, queues and jobs")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    with Client(autostart=False, check_installation=False) as client:
        st = client.status()
        st["daemon"]["mismatch"] = client.conn.mismatch
    if args.json:
        print_json(st)
        return 0
    d = st["daemon"]
    console.print(f"daemon pid {d['pid']}  krex {d.get('krex_version', '?')} "
                  f"({d.get('krex_path', 'unknown path')})  socket {d['socket']}  "
                  f"up {d['uptime_s']:.0f} s")
    if d["mismatch"]:
        console.print(f"note: {d['mismatch']}: this krex will not use it "
                      "(hint: `krex stop`, then rerun)")
    rows = []
    for dev in st["devices"]:
        sched = st["scheduler"].get(dev["name"], {})
        holder = sched.get("holder")
        rows.append([dev["name"], dev["description"],
                     f"job {holder['job_id']} region {holder['region']}" if holder else "-",
                     len(sched.get("queue", []))])
    table("devices", ["device", "description", "holder", "queued"], rows)
    table("jobs", ["job", "name", "device", "mode", "kind", "pid"],
          [[j["job_id"], j["name"], j["device"], j["mode"], j["kind"],
            j["root_pid"] or j["owner_pid"]] for j in st["jobs"]])
    _print_extra(st)
    return 0


def _print_extra(st: dict[str, Any]) -> None:
    c = st["counters"]
    console.print(f"regions: {c['granted']} granted, {c['released']} released, "
                  f"{c['revoked']} revoked, {c['cancelled']} cancelled")
    pools = st.get("pools") or {}
    if pools:
        table("warm workers", ["device", "workers", "busy", "served", "queued", "recycles"],
              [[name, len(p["workers"]), sum(w["busy"] for w in p["workers"]), p["served"],
                p["queue_length"], ", ".join(f"{k} {v}" for k, v in p["recycles"].items())]
               for name, p in pools.items()])


def add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="what this machine supports, and how to get the best")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from krex.cli.doctor import diagnose

    report = diagnose()
    if args.json:
        print_json(report)
        return 0
    table("krex doctor", ["check", "status", "detail", "advice"],
          [[c["check"], "ok" if c["ok"] else "missing", c["detail"], c.get("advice", "")]
           for c in report["checks"]])
    return 0


__all__ = ["ms"]
