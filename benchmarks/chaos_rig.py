"""The chaos checks' rig: a restartable daemon, sibling jobs that stamp the time,
and leftovers thawed (benchmarks/bench_chaos.py)."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import stop_process

from krex.client.autostart import spawn_daemon
from krex.client.connection import Client
from krex.errors import DaemonNotRunning, KrexError
from krex.protocol.address import SOCKET_NAME

PY = sys.executable
THAW_LIMIT_S = 1.0
STAMP = ("import sys, time\n"
         "f = open(sys.argv[1], 'a', buffering=1)\n"
         "while True:\n"
         "    f.write('%.6f\\n' % time.monotonic())\n"
         "    time.sleep(0.005)\n")


# -- a daemon and its siblings ------------------------------------------------------------


class Krexd:
    """``krex serve`` on a private runtime directory, restartable on the same one."""

    def __init__(self, *args: str, runtime_dir: str | None = None,
                 nofile: int | None = None, fsize: int | None = None) -> None:
        self.runtime_dir = runtime_dir or tempfile.mkdtemp(prefix="krex-chaos-")
        os.chmod(self.runtime_dir, 0o700)
        self.args = list(args)
        self.nofile, self.fsize = nofile, fsize
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> str:
        return os.path.join(self.runtime_dir, SOCKET_NAME)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 30.0) -> Krexd:
        env = {k: v for k, v in os.environ.items() if k not in ("KREX_SOCKET", "LD_PRELOAD")}
        try:
            self.proc = spawn_daemon(self.runtime_dir, self.args, env=env, timeout_s=timeout_s,
                                     new_session=False, preexec_fn=self._limits)
        except DaemonNotRunning as exc:
            raise RuntimeError(f"daemon did not start: {self.log()[-2000:]}") from exc
        return self

    def _limits(self) -> None:
        if self.nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))
        if self.fsize:
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.fsize, self.fsize))

    def serves(self, timeout_s: float = 2.0) -> bool:
        try:
            with Client(self.socket, autostart=False, reply_timeout_s=timeout_s) as c:
                return bool(c.status()["daemon"]["pid"])
        except (KrexError, OSError):
            return False

    def log(self) -> str:
        try:
            with open(os.path.join(self.runtime_dir, "daemon.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def guardian(self) -> psutil.Process:
        for p in psutil.Process(self.pid).children():
            if "krex.enforce.guardian" in " ".join(p.cmdline()):
                return p
        raise RuntimeError("the daemon has no guardian")

    def settled(self, timeout_s: float = 3.0) -> None:
        """Wait until no enforcement is kept for a job's next region (krex.daemon.keep:
        undone within its time): what it holds open is not a leak."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with Client(self.socket, autostart=False, reply_timeout_s=2.0) as c:
                    if not c.status()["daemon"]["keep"]["kept"]:
                        return
            except (KrexError, OSError, KeyError):
                return
            time.sleep(0.02)

    def usage(self) -> tuple[int, int]:
        """(RSS bytes, open file descriptors) of the daemon process."""
        p = psutil.Process(self.pid)
        return p.memory_info().rss, p.num_fds()

    def stop(self) -> None:
        if self.proc is None:
            return
        kids: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            kids = psutil.Process(self.pid).children(recursive=True)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            stop_process(self.proc, 20)
        for k in kids:
            _reap(k)
        self.proc = None

    def close(self) -> None:
        """Stop it for good and remove its runtime directory (every check reads the log
        before it ends and returns what it found)."""
        self.stop()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def _reap(p: psutil.Process) -> None:
    with contextlib.suppress(psutil.Error):
        p.resume()
        p.terminate()
        try:
            p.wait(5)
        except psutil.TimeoutExpired:
            p.kill()
            p.wait(5)


def thaw_leftovers(pid: int) -> None:
    """Best effort, for a failed check only: thaw ``pid``'s cgroups and SIGCONT it, so
    a check that fails never leaves a process frozen."""
    with contextlib.suppress(OSError):
        for line in open(f"/proc/{pid}/cgroup").read().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                _write(f"/sys/fs/cgroup/unified{path}/cgroup.freeze", "0")
                _write(f"/sys/fs/cgroup{path}/cgroup.freeze", "0")
            elif "freezer" in controllers.split(","):
                _write(f"/sys/fs/cgroup/freezer{path}/freezer.state", "THAWED")
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGCONT)


