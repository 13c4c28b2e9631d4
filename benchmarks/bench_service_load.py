"""Load on one node: 16 agents through HTTP, 8 through MCP, 8 through the CLI (issue 14).

For ``--minutes``, every agent loops: submit a job, wait for its answer,
again.  Every ``--eval-every``-th job of an agent is an evaluation (the
evaluate gallery's reference against an honest candidate), the others execs
(a program that takes one region and prints a token of its own).  The jobs
run on ``--device`` (``cpu`` or ``fakegpu:0``) through one private daemon:

* **HTTP**: one ``krex service`` with 4 tenants (API tokens), 4 agents each.
  Each submit carries an ``Idempotency-Key``; a fifth of them is sent twice
  (a client retrying after a lost answer), and a 429 is retried with the
  same key after its ``Retry-After``.  The answer is long-polled.
* **MCP**: one ``krex mcp --transport streamable-http``, 8 sessions of the
  SDK's own client calling ``exec_program`` / ``evaluate``, for one tenant (``mcp``)
  whose quotas (its ``tokens.json`` entry) are an HTTP tenant's.  A call the
  tenant's quota refuses is counted as *refused*, not failed.
* **CLI**: ``krex exec PROG TOKEN`` and ``krex evaluate ... --json``, one fresh
  process per command.

``--keep-regions`` / ``--keep-jobs`` pass the daemon smaller bounds on what it
remembers of ended work, so that its stores fill within minutes and what its
memory does after that shows (issue 14's "RSS flat").  ``--keep-finished`` does the same for
the services' job stores (keys whose jobs the store pruned are counted ``pruned``, apart
from ``lost``).

``--trace-service PATH`` traces the HTTP service's memory alone (``krex.memtrace``:
a mark at ``--trace-mark-minute``, then, every ``--trace-every-minutes`` (5), what grew
since, by traceback and by object type, into PATH; each dump's RSS, allocators (glibc's
in use / free and kept, Python's arenas) and maps are kept in the results as
``service_dumps`` and printed as a table).

``--agents HTTP,MCP,CLI`` changes the counts (``0,24,0``: all of the load on the
MCP server, to see its memory over as many jobs as the HTTP service gets).

Reported: jobs per minute and p50/p95 latency (submit to answer) per
interface and kind; lost jobs (an answer missing, failed, or not the job's
own output) and duplicated jobs (one idempotency key, two jobs — checked
against the service's job list per tenant at the end); the resident memory
of the daemon, the HTTP service and the MCP server sampled every
``--rss-every-s`` (first, last, peak, and the slope after the first minute, in
the second and in the last minute).

Writes results/bench_service_load_<device>.json (atomically, with a format
version) and prints markdown tables.
Usage: python benchmarks/bench_service_load.py [--minutes 5] [--device cpu] [--eval-every 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import psutil
from common import md_table, private_daemon, stop_process, write_results

from krex.client.connection import Client
from krex.measure import stats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GALLERY = os.path.join(REPO, "tests", "evaluate_gallery")
HTTP_AGENTS, MCP_AGENTS, CLI_AGENTS, TENANTS = 16, 8, 8, 4
RETRY_SHARE = 0.2  # submits sent twice with the same key
QUOTA, REFUSED = "quota_exceeded", "refused: "  # a quota refusal is not a failed job
PROGRAM = ("import sys\nimport krex\nwith krex.region(label='load'):\n"
           "    total = sum(i * i for i in range(20000))\nprint(sys.argv[1])\n")


def evaluation(device: str, mark: str) -> dict[str, Any]:
    """An evaluate request on ``device``'s gallery: its reference against a candidate of
    this agent's own (source text that differs by ``mark``, so nothing is reused)."""
    folder = os.path.join(GALLERY, "cpu" if device == "cpu" else "fakegpu")
    call = "work(x, 1)" if device == "cpu" else "run(x, 1)"
    source = (f"import sys\nsys.path.insert(0, {folder!r})\n"
              f"from kernels import {call.split('(')[0]}  # noqa: E402\n\n"
              f"# candidate {mark}\ndef cand(x):\n    return {call}\n")
    return {"reference": os.path.join(folder, "kernels.py:reference"),
            "candidate": {"source": source, "function": "cand"},
            "inputs": os.path.join(folder, "inputs.py:make"), "device": device, "seeds": 2,
            "cache": "hot"}


