"""A private daemon (and, for fakegpu, a device server) for one block of the eval.

``EvalDaemon(workdir, serve_args, device, agents, profile)`` starts
``krex serve`` on a fresh runtime directory with one warm worker per agent,
the framework stand-in preloaded (``krex.eval.heavy``) and fakegpu's
context-creation delay — all as ``krex serve`` flags — waits until its socket
answers, and stops and reaps it (and its fakegpu server) on exit.  ``env`` is
the environment commands of the block get.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from typing import Any

from krex.client.autostart import spawn_daemon
from krex.eval.profile import Profile

# fakegpu's device is a spinning host thread: keep it off the measurement core (the
# daemon reserves the last core for region holders), as a real GPU needs no host core.
FAKEGPU_CORE = 0
THREAD_VARS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class EvalDaemon:
    def __init__(self, workdir: str, serve_args: list[str], device: str, agents: int,
                 profile: Profile) -> None:
        self.runtime_dir = tempfile.mkdtemp(prefix="rt-", dir=workdir)
        self.socket = os.path.join(self.runtime_dir, "krexd.sock")
        self.serve_args, self.device = list(serve_args), device
        self.agents, self.profile = agents, profile
        self.proc: subprocess.Popen[bytes] | None = None
        self.gpu: Any = None
        self.env: dict[str, str] = {}

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "KREX_SOCKET"}
        env.update(THREAD_VARS, KREX_EVAL_IMPORT_MS=str(self.profile.import_ms))
        if self.device.startswith("fakegpu"):
            from krex.devices.fakegpu import FakeGpu

            self.gpu = FakeGpu(core=FAKEGPU_CORE, ctx_delay_ms=int(self.profile.ctx_delay_ms))
            self.gpu.start()
            env = self.gpu.env(env)
        return env

    def _pool_flags(self) -> list[str]:
        """The eval's pool: one warm worker per agent, the framework stand-in preloaded.
        After the mode's flags, so these win."""
        return ["--workers-min", str(self.agents), "--workers-max", str(self.agents),
                "--preload", "numpy,krex.eval.heavy",
                "--fakegpu-ctx-delay-ms", str(int(self.profile.ctx_delay_ms)),
                "--fakegpu-core", str(FAKEGPU_CORE)]

    def start(self, timeout_s: float = 30.0) -> EvalDaemon:
        env = self._base_env()
        # --exit-with: a killed eval (a timeout's SIGKILL) leaves no daemon behind
        flags = [*self.serve_args, *self._pool_flags(), "--exit-with", str(os.getpid())]
        self.proc = spawn_daemon(self.runtime_dir, flags,
                                 env=env, log_path=os.path.join(self.runtime_dir, "log"),
                                 timeout_s=timeout_s, new_session=False)
        self.env = {**env, "KREX_SOCKET": self.socket}
        return self

    def device_busy_ns(self) -> int | None:
        """fakegpu: busy device nanoseconds so far (the daemon's server, else ours)."""
        from krex.devices.fakegpu import FakeGpu

        paths = [os.path.join(self.runtime_dir, "fakegpu.sock")]
        paths += [self.gpu.socket_path] if self.gpu is not None else []
        busy = [FakeGpu(p).stats()["busy_ns"] for p in paths if os.path.exists(p)]
        return sum(busy) if busy else None

    def log_tail(self) -> str:
        try:
            with open(os.path.join(self.runtime_dir, "log")) as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            kids = _descendants(self.proc.pid)
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            _reap(kids)  # whatever the daemon started and left behind (workers, servers)
            self.proc = None
        if self.gpu is not None:
            self.gpu.stop()
            self.gpu = None

    def __enter__(self) -> EvalDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _descendants(pid: int) -> list[Any]:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _reap(procs: list[Any], timeout_s: float = 3.0) -> None:
    import psutil

    alive = [p for p in procs if p.is_running()]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, left = psutil.wait_procs(alive, timeout=timeout_s)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=timeout_s)
