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

from krex.client.autostart import daemon_env, daemon_reachable, spawn_daemon
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
        args = list(self.serve_args)
        if self.idle_exit_s:
            args += ["--embedded", "--idle-exit-s", str(self.idle_exit_s)]
        self.starts += 1
        self.proc = spawn_daemon(self.runtime_dir, args, env=daemon_env(self.runtime_dir),
                                 timeout_s=START_TIMEOUT_S)

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