class Log:
    """Every job's outcome, from every agent thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[dict[str, Any]] = []
        # label:tenant -> idempotency key acknowledged -> its job's created_s
        self.keys: dict[str, dict[str, float]] = {}
        self.events: dict[str, int] = {"retries_same_job": 0, "retries_other_job": 0,
                                       "throttled_429": 0}

    def add(self, interface: str, kind: str, ok: bool, latency_s: float, why: str = "",
            job: str | None = None) -> None:
        with self.lock:
            self.rows.append({"interface": interface, "kind": kind, "ok": ok,
                              "latency_s": latency_s, "why": why[:300], "job": job,
                              "ended_s": time.monotonic()})

    def count(self, event: str) -> None:
        with self.lock:
            self.events[event] += 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def krex_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "krex", *args]


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args} exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (OSError, urllib.error.URLError) as exc:
            if isinstance(exc, urllib.error.HTTPError):
                return  # it answers
            time.sleep(0.2)
    raise SystemExit(f"nothing answers at {url}")


# -- HTTP agents -------------------------------------------------------------------------


def http(base: str, method: str, path: str, body: object = None, headers: dict | None = None,
         timeout: float = 120) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), {k.lower(): v for k, v in e.headers.items()}


def jobs(device: str, eval_every: int, deadline: float) -> Iterator[tuple[str, str, dict]]:
    """An agent's jobs until ``deadline``: (kind, its own token, the request body)."""
    n = 0
    while time.monotonic() < deadline:
        n += 1
        mark = uuid.uuid4().hex
        if n % eval_every == 0:
            yield "evaluate", mark, evaluation(device, mark)
        else:
            yield "exec", mark, {"program": PROGRAM, "args": [mark], "device": device}


def http_agent(base: str, token: str, tenant: str, device: str, eval_every: int,
               deadline: float, log: Log, seed: int, label: str = "http") -> None:
    """``label``: the service's name in the log (its keys are kept as ``label:tenant``)."""
    rng = random.Random(seed)
    auth = {"Authorization": f"Bearer {token}"}
    for kind, mark, body in jobs(device, eval_every, deadline):
        key = {"Idempotency-Key": mark}
        t0 = time.monotonic()
        try:
            job = submit(base, kind, body, {**auth, **key}, log)
            with log.lock:
                log.keys.setdefault(f"{label}:{tenant}", {})[mark] = float(
                    job.get("created_s") or 0.0)
            if rng.random() < RETRY_SHARE:  # the answer was "lost": the client retries
                _, again, _ = http(base, "POST", f"/v1/jobs/{kind}", body, {**auth, **key})
                log.count("retries_same_job" if again.get("id") == job["id"]
                          else "retries_other_job")
            done = job
            while done.get("state") not in ("succeeded", "failed", "cancelled"):
                _, done, _ = http(base, "GET", f"/v1/jobs/{job['id']}?wait_s=60", headers=auth)
            ok, why = judged(kind, done.get("state") == "succeeded", done.get("result") or {},
                             mark, done.get("error"))
            log.add(label, kind, ok, time.monotonic() - t0, why, job["id"])
        except Exception as exc:  # noqa: BLE001  (an agent records its failure and goes on)
            log.add(label, kind, False, time.monotonic() - t0, f"{type(exc).__name__}: {exc}")


def submit(base: str, kind: str, body: dict, headers: dict, log: Log) -> dict:
    """POST a job; a 429 is retried with the same key after its Retry-After."""
    while True:
        status, job, h = http(base, "POST", f"/v1/jobs/{kind}", body, headers)
        if status in (200, 201):
            return job
        if status == 429:
            log.count("throttled_429")
            time.sleep(float(h.get("retry-after", "1")))
            continue
        raise RuntimeError(f"submit answered {status}: {job}")


def judged(kind: str, succeeded: bool, result: dict, mark: str,
           error: object = None) -> tuple[bool, str]:
    """Did the job do what was asked (an exec printed its own token; an evaluation
    answered a verdict)?"""
    if not succeeded:
        return False, f"not succeeded: {error or result}"
    if kind == "exec":
        out = str(result.get("stdout", ""))
        return (out.strip() == mark, "" if out.strip() == mark else f"output {out[:80]!r}")
    return (result.get("verdict") is not None, str(result.get("verdict")))


