"""Start an embedded daemon when none is running (the zero-setup default).

The daemon takes an exclusive lock on its runtime directory, so when several
clients race to start one, exactly one daemon serves and the others wait for
its socket.  The embedded daemon exits by itself after a period of idleness.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from krex.errors import DaemonNotRunning
from krex.protocol.address import ensure_private_dir

START_TIMEOUT_S = 20.0
DEFAULT_IDLE_EXIT_S = 600


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


def ensure_daemon(path: str) -> None:
    """Make sure a daemon answers on ``path``, starting an embedded one if needed."""
    if daemon_reachable(path):
        return
    rundir = os.path.dirname(path)
    ensure_private_dir(rundir)
    idle = os.environ.get("KREX_IDLE_EXIT_S", str(DEFAULT_IDLE_EXIT_S))
    log_path = os.path.join(rundir, "daemon.log")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "krex", "serve", "--embedded", "--idle-exit-s", idle,
             "--runtime-dir", rundir],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            env=_daemon_env(),
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if daemon_reachable(path):
            return
        if proc.poll() not in (None, 0):
            break
        time.sleep(0.01)
    raise DaemonNotRunning(
        f"could not start an embedded daemon at {path}", hint=f"see its log: {log_path}"
    )


def _daemon_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("KREX_SOCKET", "KREX_JOB_ID", "KREX_DEVICE", "LD_PRELOAD"):
        env.pop(key, None)
    return env