def _write(path: str, text: str) -> None:
    with contextlib.suppress(OSError), open(path, "w") as f:
        f.write(text)


class Siblings:
    """``n`` jobs (``krex run``) that each stamp CLOCK_MONOTONIC into a file every 5 ms."""

    def __init__(self, sock: str, directory: str, n: int, device: str = "cpu") -> None:
        self.sock, self.n, self.device = sock, n, device
        self.paths = [os.path.join(directory, f"sibling{i}.stamps") for i in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, timeout_s: float = 60.0) -> Siblings:
        env = {**os.environ, "KREX_SOCKET": self.sock}
        for i, path in enumerate(self.paths):
            self.procs.append(subprocess.Popen(
                [PY, "-m", "krex", "run", "--device", self.device, "--name", f"sibling{i}",
                 "--", PY, "-c", STAMP, path],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=env))
        deadline = time.monotonic() + timeout_s
        while not all(self.stamps(i) for i in range(self.n)):
            if time.monotonic() > deadline:
                raise RuntimeError("siblings did not start stamping")
            time.sleep(0.05)
        return self

    def stamps(self, i: int) -> list[float]:
        try:
            with open(self.paths[i]) as f:
                return [float(x) for x in f.read().split()[:-1]]  # the last may be partial
        except (OSError, ValueError):
            return []

    def ran_after(self, t: float) -> list[int]:
        return [i for i in range(self.n) if any(s > t for s in self.stamps(i)[-50:])]

    def delays_after(self, t: float, timeout_s: float = 10.0) -> list[float]:
        """For each sibling, how long after ``t`` it first ran (inf: not within timeout)."""
        deadline = time.monotonic() + timeout_s
        while len(self.ran_after(t)) < self.n and time.monotonic() < deadline:
            time.sleep(0.02)
        out = []
        for i in range(self.n):
            later = [s for s in self.stamps(i) if s > t]
            out.append(later[0] - t if later else float("inf"))
        return out

    def pids(self) -> list[int]:
        pids = []
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                pids += [p.pid] + [k.pid for k in psutil.Process(p.pid).children(recursive=True)]
        return pids

    def stop(self) -> None:
        for pid in self.pids():
            thaw_leftovers(pid)
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                for k in psutil.Process(p.pid).children(recursive=True):
                    _reap(k)
            if p.poll() is None:
                stop_process(p, 10)
        self.procs = []


def stopped_processes(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                out.append(pid)
    return out


@contextlib.contextmanager
def frozen_siblings(n: int, *args: str) -> Iterator[tuple[Krexd, Siblings, Client, float]]:
    """A daemon, ``n`` siblings, and a holder whose region froze them (checked)."""
    d = Krexd(*args).start()
    sibs = Siblings(d.socket, d.runtime_dir, n)
    try:
        sibs.start()
        holder = Client(d.socket, autostart=False, reply_timeout_s=1.0)
        job = holder.register(name="holder", device="cpu")["job_id"]
        holder.acquire(job, "cpu")
        time.sleep(0.3)  # the freeze is in place once acquire returns; margin for stamps
        frozen_at = time.monotonic()
        time.sleep(0.3)
        ran = sibs.ran_after(frozen_at)
        if ran:
            raise RuntimeError(f"siblings {ran} ran while the region was held")
        yield d, sibs, holder, frozen_at
        holder.close()
    finally:
        sibs.stop()
        d.close()


def serves_a_region(d: Krexd) -> bool:
    try:
        with Client(d.socket, autostart=False, reply_timeout_s=5.0) as c:
            job = c.register(name="after", device="cpu")["job_id"]
            grant = c.acquire(job, "cpu", timeout_s=10)
            return c.release(grant["region"])["report"]["outcome"] == "released"
    except KrexError:
        return False


def holder_region(c: Client) -> int:
    for dev in c.status()["scheduler"].values():
        if dev["holder"]:
            return int(dev["holder"]["region"])
    raise RuntimeError("no region held")


def wait_until(pred: Callable[[], object], timeout_s: float) -> float | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(KrexError):
            if pred():
                return time.monotonic()
        time.sleep(0.01)
    return None


def process_tree(p: subprocess.Popen[bytes]) -> list[int]:
    with contextlib.suppress(psutil.Error):
        return [p.pid] + [k.pid for k in psutil.Process(p.pid).children(recursive=True)]
    return []


def kill_tree(p: subprocess.Popen[bytes]) -> None:
    for pid in reversed(process_tree(p)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(10)