# -- MCP agents ----------------------------------------------------------------------------


def mcp_agents(url: str, token: str, device: str, eval_every: int, deadline: float,
               log: Log, mcp_count: int = MCP_AGENTS) -> None:
    import anyio
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    async def one(i: int) -> None:
        async with create_mcp_http_client(
                headers={"Authorization": f"Bearer {token}"}) as client, \
                streamable_http_client(url, http_client=client) as streams, \
                ClientSession(streams[0], streams[1]) as session:
            await session.initialize()
            for kind, mark, args in jobs(device, eval_every, deadline):
                tool = "evaluate" if kind == "evaluate" else "exec_program"
                t0 = time.monotonic()
                try:
                    res = await session.call_tool(tool, args)
                    data = _structured(res)
                    ok, why = judged(kind, not res.is_error and data.get("state") == "succeeded",
                                     data, mark, None if not res.is_error else res.content)
                    if res.is_error and QUOTA in str(res.content):
                        why = f"{REFUSED}{why}"  # the tenant's quota: counted apart
                    log.add("mcp", kind, ok, time.monotonic() - t0, why, data.get("job_id"))
                except Exception as exc:  # noqa: BLE001
                    log.add("mcp", kind, False, time.monotonic() - t0,
                            f"{type(exc).__name__}: {exc}")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(mcp_count):
                tg.start_soon(one, i)

    anyio.run(main)


def _structured(res: Any) -> dict:
    if res.structured_content is not None:
        data = res.structured_content
        return data.get("result", data) if set(data) == {"result"} else data
    try:
        return json.loads(res.content[0].text)
    except (ValueError, IndexError, AttributeError):
        return {}


# -- CLI agents ----------------------------------------------------------------------------


def cli_agent(prog: str, records: str, device: str, eval_every: int, deadline: float,
              log: Log) -> None:
    for kind, mark, e in jobs(device, eval_every, deadline):
        if kind == "exec":
            argv = krex_cmd("exec", "--device", device, prog, mark)
        else:
            cand = os.path.join(os.path.dirname(prog), f"cand_{mark}.py")
            with open(cand, "w") as f:
                f.write(e["candidate"]["source"])
            argv = krex_cmd("evaluate", "--ref", e["reference"], "--cand", f"{cand}:cand",
                            "--inputs", e["inputs"], "--device", device, "--seeds", "2",
                            "--cache", "hot", "--json", "--records", records)
        t0 = time.monotonic()
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
            if kind == "exec":
                ok, why = judged(kind, out.returncode == 0, {"stdout": out.stdout}, mark,
                                 out.stderr[-300:])
            else:
                result = json.loads(out.stdout) if out.returncode == 0 else {}
                ok, why = judged(kind, out.returncode == 0, result, mark, out.stderr[-300:])
            log.add("cli", kind, ok, time.monotonic() - t0, why)
        except Exception as exc:  # noqa: BLE001
            log.add("cli", kind, False, time.monotonic() - t0, f"{type(exc).__name__}: {exc}")


# -- memory --------------------------------------------------------------------------------


def sample_rss(pids: dict[str, int], every_s: float, stop: threading.Event,
               out: dict[str, list[tuple[float, float]]]) -> None:
    t0 = time.monotonic()
    while True:
        for name, pid in pids.items():
            try:
                rss = psutil.Process(pid).memory_info().rss / 2**20
            except psutil.Error:
                continue
            out.setdefault(name, []).append((time.monotonic() - t0, rss))
        if stop.wait(every_s):
            return


def slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, MiB) points, in MiB/min (0 for fewer than 2)."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if var == 0 else sum((t - mt) * (r - mr) for t, r in points) / var * 60


