"""``krex cluster up|status|down|resources`` and the ``--cluster`` path of run/exec.

Each node actor answers for its node; nothing here talks to a daemon directly.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from krex.cli.output import JSON_OUTPUT, console, error, print_json, table
from krex.errors import BadRequest


def add_cluster(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="krex on a Ray cluster: up, status, down, resources")
    csub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    csub.required = True
    up = csub.add_parser("up", help="start a krex node actor (and daemon) on every krex node")
    _address(up)
    up.add_argument("--runtime-dir", help="each node's runtime directory ({node_id} allowed)")
    up.add_argument("--serve-arg", action="append", default=[],
                    help="extra `krex serve` flag for each node's daemon (repeatable)")
    up.set_defaults(func=cmd_up)
    st = csub.add_parser("status", help="per node: devices, holders, queues, warm workers",
                         parents=[JSON_OUTPUT])
    _address(st)
    st.set_defaults(func=cmd_status)
    down = csub.add_parser("down", help="stop every krex node actor and the daemons they started")
    _address(down)
    down.set_defaults(func=cmd_down)
    res = csub.add_parser("resources", help="print this node's Ray --resources JSON")
    res.add_argument("--slots", type=int, default=2, help="warm workers per device (default 2)")
    res.set_defaults(func=cmd_resources)


CONNECT_TIMEOUT_S = 30.0  # ray.init takes 2.6-3.9 s on the development machine


def _address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"),
                   help="Ray cluster address (default $RAY_ADDRESS or auto)")
    p.add_argument("--connect-timeout-s", type=float, default=CONNECT_TIMEOUT_S,
                   help="give up joining the cluster after this long (default 30)")


def _connect(args: argparse.Namespace) -> None:
    from krex.integrations.ray import nodes

    nodes.connect(args.address, timeout_s=args.connect_timeout_s)


def cmd_up(args: argparse.Namespace) -> int:
    from krex.integrations.ray import nodes

    _connect(args)
    infos = nodes.start(args.address, runtime_dir=args.runtime_dir,
                        serve_args=args.serve_arg or None, detached=True)
    table("krex nodes", ["node", "ip", "daemon pid", "devices", "runtime dir"],
          [[i["node_id"][:12], i["node_ip"], i["daemon_pid"], " ".join(i["devices"]),
            i["runtime_dir"]] for i in infos])
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from krex.integrations.ray import submission

    _connect(args)
    for r in submission.shutdown(all_nodes=True, address=args.address):
        console.print(f"node {r['node_id'][:12]}: daemon "
                      f"{'stopped' if r.get('stopped') else 'left running (not ours)'}")
    return 0


def cmd_resources(args: argparse.Namespace) -> int:
    from krex.devices import discover
    from krex.integrations.ray.resources import resources_json

    print(resources_json([d.name for d in discover()], args.slots))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from krex.integrations.ray import submission

    _connect(args)
    nodes = submission.status(args.address)
    if args.json:
        print_json(nodes)
        return 0
    table("krex nodes", ["node", "ip", "daemon pid", "programs", "lost", "inflight"],
          [_node_row(n) for n in nodes])
    table("devices", ["node", "device", "holder", "queued", "warm workers", "busy"],
          [row for n in nodes for row in _device_rows(n)])
    return 0


def _node_row(n: dict[str, Any]) -> list[Any]:
    if "error" in n:
        return [n["node_id"][:12], n.get("node_ip"), "-", "-", "-", n["error"]]
    c = n["counters"]
    return [n["node_id"][:12], n["node_ip"], n["daemon_pid"], c["finished"], c["lost"],
            c["inflight"]]


def _device_rows(n: dict[str, Any]) -> list[list[Any]]:
    daemon = n.get("daemon") or {}
    rows = []
    for name in n.get("devices", []):
        sched = daemon.get("scheduler", {}).get(name, {})
        holder = sched.get("holder")
        pool = daemon.get("pools", {}).get(name, {})
        workers = pool.get("workers", [])
        rows.append([n["node_id"][:12], name,
                     f"job {holder['job_id']} region {holder['region']}" if holder else "-",
                     len(sched.get("queue", [])), len(workers),
                     sum(bool(w.get("busy")) for w in workers)])
    return rows


# -- krex run --cluster / krex exec --cluster ---------------------------------------


def exec_on_cluster(address: str, program: str, args: list[str], *, device: str | None = None,
                    timeout_s: float | None = None, retries: int = 0,
                    json_out: bool = False) -> int:
    """Run a Python program on the cluster's least loaded krex node; its exit code."""
    from krex.integrations.ray import nodes, submission

    ray = nodes.connect(address, timeout_s=CONNECT_TIMEOUT_S)
    ref = submission.submit(program, args, device=device or "cpu", timeout_s=timeout_s,
                            retries=retries, cwd=os.getcwd())
    return _report(ray.get(ref), json_out)


def run_on_cluster(address: str, argv: list[str], *, device: str | None = None,
                   timeout_s: float | None = None, json_out: bool = False) -> int:
    """``krex run --cluster A -- python PROG.py ARGS`` (Python programs only: warm workers)."""
    cmd = argv[1:] if argv and argv[0] == "--" else list(argv)
    if len(cmd) >= 2 and os.path.basename(cmd[0]).startswith("python") and cmd[1].endswith(".py"):
        return exec_on_cluster(address, cmd[1], cmd[2:], device=device, timeout_s=timeout_s,
                               json_out=json_out)
    if cmd and cmd[0].endswith(".py"):
        return exec_on_cluster(address, cmd[0], cmd[1:], device=device, timeout_s=timeout_s,
                               json_out=json_out)
    raise BadRequest(f"cannot run {shlex.join(cmd) or 'nothing'} on a cluster",
                     hint="on a cluster krex runs Python programs: krex run --cluster A -- "
                          "python prog.py ARGS")


def _report(result: dict[str, Any], json_out: bool) -> int:
    sys.stdout.write(result.get("stdout", ""))
    sys.stderr.write(result.get("stderr", ""))
    if json_out:
        print_json(result)
    node = (result.get("node_id") or "?")[:12]
    if result["status"] == "lost":
        error(f"outcome unknown: {result['exception']} (node {node})",
              "the program may or may not have run; rerun it or pass retries")
        return 1
    if result["status"] in ("unschedulable", "rejected"):
        error(f"{result['exception']} (node {node})", result.get("hint"))
        return 1
    if result["status"] != "ok" and not (result.get("exception") or "").startswith("SystemExit"):
        error(f"program ended {result['status']} on node {node}: "
              f"{result.get('exception') or result.get('exit_code')}")
    return int(result.get("exit_code") or 0)
