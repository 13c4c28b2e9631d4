"""The node actor: one per Ray node, owning that node's krex runtime.

In: :class:`~krex.integrations.ray.program.Program` dicts as actor calls (a
threaded actor: many programs wait on the daemon at once, the daemon's pool
and scheduler decide who runs and who holds the device).  Out: result dicts
(:mod:`~krex.integrations.ray.outcome`), the daemon's status and region records.
If the daemon dies, the programs it was running come back ``lost`` and the next
program starts a fresh daemon.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from krex.errors import DaemonNotRunning, KrexError
from krex.integrations.ray import outcome
from krex.integrations.ray.daemon import NodeDaemon
from krex.integrations.ray.program import RESULT_ENV, Program, collect
from krex.protocol.address import runtime_dir as default_runtime_dir
from krex.workers.spec import ExecResult

OUTPUT_LIMIT = 1 << 20  # characters kept per stream (the tail)


class KrexNode:
    def __init__(self, runtime_dir: str | None = None, serve_args: list[str] | None = None,
                 idle_exit_s: float | None = None) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        rundir = (runtime_dir or default_runtime_dir()).format(node_id=self.node_id[:16])
        os.environ["KREX_RUNTIME_DIR"] = rundir
        os.environ.pop("KREX_SOCKET", None)
        self.daemon = NodeDaemon(rundir, serve_args, idle_exit_s)
        self.lock = threading.Lock()
        self.counters = {"received": 0, "finished": 0, "lost": 0, "inflight": 0}
        self.worker_jobs: dict[int, int] = {}  # worker pid -> its job id in the daemon
        # The daemon can deadlock when ``status`` arrives while a device's pool is
        # starting (core lock vs pool lock): we start each pool alone, first, and
        # never ask for status meanwhile.
        self.warm_lock = threading.Lock()
        self.warm: set[tuple[int | None, str]] = set()
        self.daemon.ensure()
        self._warm("cpu")

    # -- what the node is -------------------------------------------------------

    def info(self) -> dict[str, Any]:
        self._ensure()
        self._warm("cpu")  # a daemon restarted since (it died) has its warm pool again
        st = self._status()
        pools = st.get("pools") or {}
        return {"node_id": self.node_id, "node_ip": self.node_ip, "host": socket.gethostname(),
                "actor_pid": os.getpid(), "runtime_dir": self.daemon.runtime_dir,
                "daemon_pid": self.daemon.pid, "daemon_owned": self.daemon.owned,
                "daemon_starts": self.daemon.starts,
                "devices": [d["name"] for d in st["devices"]],
                "worker_slots": max([p["max_workers"] for p in pools.values()] or [2]),
                "counters": dict(self.counters)}

    def daemon_pid(self) -> int | None:
        return self.daemon.pid

    def status(self) -> dict[str, Any]:
        """This node and its daemon's ``status`` (devices, holders, queues, pools)."""
        try:
            info = self.info()
            return {**info, "daemon": self._status()}
        except KrexError as exc:
            return {"node_id": self.node_id, "node_ip": self.node_ip, "error": str(exc)}

    def regions(self, limit: int = 10000) -> list[dict[str, Any]]:
        """Finished regions recorded by the current daemon (with its pid in each)."""
        with self.daemon.client() as client:
            records = client.regions(limit=limit)
        return [{**r, "daemon_pid": self.daemon.pid, "node_id": self.node_id} for r in records]

    def stop(self) -> dict[str, Any]:
        return {"node_id": self.node_id, **self.daemon.stop()}

    # -- running programs -------------------------------------------------------

    def exec(self, data: dict[str, Any]) -> dict[str, Any]:
        program = Program.from_dict(data)
        received = time.time()
        self._count("received", "inflight")
        try:
            out = self._run(program)
        finally:
            self._count(inflight=-1)
        out["timings"]["node_received_wall_s"] = received
        self._count("lost" if out["status"] == outcome.LOST else "finished")
        return out

    def _run(self, program: Program) -> dict[str, Any]:
        try:
            pid = self._ensure()
            self._warm(program.device)
        except DaemonNotRunning as exc:
            return outcome.lost(program, self.node_id, "daemon", f"unreachable: {exc}")
        except KrexError as exc:
            return outcome.rejected(program, self.node_id, exc)
        target = os.path.join(self.daemon.runtime_dir, "ray-results", program.program_id)
        os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        output = _Output()
        mono0, wall0 = time.monotonic(), time.time()
        try:
            result = self._exec(program, target, output)
        except DaemonNotRunning as exc:
            return outcome.lost(program, self.node_id, "daemon",
                                f"daemon {pid} lost mid-program ({exc})", daemon_pid=pid,
                                **output.texts())
        except KrexError as exc:
            return outcome.rejected(program, self.node_id, exc)
        mono1 = time.monotonic()
        extra = {"returned": collect(target),
                 "regions": self._regions_of(result),
                 "timings": {"submitted_wall_s": program.submitted_wall_s, "started_wall_s": wall0,
                             "finished_wall_s": time.time(), "exec_s": mono1 - mono0}}
        node = {"node_id": self.node_id, "node_ip": self.node_ip, "daemon_pid": pid}
        return outcome.finished(program, node, result, output.texts(), extra)

    def _exec(self, program: Program, target: str, output: _Output) -> ExecResult:
        path = program.materialise(os.path.join(self.daemon.runtime_dir, "ray-programs"))
        env = {**os.environ, **program.env, RESULT_ENV: target}
        cwd = program.cwd if program.cwd and os.path.isdir(program.cwd) else os.path.dirname(path)
        with self.daemon.client() as client:
            return client.exec(path, program.args, device=program.device,
                               timeout_s=program.timeout_s, cwd=cwd, env=env, on_output=output)

    def _warm(self, device: str) -> None:
        """Start ``device``'s warm pool with a no-op program (once per daemon)."""
        key = (self.daemon.pid, device)
        if key in self.warm:
            return
        with self.warm_lock:
            if key in self.warm:
                return
            noop = Program(path="krex_warmup.py", source="", device=device)
            path = noop.materialise(os.path.join(self.daemon.runtime_dir, "ray-programs"))
            with self.daemon.client() as client:
                client.exec(path, [], device=device, cwd=os.path.dirname(path),
                            env=dict(os.environ), on_output=lambda stream, text: None)
            self.warm.add(key)

    def _status(self) -> dict[str, Any]:
        with self.warm_lock, self.daemon.client() as client:
            return client.status()

    def _ensure(self) -> int:
        with self.lock:
            return self.daemon.ensure()

    def _count(self, *names: str, inflight: int = 0) -> None:
        with self.lock:
            for name in names:
                self.counters[name] += 1
            self.counters["inflight"] += inflight

    def _regions_of(self, result: ExecResult) -> list[dict[str, Any]]:
        """The daemon's records of the regions the program's worker asked for while it ran.

        A worker runs one program at a time and stamps the program's run
        (``started_mono_s`` .. ``ended_mono_s``) on the node's monotonic clock, the
        clock the daemon stamps each request with on arrival: a region whose
        request arrived in that window is this program's, exactly.
        """
        if result.started_mono_s is None:
            return []  # the program never ran (e.g. it did not compile)
        try:
            with self.daemon.client() as client:
                job_id = self._worker_job(result.worker_pid)
                if job_id is None:
                    return []
                records = client.regions(job_ids=[job_id], limit=1000)
        except KrexError:
            return []
        lo = result.started_mono_s
        hi = result.ended_mono_s if result.ended_mono_s is not None else time.monotonic()
        return [r for r in records if lo <= (r.get("requested_mono_s") or -1.0) <= hi]

    def _worker_job(self, worker_pid: int) -> int | None:
        if worker_pid not in self.worker_jobs:
            for job in self._status()["jobs"]:
                if job.get("kind") == "worker" and job.get("root_pid"):
                    self.worker_jobs[job["root_pid"]] = job["job_id"]
        return self.worker_jobs.get(worker_pid)


class _Output:
    """Collects a program's stdout and stderr (the last OUTPUT_LIMIT characters of each)."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def __call__(self, stream: str, text: str) -> None:
        self.chunks.setdefault(stream, []).append(text)

    def texts(self) -> dict[str, str]:
        return {k: "".join(v)[-OUTPUT_LIMIT:] for k, v in self.chunks.items()}