def rss_summary(series: list[tuple[float, float]]) -> dict[str, Any]:
    """First, last and peak MiB; the least-squares slope (MiB/min) after the first minute,
    over the second minute and over the last minute (growth that stops shows as a last
    slope near 0); MiB at 1 min."""
    end = series[-1][0]
    at_1min = min(series, key=lambda p: abs(p[0] - 60))[1]
    return {"first_mib": round(series[0][1], 1), "last_mib": round(series[-1][1], 1),
            "peak_mib": round(max(r for _, r in series), 1), "at_1min_mib": round(at_1min, 1),
            "slope_mib_per_min_after_1min": round(
                slope([p for p in series if p[0] >= 60] or series), 2),
            "slope_mib_per_min_minute_2": round(
                slope([p for p in series if 60 <= p[0] <= 120]), 2),
            "slope_mib_per_min_last_minute": round(
                slope([p for p in series if p[0] >= end - 60]), 2),
            "at_minutes_mib": {m: round(min(series, key=lambda p: abs(p[0] - 60 * m))[1], 1)
                               for m in (1, 3, 5, 10, 15, 20, 30, 40, 60, 90)
                               if m * 60 <= end + 30},
            "slopes_mib_per_min_thirds": thirds(series),
            "slope_mib_per_min_5min_to_end": round(
                slope([p for p in series if p[0] >= 300]), 2) if end > 360 else None,
            "samples": len(series)}


def thirds(series: list[tuple[float, float]]) -> list[dict[str, float]]:
    """Slopes (MiB/min) over minute 1 to a third of the run, to two thirds, to the end
    (1-5, 5-10, 10-15 for 15 minutes)."""
    end_min = series[-1][0] / 60
    cuts = [1.0, round(end_min / 3, 2), round(2 * end_min / 3, 2), end_min]
    return [{"from_min": a, "to_min": round(b, 2), "slope": round(slope(
        [p for p in series if 60 * a <= p[0] <= 60 * b]), 2)}
        for a, b in zip(cuts, cuts[1:], strict=False)]


# -- the run -------------------------------------------------------------------------------


def check_http_jobs(base: str, tokens: dict[str, str], log: Log,
                    label: str = "http") -> dict[str, int]:
    """Every acknowledged key has exactly one job in the service, and it ended.  The
    store prunes the oldest finished jobs past its bound (``--keep-finished``, 20 000 by
    default, over all tenants): a key missing whose job is older than every job still
    listed is counted ``pruned``; one missing and newer, ``lost``."""
    listed: dict[str, dict[str, list[dict]]] = {}
    for tenant, token in tokens.items():
        per_key = listed[tenant] = {}
        before = ""
        while True:  # every page: a long run has more jobs a tenant than one page holds
            _, listing, _ = http(base, "GET", f"/v1/jobs?limit=1000{before}",
                                 headers={"Authorization": f"Bearer {token}"})
            for job in listing.get("jobs", []):
                per_key.setdefault(str(job.get("idempotency_key")), []).append(job)
            if not listing.get("next"):
                break
            before = f"&before={listing['next']}"
    oldest = min((float(j.get("created_s") or 0.0) for per_key in listed.values()
                  for jobs in per_key.values() for j in jobs), default=0.0)
    lost = pruned = dup = unfinished = 0
    for tenant, per_key in listed.items():
        for key, created in log.keys.get(f"{label}:{tenant}", {}).items():
            jobs = per_key.get(key, [])
            if not jobs:
                if created < oldest:
                    pruned += 1
                else:
                    lost += 1
            dup += len(jobs) > 1
            unfinished += any(j["state"] not in ("succeeded", "failed", "cancelled")
                              for j in jobs)
    return {"keys_acknowledged": sum(len(v) for k, v in log.keys.items()
                                     if k.startswith(label + ":")),
            "lost": lost, "pruned": pruned, "duplicated": dup, "unfinished": unfinished}


def start(argv: list[str], log_path: str,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=f, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})


def signal_dumps(pid: int, path: str, mark_s: float, every_s: float, stop: threading.Event,
                 t0: float, dumps: list[dict[str, Any]]) -> None:
    """SIGUSR1 to a traced process (krex.memtrace) at ``mark_s`` (the mark), then every
    ``every_s``: each later dump rewrites its file with what grew since the mark, and
    what each one said of the process's allocators is appended to ``dumps`` (the file
    keeps only the newest)."""
    if stop.wait(mark_s):
        return
    seq = 0
    while True:
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            return
        seq += 1
        dump = _read_dump(path, seq)
        if dump is not None:
            dumps.append(dump_summary(dump, (time.monotonic() - t0) / 60))
        if stop.wait(every_s):
            return


