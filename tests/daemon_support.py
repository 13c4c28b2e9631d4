"""Jobs on a real daemon, and what the daemon says of them (no tests here).

Two kinds of job process: a *step job* (tests/jobs/steps.py) runs the steps it is given
(``r0.01``: a 10 ms region, ``s4``: sleep 4 s, ...) and writes a row per region to a
file; a *region loop* (tests/jobs/regions_loop.py) takes ``n`` back-to-back regions from
a start shared with the other loops and prints its rows.  The daemon's side: whether it
freezes at all, its counters, and a freezing daemon that reaps its jobs at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
from helpers import PY, REPO, Daemon, reap

from krex.client.connection import Client

STEPS = os.path.join(REPO, "tests", "jobs", "steps.py")
LOOP = os.path.join(REPO, "tests", "jobs", "regions_loop.py")


def freezes(d: Daemon) -> bool:
    """Whether the daemon has a freeze backend (else a job is not frozen while another
    holds, and nothing is handed over or re-queued)."""
    with Client(d.socket, autostart=False) as c:
        return (c.status().get("enforcement") or {}).get("freeze", "off") != "off"


def daemon_counters(d: Daemon) -> dict:
    with Client(d.socket, autostart=False) as c:
        return c.status()["counters"]


def start_steps(d: Daemon, *steps: str) -> subprocess.Popen:
    """A job running ``steps``; its rows go to a file (a pipe nobody reads yet would
    block it once full)."""
    env = {**os.environ, "KREX_SOCKET": d.socket}
    out = tempfile.NamedTemporaryFile("w+", dir=d.runtime_dir, suffix=".rows", delete=False)
    p = subprocess.Popen([PY, STEPS, *steps], stdout=out, text=True, env=env)
    p.rows_path = out.name  # type: ignore[attr-defined]
    out.close()
    return p


def step_rows(p: subprocess.Popen) -> list[dict]:
    """The rows of a step job, once it has exited 0."""
    assert p.wait(timeout=60) == 0
    with open(p.rows_path) as f:  # type: ignore[attr-defined]
        return [json.loads(line) for line in f]


@contextlib.contextmanager
def freezing_daemon(runtime_dir, *flags: str) -> Iterator[tuple[Daemon,
                                                                 list[subprocess.Popen]]]:
    """A daemon with ``flags`` (skip where nothing freezes) and a list of the jobs started
    on it: each reaped, the daemon stopped, at the end."""
    d = Daemon(str(runtime_dir), *flags)
    d.start()
    procs: list[subprocess.Popen] = []
    try:
        if not freezes(d):
            pytest.skip("no freeze backend here: a job is not frozen while another holds")
        yield d, procs
    finally:
        for p in procs:
            reap(p)
        d.stop()


def start_loops(how: str, n: int, hold_ms: float, count: int = 2
                ) -> tuple[list[subprocess.Popen], float]:
    """``count`` jobs taking ``n`` regions of ``hold_ms`` back to back (tests/jobs/
    regions_loop.py), all from the returned monotonic start, 1.5 s from now (registered
    and warm by then); :func:`loop_rows` collects them."""
    start = time.monotonic() + 1.5
    return [subprocess.Popen([PY, LOOP, how, str(n), str(hold_ms), str(start)],
                             stdout=subprocess.PIPE, text=True) for _ in range(count)], start


def loop_rows(procs: list[subprocess.Popen]) -> list[dict]:
    """Every region the loops took (their daemon times), in grant order; all reaped."""
    try:
        rows = []
        for p in procs:
            out, _ = p.communicate(timeout=180)
            assert p.returncode == 0
            rows += json.loads(out)
    finally:
        for p in procs:
            reap(p)
    return sorted(rows, key=lambda r: r["granted"])


NODE_GROUP = 54320  # the socket's group of a node daemon the suite starts (no account)


def node_daemon(*flags: str) -> Iterator[Daemon]:
    """A node daemon (``--node --group 54320``) on a runtime directory other uids can
    reach, stopped and removed after (a fixture's body: ``yield from``)."""
    import shutil

    base = tempfile.mkdtemp(prefix="krex-node-")
    os.chmod(base, 0o755)  # the other uids must reach the runtime directory
    d = Daemon(os.path.join(base, "rt"), "--node", "--group", str(NODE_GROUP), *flags)
    os.makedirs(d.runtime_dir, mode=0o750)
    try:
        d.start()
        yield d
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)
