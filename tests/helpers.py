"""Spawn, reap and wait: the only way tests start processes.

Every process a test starts must be reaped before the test ends; the
``no_leaks`` fixture in conftest.py fails a test that leaves a child running
or a process stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import psutil

PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# PIDs of long-lived helpers (daemons) that fixtures own; their descendants
# are infrastructure, not leaks.
INFRASTRUCTURE: set[int] = set()


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.01):
    """Poll ``predicate`` until it returns a truthy value; return that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s: {predicate}")
        time.sleep(interval_s)


def spawn(args: list[str], **kwargs) -> subprocess.Popen:
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    kwargs.setdefault("text", True)
    return subprocess.Popen(args, **kwargs)


def krex(*args: str, **kwargs) -> subprocess.Popen:
    """Start ``python -m krex ARGS`` (the CLI as users run it)."""
    return spawn([PY, "-m", "krex", *args], **kwargs)


def run_krex(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    return subprocess.run([PY, "-m", "krex", *args], timeout=timeout, **kwargs)


def reap(proc: subprocess.Popen | psutil.Process, timeout_s: float = 5.0) -> None:
    """Terminate (then kill) a process and wait for it; tolerate it being gone."""
    try:
        if isinstance(proc, subprocess.Popen):
            if proc.poll() is None:
                _cont(proc.pid)
                proc.terminate()
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout_s)
            for stream in (proc.stdout, proc.stderr, proc.stdin):
                if stream:
                    stream.close()
        else:
            _cont(proc.pid)
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except psutil.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
    except (ProcessLookupError, psutil.NoSuchProcess):
        pass


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def descendants(pid: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def infrastructure_pids() -> set[int]:
    pids = set()
    for pid in INFRASTRUCTURE:
        pids.add(pid)
        pids.update(p.pid for p in descendants(pid))
    return pids


def stopped(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.status() == psutil.STATUS_STOPPED:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


class Daemon:
    """A ``krex serve`` child process on a private runtime directory."""

    def __init__(self, runtime_dir: str, *extra: str,
                 preexec_fn: Callable[[], object] | None = None) -> None:
        self.runtime_dir = runtime_dir
        self.socket = os.path.join(runtime_dir, "krexd.sock")
        # tenants' code as the daemon's user (root here): this machine's Python is under
        # /root, where no tenant user may go; tests/test_tenant_users.py runs them apart
        self.extra = list(extra) if "--tenant-uids" in extra else \
            [*extra, "--tenant-uids", "daemon"]
        self.preexec_fn = preexec_fn  # in the child before it starts (resource limits)
        self.proc: subprocess.Popen | None = None

    @property
    def events_path(self) -> str:
        return os.path.join(self.runtime_dir, "events.jsonl")

    def start(self, timeout_s: float = 20.0) -> Daemon:
        """Started as the client starts one (krex.client.autostart.spawn_daemon), in the
        suite's session; --exit-with: a suite killed by a timeout leaves no daemon."""
        from krex.client.autostart import spawn_daemon
        from krex.errors import DaemonNotRunning

        env = {k: v for k, v in os.environ.items() if k != "KREX_SOCKET"}
        try:
            self.proc = spawn_daemon(
                self.runtime_dir, ["--exit-with", str(os.getpid()), *self.extra], env=env,
                log_path=os.path.join(self.runtime_dir, "log"), timeout_s=timeout_s,
                new_session=False, preexec_fn=self.preexec_fn)
        except DaemonNotRunning as exc:
            raise AssertionError(f"{exc.message}: {self.log()}") from None
        INFRASTRUCTURE.add(self.proc.pid)
        return self

    def log(self) -> str:
        try:
            with open(os.path.join(self.runtime_dir, "log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def client(self):
        from krex.client.connection import Client

        return Client(self.socket, autostart=False)

    def stop(self) -> None:
        if self.proc is None:
            return
        kids = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for k in kids:
            reap(k)
        INFRASTRUCTURE.discard(self.proc.pid)
        self.proc = None


# Reasons a region gets from unmanaged tasks on the holder's cores, or on the fake
# device's core: other engineers' processes on this shared machine, the test harness
# itself.  Real evidence, but not what a test of the enforcement mechanics judges
# (tests/test_contention.py and tests/test_devicewatch.py judge it).
CONTENTION = frozenset({"holder_preempted", "foreign_task", "device_preempted"})


class NamespacedDaemon(Daemon):
    """A root ``krex serve`` where the interpreter's directories let other users in
    (tests/reachable.py: a mount namespace of its own, the same files), as a node installs
    krex: its tenant users and the candidates of its evaluations can run Python there.
    Its environment carries ``DAEMON_SECRET``, which none of theirs may."""

    def start(self, timeout_s: float = 30.0) -> Daemon:
        import krex

        reach = [os.path.realpath(sys.executable), os.__file__, krex.__file__]
        log = open(os.path.join(self.runtime_dir, "log"), "w")
        env = {k: v for k, v in os.environ.items() if k != "KREX_SOCKET"}
        env["DAEMON_SECRET"] = "root's"
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", PY,
             os.path.join(REPO, "tests", "reachable.py"), *reach, "--", PY, "-m", "krex",
             "serve", "--runtime-dir", self.runtime_dir, "--exit-with", str(os.getpid()),
             *self.extra], stdout=log, stderr=log, env=env, cwd="/")
        log.close()
        INFRASTRUCTURE.add(self.proc.pid)
        wait_for(lambda: os.path.exists(self.socket) or self.proc.poll() is not None,
                 timeout_s=timeout_s)
        assert os.path.exists(self.socket), self.log()
        return self


def clean_but_contention(report) -> bool:
    """Clean, or not clean only because of unmanaged tasks on the holder's cores
    (``report``: a RegionReport or its dict)."""
    data = report if isinstance(report, dict) else report.to_dict()
    return (data["outcome"] == "released"
            and all(r["code"] in CONTENTION for r in data["reasons"]))


def why_not(report) -> tuple:
    """A failed assertion's message: the outcome and every reason (the whole report's
    repr is cut short by pytest before it gets to them)."""
    data = report if isinstance(report, dict) else report.to_dict()
    return data["outcome"], [(r["code"], r["message"]) for r in data["reasons"]]


def shield_owner() -> str | None:
    """The pid of another krex daemon that owns the machine's one shield
    (krex.enforce.shield.lock_path), or None when it is free.  While another engineer's
    daemon on this shared machine owns it, a daemon this suite starts gets no shield:
    its regions name unmanaged tasks and may find no cores to reserve."""
    import fcntl

    from krex.enforce.shield import lock_path

    try:
        fd = os.open(lock_path(), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None  # the daemon will say why itself
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
    finally:
        os.close(fd)  # (closing drops the lock if we took it)
    return None


def skip_if_another_daemon_owns_the_shield() -> None:
    import pytest

    owner = shield_owner()
    if owner is not None:
        pytest.skip(f"the machine's shield is owned by another krex daemon (pid {owner})")


def steal_ms() -> int:
    """The machine's steal time so far (a VM's vCPUs run by its host for others), ms: a
    timing test's evidence that an attempt lost cores it did not know of."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) * 1000 // os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0


def bare_connection(sock, reply_timeout_s: float = 5.0):
    """A :class:`krex.client.connection.Connection` over ``sock`` (one end of a
    socketpair), without the daemon's hello: tests that play the daemon's part."""
    from krex.client.connection import Connection
    from krex.protocol.framing import FrameReader

    conn = Connection.__new__(Connection)
    conn.path, conn.sock, conn.reader, conn.revoked = "", sock, FrameReader(sock), {}
    conn._ids = iter(range(1, 100))
    conn.reply_timeout_s, conn._patient = reply_timeout_s, set()
    conn._pipelined, conn._early, conn.broken = set(), {}, False
    conn.offers, conn._claims, conn._newest_region = {}, {}, 0
    return conn


def status_clocks() -> dict:
    """The daemon's locked clocks (``krex serve --lock-clocks``), from its status."""
    from krex.client.connection import Client

    with Client(autostart=False) as client:
        return client.status()["enforcement"]["clocks"]


def open_tmp(prefix: str):
    """A directory every user may enter (pytest's tmp_path is root's only), removed after:
    a generator for a fixture to ``yield from``."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix=prefix)
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