def _read_dump(path: str, seq: int) -> dict[str, Any] | None:
    """The dump numbered ``seq`` once the process has written it (None after 60 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                dump: dict[str, Any] = json.load(f)
            if dump.get("seq", 0) >= seq:
                return dump
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    return None


def dump_summary(dump: dict[str, Any], minute: float) -> dict[str, Any]:
    """What one memtrace dump says in MiB: RSS, the allocators, the maps."""
    mib = 1 << 20
    alloc = dump.get("allocators", {})
    malloc, pymalloc = alloc.get("malloc", {}), alloc.get("pymalloc", {})
    return {"minute": round(minute, 1), "seq": dump.get("seq"), "mark": dump.get("mark"),
            "rss_mib": round(dump.get("rss_bytes", 0) / mib, 2),
            "traced_mib": round(dump.get("traced_bytes", 0) / mib, 2),
            "objects": dump.get("objects"), "threads": dump.get("threads"),
            "malloc": {k: round(v / mib, 2) for k, v in malloc.items()},
            "pymalloc_in_use_mib": round(pymalloc.get("in_use", 0) / mib, 2),
            "pymalloc_arenas": pymalloc.get("arenas"),
            "maps_kib": dump.get("maps", {})}


def _tokens(state: str) -> dict[str, str]:
    return {f"tenant-{i}": subprocess.run(
        krex_cmd("service", "token", "add", f"tenant-{i}", "--state-dir", state,
                 "--max-active-jobs", "64", "--max-jobs-per-minute", "6000"),
        capture_output=True, text=True, check=True).stdout.strip() for i in range(TENANTS)}


def run(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    state, mcp_state = os.path.join(tmp, "service"), os.path.join(tmp, "mcp")
    records = os.path.join(tmp, "records.sqlite3")
    tokens = _tokens(state)
    port, mport = free_port(), free_port()
    keep = ("--keep-finished", str(args.keep_finished)) if args.keep_finished else ()
    service = start(krex_cmd("service", "--http", f"127.0.0.1:{port}", "--state-dir", state,
                             "--records", records, "--runners", "16", *keep),
                    os.path.join(tmp, "service.log"),
                    {"KREX_TRACEMALLOC": args.trace_service} if args.trace_service else None)
    services = [("http", f"http://127.0.0.1:{port}", tokens, service)]
    if args.http_ab:  # the same service beside it, with one variable set: half the agents
        var, _, value = args.http_ab.partition("=")
        state_b, port_b = os.path.join(tmp, "service-b"), free_port()
        services.append(("http B", f"http://127.0.0.1:{port_b}", _tokens(state_b), start(
            krex_cmd("service", "--http", f"127.0.0.1:{port_b}", "--state-dir", state_b,
                     "--records", records, "--runners", "16", *keep),
            os.path.join(tmp, "service-b.log"), {var: value})))
    mcp_token = subprocess.run(krex_cmd(
        "service", "token", "add", "mcp", "--state-dir", mcp_state, "--max-active-jobs", "64",
        "--max-jobs-per-minute", "6000"), capture_output=True, check=True, text=True
    ).stdout.strip()  # the MCP tenant's quotas: as each HTTP one's
    mcp = start(krex_cmd("mcp", "--transport", "streamable-http", "--http",
                         f"127.0.0.1:{mport}", "--state-dir", mcp_state, "--records", records,
                         "--runners", "8", "--tenant", "mcp", *keep), os.path.join(tmp, "mcp.log"))
    prog = os.path.join(tmp, "prog.py")
    with open(prog, "w") as f:
        f.write(PROGRAM)
    try:
        for _, url, _, proc in services:
            wait_http(url + "/v1/health", proc)
        wait_http(f"http://127.0.0.1:{mport}/mcp", mcp)
        with Client(autostart=False) as c:
            daemon_pid = int(c.status()["daemon"]["pid"])
        pids = {"daemon": daemon_pid, "http service": service.pid, "mcp server": mcp.pid}
        if args.http_ab:
            pids[f"http service B ({args.http_ab})"] = services[1][3].pid
        return drive(args, [s[:3] for s in services],
                     (f"http://127.0.0.1:{mport}/mcp", mcp_token), prog, records, pids)
    finally:
        for *_, proc in services:
            stop_process(proc)
        stop_process(mcp)


def drive(args: argparse.Namespace, services: list[tuple[str, str, dict[str, str]]],
          mcp: tuple[str, str], prog: str, records: str, pids: dict[str, int]
          ) -> dict[str, Any]:
    """``services``: (label, base URL, tenant tokens) of each HTTP service; the HTTP agents
    take turns between them.  ``mcp``: the MCP server's URL and its tenant's token."""
    log = Log()
    deadline = time.monotonic() + 60 * args.minutes
    names = [f"tenant-{i}" for i in range(TENANTS)]
    n_http, n_mcp, n_cli = args.agents

    def http_one(i: int) -> None:
        label, url, tokens = services[i % len(services)]
        tenant = names[(i // len(services)) % TENANTS]
        http_agent(url, tokens[tenant], tenant, args.device, args.eval_every, deadline, log,
                   i, label)

    agents: list[Callable[[], None]] = [(lambda i=i: http_one(i)) for i in range(n_http)]
    if n_mcp:
        agents.append(lambda: mcp_agents(*mcp, args.device, args.eval_every, deadline, log,
                                         n_mcp))
    agents += [(lambda: cli_agent(prog, records, args.device, args.eval_every, deadline, log))
               for _ in range(n_cli)]
    rss: dict[str, list[tuple[float, float]]] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(pids, args.rss_every_s, stop, rss))
    sampler.start()
    dumps: list[dict[str, Any]] = []
    t0 = time.monotonic()
    if args.trace_service:
        threading.Thread(target=signal_dumps, daemon=True,
                         args=(pids["http service"], args.trace_service,
                               60 * args.trace_mark_minute, 60 * args.trace_every_minutes,
                               stop, t0, dumps)).start()
    threads = [threading.Thread(target=a, daemon=True) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    stop.set()
    sampler.join()
    return {"minutes": args.minutes, "device": args.device, "elapsed_s": round(elapsed, 1),
            "agents": dict(zip(("http", "mcp", "cli"), args.agents, strict=True)),
            "eval_every": args.eval_every, "interfaces": table(log.rows, elapsed),
            "http_jobs": check_http_jobs(services[0][1], services[0][2], log),
            **({"http_jobs_b": check_http_jobs(services[1][1], services[1][2], log, "http B")}
               if len(services) > 1 else {}),
            "events": log.events,
            "failures": [r for r in log.rows if not r["ok"]][:20],
            "rss": {name: rss_summary(s) for name, s in rss.items() if s},
            "rss_series": rss, "mcp_cli_job_ids_unique": unique_ids(log.rows),
            **({"service_dumps": dumps} if args.trace_service else {})}


def _agents(text: str) -> tuple[int, int, int]:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if len(counts) != 3 or min(counts) < 0 or not sum(counts):
        raise argparse.ArgumentTypeError(
            f"{text!r}: want three counts HTTP,MCP,CLI, none negative, not all 0")
    return counts  # type: ignore[return-value]


def unique_ids(rows: list[dict[str, Any]]) -> bool:
    ids = [r["job"] for r in rows if r["job"]]
    return len(ids) == len(set(ids))


def table(rows: list[dict[str, Any]], elapsed_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted({(r["interface"], r["kind"]) for r in rows}):
        mine = [r for r in rows if (r["interface"], r["kind"]) == key]
        lat = [r["latency_s"] for r in mine if r["ok"]]
        q = stats.quantiles(lat, (0.5, 0.95)) if lat else {"p50": float("nan"),
                                                            "p95": float("nan")}
        refused = sum(r["why"].startswith(REFUSED) for r in mine)
        out[f"{key[0]} {key[1]}"] = {"done": len(lat), "refused": refused,
                                     "failed": len(mine) - len(lat) - refused,
                                     "per_min": round(60 * len(lat) / elapsed_s, 1),
                                     "p50_s": round(q["p50"], 3), "p95_s": round(q["p95"], 3)}
    return out


def report(res: dict[str, Any]) -> None:
    print(md_table(["interface, kind", "done", "failed", "refused (quota)", "per min", "p50 s",
                    "p95 s"],
                   [[k, v["done"], v["failed"], v["refused"], v["per_min"], v["p50_s"],
                     v["p95_s"]]
                    for k, v in res["interfaces"].items()]))
    print()
    print(md_table(["process", "first MiB", "1 min MiB", "last MiB", "peak MiB",
                    "slope MiB/min (>1 min)", "minute 2", "last minute"],
                   [[k, v["first_mib"], v["at_1min_mib"], v["last_mib"], v["peak_mib"],
                     v["slope_mib_per_min_after_1min"], v["slope_mib_per_min_minute_2"],
                     v["slope_mib_per_min_last_minute"]] for k, v in res["rss"].items()]))
    for k, v in res["rss"].items():
        cuts = [(t["from_min"], t["to_min"], t["slope"]) for t in v["slopes_mib_per_min_thirds"]]
        print(f"{k}: MiB at minutes {v['at_minutes_mib']}, slopes by thirds {cuts}")
    if res.get("service_dumps"):
        print()
        print(md_table(["HTTP service dump, minute", "RSS MiB", "malloc in use", "malloc free kept",
                        "mmapped", "Python in use", "objects", "threads", "anon KiB", "heap KiB"],
                       [[d["minute"], d["rss_mib"], d["malloc"].get("in_use", ""),
                         d["malloc"].get("free", ""), d["malloc"].get("mmapped", ""),
                         d["pymalloc_in_use_mib"], d["objects"], d["threads"],
                         d["maps_kib"].get("anon_kib", ""), d["maps_kib"].get("heap_kib", "")]
                        for d in res["service_dumps"]]))
    print()
    if "http_jobs_b" in res:
        print("HTTP jobs, service B:", res["http_jobs_b"])
    print("HTTP jobs:", res["http_jobs"], "events:", res["events"],
          "MCP job ids unique:", res["mcp_cli_job_ids_unique"])
    for f in res["failures"][:5]:
        print("failure:", f["interface"], f["kind"], f["why"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="how long agents submit")
    ap.add_argument("--device", default="cpu", help="cpu or fakegpu:0 (default cpu)")
    ap.add_argument("--eval-every", type=int, default=4,
                    help="every Nth job of an agent is an evaluation (default 4)")
    ap.add_argument("--rss-every-s", type=float, default=5.0)
    ap.add_argument("--agents", type=_agents, default=(HTTP_AGENTS, MCP_AGENTS, CLI_AGENTS),
                    metavar="HTTP,MCP,CLI",
                    help=f"agents per interface (default {HTTP_AGENTS},{MCP_AGENTS},{CLI_AGENTS}; "
                         "e.g. 0,24,0 puts the whole load on the MCP server)")
    ap.add_argument("--keep-regions", type=int, help="the daemon's --keep-regions")
    ap.add_argument("--keep-jobs", type=int, help="the daemon's --keep-jobs")
    ap.add_argument("--keep-finished", type=int,
                    help="the services' --keep-finished (their job stores fill sooner; keys "
                         "whose jobs were pruned are counted apart from lost ones)")
    ap.add_argument("--trace-service", metavar="PATH",
                    help="trace the HTTP service's memory (KREX_TRACEMALLOC=PATH, krex.memtrace): "
                         "a mark at --trace-mark-minute, then what grew since, every 5 minutes")
    ap.add_argument("--trace-mark-minute", type=float, default=10.0)
    ap.add_argument("--trace-every-minutes", type=float, default=5.0,
                    help="minutes between the traced service's dumps (each kept in the results)")
    ap.add_argument("--http-ab", metavar="VAR=VALUE",
                    help="a second HTTP service beside the first, with this environment "
                         "variable (e.g. KREX_MALLOC_MMAP_THRESHOLD=0): the HTTP agents take "
                         "turns between the two; both services' RSS is sampled")
    ap.add_argument("--tenant-uids", default="daemon",
                    help="the daemon's --tenant-uids: 'daemon' (tenants' code as its user, as "
                         "where the interpreter is out of other users' reach, like /root here) "
                         "or FIRST-LAST (a uid per tenant: needs krex readable by every user)")
    ap.add_argument("--out", help="results file (default results/bench_service_load_<dev>.json)")
    args = ap.parse_args()
    daemon_flags = [f for name in ("keep_regions", "keep_jobs") if getattr(args, name)
                    for f in ("--" + name.replace("_", "-"), str(getattr(args, name)))]
    daemon_flags += ["--tenant-uids", args.tenant_uids]
    with private_daemon(*daemon_flags) as _sock, tempfile.TemporaryDirectory() as tmp:
        res = run(args, tmp)
    res["daemon_flags"] = daemon_flags
    report(res)
    name = f"bench_service_load_{args.device.replace(':', '')}"
    print("wrote", write_results(name, res, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
