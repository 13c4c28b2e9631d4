"""The krex daemon of one node, as seen by that node's actor.

In: a runtime directory (one daemon per directory) and extra ``krex serve``
flags.  Out: a connected :class:`~krex.client.connection.Client`, the daemon's
pid, and a clean stop of a daemon this node actor started itself.  A daemon
that was already running is attached to and never stopped from here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from krex.client.autostart import daemon_reachable
from krex.client.connection import Client
from krex.errors import DaemonNotRunning
from krex.protocol.address import SOCKET_NAME, ensure_private_dir

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_S = 5.0


class NodeDaemon:
    """Start or attach to the daemon on ``runtime_dir``; restart it if it was lost."""

    def __init__(self, runtime_dir: str, serve_args: list[str] | None = None,
                 idle_exit_s: float | None = None) -> None:
        self.runtime_dir = ensure_private_dir(runtime_dir)
        self.socket = os.path.join(runtime_dir, SOCKET_NAME)
        self.serve_args = list(serve_args or [])
        self.idle_exit_s = idle_exit_s
        self.proc: subprocess.Popen | None = None  # set while we own the daemon
        self.pid: int | None = None
        self.starts = 0

    @property
    def owned(self) -> bool:
        return self.proc is not None

    def ensure(self) -> int:
        """Make sure a daemon answers; start one if none does.  Returns its pid."""
        self._reap()
        if not daemon_reachable(self.socket):
            self._start()
            self.pid = None
        if self.pid is None:
            with self.client() as client:
                self.pid = int(client.conn.welcome["daemon_pid"])
        return self.pid

    def client(self) -> Client:
        return Client(self.socket, autostart=False)

    def _start(self) -> None:
        cmd = [sys.executable, "-m", "krex", "serve", "--runtime-dir", self.runtime_dir,
               *self.serve_args]
        if self.idle_exit_s:
            cmd += ["--embedded", "--idle-exit-s", str(self.idle_exit_s)]
        with open(os.path.join(self.runtime_dir, "daemon.log"), "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True, env=_daemon_env(self.runtime_dir))
        self.starts += 1
        deadline = time.monotonic() + START_TIMEOUT_S
        while not daemon_reachable(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise DaemonNotRunning(f"could not start a krex daemon on {self.runtime_dir}",
                                       hint=f"see {self.runtime_dir}/daemon.log")
            time.sleep(0.01)

    def _reap(self) -> None:
        """Forget a daemon of ours that has exited (killed, crashed, idle exit)."""
        if self.proc is not None and self.proc.poll() is not None:
            self.proc = None

    def stop(self) -> dict[str, object]:
        """Stop the daemon if we started it: ``stop`` request, then SIGKILL after a grace."""
        self._reap()
        if self.proc is None:
            return {"stopped": False, "owned": False, "pid": self.pid}
        try:
            with self.client() as client:
                client.stop()
        except DaemonNotRunning:
            pass
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        code, self.proc = self.proc.returncode, None
        return {"stopped": True, "owned": True, "pid": self.pid, "exit_code": code}


def _daemon_env(runtime_dir: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("KREX_SOCKET", "KREX_JOB_ID", "KREX_DEVICE", "LD_PRELOAD")}
    env["KREX_RUNTIME_DIR"] = runtime_dir
    return env
