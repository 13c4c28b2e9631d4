"""Start a daemon: the embedded one when none is running (the zero-setup default), or any
``krex serve`` a harness needs, waiting until its socket answers.

The daemon takes an exclusive lock on its runtime directory, so when several
clients race to start one, exactly one daemon serves and the others (which
exit 0) wait for its socket.  The embedded daemon exits by itself after a
period of idleness.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from krex.errors import DaemonNotRunning
from krex.protocol.address import SOCKET_NAME, ensure_private_dir

if TYPE_CHECKING:  # imported where a daemon is started: not on every client's start-up
    import subprocess

START_TIMEOUT_S = 20.0
DEFAULT_IDLE_EXIT_S = 600
JOB_VARIABLES = ("KREX_SOCKET", "KREX_JOB_ID", "KREX_DEVICE", "LD_PRELOAD")
# The directory holding the krex package this process runs: the daemon starts there, so
# its ``python -m krex`` imports this krex, not a ``krex/`` folder in the caller's cwd.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def daemon_reachable(path: str) -> bool:
    """True when something accepts connections on the Unix socket ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        return True
    except OSError:
        return False
    finally:
        sock.close()


def daemon_env(runtime_dir: str | None = None) -> dict[str, str]:
    """Our environment without what belongs to a job of another daemon."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    if runtime_dir is not None:
        env["KREX_RUNTIME_DIR"] = runtime_dir
    return env


def spawn_daemon(runtime_dir: str, args: Sequence[str] = (), *, env: dict[str, str] | None = None,
                 log_path: str | None = None, timeout_s: float = START_TIMEOUT_S,
                 new_session: bool = True,
                 preexec_fn: Callable[[], object] | None = None) -> subprocess.Popen[bytes]:
    """Start ``krex serve --runtime-dir RUNTIME_DIR ARGS`` and wait until its socket answers.

    Its output goes to ``log_path`` (default ``RUNTIME_DIR/daemon.log``); ``preexec_fn``
    runs in the child before it starts (a harness's resource limits, say).  A
    daemon that exits 0 found another one serving the directory: that one's
    socket is waited for.  Raises :class:`~krex.errors.DaemonNotRunning` (the
    log in the hint) when nothing answers in time or the daemon fails; the
    process started is then reaped.
    """
    import subprocess

    runtime_dir = os.path.abspath(runtime_dir)
    ensure_private_dir(runtime_dir)
    path = os.path.join(runtime_dir, SOCKET_NAME)
    log_path = os.path.abspath(log_path or os.path.join(runtime_dir, "daemon.log"))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "krex", "serve", "--runtime-dir", runtime_dir, *args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=new_session,
            env=daemon_env() if env is None else env, cwd=PACKAGE_PARENT,
            preexec_fn=preexec_fn)
    try:
        _wait_up(proc, path, time.monotonic() + timeout_s, runtime_dir, log_path)
    except BaseException:  # not up in time, or interrupted (Ctrl-C, SIGTERM) while waiting
        _reap(proc)
        raise
    return proc


def _wait_up(proc: subprocess.Popen[bytes], path: str, deadline: float, runtime_dir: str,
             log_path: str) -> None:
    while not daemon_reachable(path):
        code = proc.poll()
        if code not in (None, 0) or time.monotonic() > deadline:
            why = "did not answer in time" if code is None else f"exited with {code}"
            raise DaemonNotRunning(f"could not start a krex daemon on {runtime_dir}: {why}",
                                   hint=f"see its log: {log_path}")
        time.sleep(0.01)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def ensure_daemon(path: str) -> None:
    """Make sure a daemon answers on ``path``, starting an embedded one if needed."""
    if daemon_reachable(path):
        return
    idle = os.environ.get("KREX_IDLE_EXIT_S", str(DEFAULT_IDLE_EXIT_S))
    spawn_daemon(os.path.dirname(path), ["--embedded", "--idle-exit-s", idle])
