"""What a ``krex mcp`` process keeps per tool call: calls driven, memory read inside it.

Starts a private daemon and ``krex mcp --transport streamable-http`` with
``KREX_TRACEMALLOC`` set (``krex.service.memtrace``), then drives MCP tool
calls through the SDK's own client over ``--sessions`` concurrent sessions:
``--warmup`` calls, a *mark* (SIGUSR1), then ``--phases`` phases of
``--calls`` calls each, a dump after each.  Each dump says what grew since the
mark by traceback and by object type; the growth between the first and the
last phase, divided by the calls between them, is what the server keeps per
call once its bounded stores are full (``--fill`` first shrinks nothing: the
stores fill during the warm-up when ``--warmup`` is large enough).

``--churn N`` closes each session after N calls and opens a new one (agents
that come and go), to tell per-session state from per-call state.
``--tools`` picks the mix (``exec_program``, ``node_status``, ``evaluate``).
``--daemon`` traces the private daemon too (``KREX_DAEMON_TRACEMALLOC``) and dumps
it at the same points: what the daemon keeps per call.

Writes the dumps and the per-call growth to ``--out`` (JSON) and prints the
top growing tracebacks and types of the last phase.
Usage: python benchmarks/bench_service_memory.py [--sessions 4] [--calls 400] [--phases 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_service_load import evaluation, free_port, krex_cmd, wait_http
from common import private_daemon, stop_process, write_results

PROGRAM = "import sys\nprint('m', sys.argv[1])\n"


def call_args(tool: str, i: int, device: str) -> dict[str, Any]:
    if tool == "exec_program":
        return {"program": PROGRAM, "args": [str(i)], "device": device}
    if tool == "evaluate":
        return evaluation(device, f"m{i}")
    return {}


async def drive(url: str, sessions: int, calls: int, tools: list[str], device: str,
                churn: int, counter: list[int], token: str) -> None:
    """``calls`` calls in all, over ``sessions`` concurrent sessions (``token``: the
    tenant's, which ``krex mcp`` over HTTP asks for)."""
    import anyio
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    per = [calls // sessions + (i < calls % sessions) for i in range(sessions)]

    async def one(n: int) -> None:
        while n > 0:
            batch = min(n, churn) if churn else n
            async with create_mcp_http_client(
                    headers={"Authorization": f"Bearer {token}"}) as client, \
                    streamable_http_client(url, http_client=client) as streams, \
                    ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                for _ in range(batch):
                    counter[0] += 1
                    tool = tools[counter[0] % len(tools)]
                    res = await session.call_tool(tool, call_args(tool, counter[0], device))
                    if res.is_error:
                        counter[1] += 1
            n -= batch

    async with anyio.create_task_group() as tg:
        for n in per:
            tg.start_soon(one, n)


def dump(proc: Any, path: str, seq: int, timeout_s: float = 120) -> dict:
    """Signal the server and wait for its dump number ``seq``."""
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                out = json.load(f)
            if out["seq"] >= seq:
                return out
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no dump {seq} from the server in {timeout_s} s")


def _server(proc: subprocess.Popen[bytes]) -> Any:
    """The ``krex mcp`` process under a wrapper (``--wrap``, e.g. heaptrack)."""
    import psutil

    for p in psutil.Process(proc.pid).children(recursive=True):
        if "mcp" in p.cmdline():
            return p
    raise RuntimeError("no krex mcp process under the wrapper")


def _daemon() -> Any:
    """The private daemon this process started (``krex serve``)."""
    import psutil

    for p in psutil.Process().children(recursive=True):
        if "serve" in p.cmdline():
            return p
    raise RuntimeError("no krex serve process under this benchmark")


def _per_call(first: dict[str, Any], last: dict[str, Any], n: int) -> dict[str, float]:
    return {"bytes_per_call": round((last["size_diff"] - first["size_diff"]) / n, 1),
            "objects_per_call": round((last["objects_diff"] - first["objects_diff"]) / n, 3),
            "rss_kib_per_call": round((last["rss_bytes"] - first["rss_bytes"]) / 1024 / n, 3)}


def run(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    import anyio

    trace = os.path.join(tmp, "trace.json")
    port = free_port()
    env = {**os.environ, "KREX_TRACEMALLOC": trace, **dict(e.split("=", 1) for e in args.env)}
    state = os.path.join(tmp, "mcp")
    token = subprocess.run(krex_cmd("service", "token", "add", "mcp", "--state-dir", state,
                                    "--max-active-jobs", "256", "--max-jobs-per-minute",
                                    "100000"), capture_output=True, check=True, text=True
                           ).stdout.strip()  # the tenant's quotas: no refusals
    argv = krex_cmd("mcp", "--tenant", "mcp", "--transport", "streamable-http", "--http",
                    f"127.0.0.1:{port}", "--state-dir", state, "--records",
                    os.path.join(tmp, "records.sqlite3"), "--runners", "4")
    with open(os.path.join(tmp, "mcp.log"), "ab") as log:
        proc = subprocess.Popen([*args.wrap.split(), *argv], stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}/mcp"
    counter = [0, 0]
    daemon_trace = os.environ.get("KREX_DAEMON_TRACEMALLOC", "")
    daemon_dumps: list[dict[str, Any]] = []
    try:
        wait_http(url, proc)
        server = _server(proc) if args.wrap else proc
        daemon = _daemon() if daemon_trace else None
        anyio.run(drive, url, args.sessions, args.warmup, args.tools, args.device, args.churn,
                  counter, token)
        dumps = [dump(server, trace, 1)]
        if daemon is not None:
            daemon_dumps.append(dump(daemon, daemon_trace, 1))
        for phase in range(args.phases):
            t0 = time.monotonic()
            anyio.run(drive, url, args.sessions, args.calls, args.tools, args.device,
                      args.churn, counter, token)
            out = dump(server, trace, phase + 2)
            out["calls_s"] = round(time.monotonic() - t0, 1)
            dumps.append(out)
            if daemon is not None:
                d = dump(daemon, daemon_trace, phase + 2)
                daemon_dumps.append(d)
                print(f"  daemon: traced +{d['size_diff'] / 1024:.1f} KiB since the mark, "
                      f"objects {d['objects_diff']:+d}, rss {d['rss_bytes'] / 2**20:.1f} MiB, "
                      f"threads {d['threads']}", flush=True)
            print(f"phase {phase + 1}: {counter[0]} calls ({counter[1]} errors), traced "
                  f"+{out['size_diff'] / 1024:.1f} KiB since the mark, objects "
                  f"{out['objects_diff']:+d}, rss {out['rss_bytes'] / 2**20:.1f} MiB "
                  f"(after trim {out.get('rss_after_trim_bytes', 0) / 2**20:.1f}), "
                  f"threads {out['threads']}, maps {out['maps']}",
                  flush=True)
    finally:
        if args.wrap and proc.poll() is None:
            with contextlib.suppress(Exception):
                _server(proc).terminate()  # the wrapper writes its data once it ends
        stop_process(proc, 120)
    n = args.calls * (args.phases - 1) or 1
    res = {"sessions": args.sessions, "calls_per_phase": args.calls, "warmup": args.warmup,
           "tools": args.tools, "churn": args.churn, "env": args.env, "errors": counter[1],
           **_per_call(dumps[1], dumps[-1], n), "dumps": dumps}
    if daemon_dumps:
        res["daemon"] = {**_per_call(daemon_dumps[1], daemon_dumps[-1], n),
                         "dumps": daemon_dumps}
    return res


def report(res: dict[str, Any], who: str = "server") -> None:
    print(f"{who}, per call between phase 1 and phase {len(res['dumps']) - 1}: traced "
          f"{res['bytes_per_call']} B, objects {res['objects_per_call']}, RSS "
          f"{res['rss_kib_per_call']} KiB")
    last = res["dumps"][-1]
    for s in last["top"][:12]:
        print(f"{s['size_diff']:>9} B {s['count_diff']:>6}  " + " <- ".join(
            t.split("site-packages/")[-1] for t in s["traceback"][-4:][::-1]))
    print({k: v for k, v in list(last["types"].items())[:20]})
    if "daemon" in res:
        report(res["daemon"], "daemon")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--calls", type=int, default=400, help="calls per phase")
    ap.add_argument("--phases", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--churn", type=int, default=0, help="calls per session (0: one each)")
    ap.add_argument("--tools", type=lambda s: s.split(","), default=["exec_program",
                                                                      "node_status"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="for the server (e.g. KREX_TRACEMALLOC_FRAMES=20)")
    ap.add_argument("--wrap", default="", help="a command the server runs under (heaptrack)")
    ap.add_argument("--daemon", action="store_true",
                    help="trace the private daemon too (KREX_DAEMON_TRACEMALLOC)")
    ap.add_argument("--tenant-uids", default="daemon",
                    help="the daemon's --tenant-uids: 'daemon' (tenants' code as its user, as "
                         "where the interpreter is out of other users' reach, like /root here) "
                         "or FIRST-LAST (a uid per tenant: needs krex readable by every user)")
    ap.add_argument("--out", help="results file (default results/bench_service_memory.json)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.daemon:
            os.environ["KREX_DAEMON_TRACEMALLOC"] = os.path.join(tmp, "daemon-trace.json")
        with private_daemon("--tenant-uids", args.tenant_uids) as _sock:
            res = run(args, tmp)
    report(res)
    print("wrote", write_results("bench_service_memory", res, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
