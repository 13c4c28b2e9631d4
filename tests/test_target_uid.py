"""A user's job never reaches another user's process (issue 44: "refuse non-operator
targets owned by another uid").

On a node daemon (root) a user may attach only processes of its own as a job's root,
and a process of another uid in the job's process group -- a set-user-ID child, or
root's process that joined the group -- is never frozen with the job.  Alice is a
forked child of this test that drops to uid 54321 after it has started, as root, the
processes a set-user-ID program would leave behind.  Needs root; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import time

import daemon_support
import psutil
import pytest
from helpers import wait_for

from krex.client.connection import Client
from krex.errors import KrexError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a second uid (setuid)")
GROUP, ALICE = daemon_support.NODE_GROUP, 54321


@pytest.fixture
def node_daemon():
    yield from daemon_support.node_daemon("--freeze", "signal", "--no-isolate")


def _sleeper(uid: int | None, group: int | None = None) -> int:
    """A forked ``sleep`` that joins process group ``group`` (0: its own) and runs as
    ``uid`` (None: stays root)."""
    pid = os.fork()
    if pid == 0:
        try:
            if group is not None:
                os.setpgid(0, group)
            if uid is not None:
                os.setgid(GROUP)
                os.setuid(uid)
            os.execvp("sleep", ["sleep", "60"])
        finally:
            os._exit(1)
    if group is not None:
        try:
            os.setpgid(pid, group)  # (either side may win the race; both ask)
        except OSError:
            pass
    return pid


def _alice(socket_path: str, out: int) -> None:
    """Alice's client: its processes, then the drop to her uid, then her requests."""
    leader = _sleeper(ALICE, 0)  # her job's root, a group of its own
    mine = _sleeper(ALICE, leader)  # her process in that group: frozen with the job
    roots = _sleeper(None, leader)  # root's process in her group (a set-user-ID child)
    os.setgroups([GROUP])
    os.setgid(GROUP)
    os.setuid(ALICE)
    said: dict = {"leader": leader, "mine": mine, "roots": roots}
    try:
        c = Client(socket_path, autostart=False)
        job = c.create_job(device="cpu", name="alice", mode="region")["job_id"]
        try:
            c.attach_job(job, roots)
            said["attach_roots"] = "attached"
        except KrexError as exc:
            said["attach_roots"] = exc.code
            said["attach_roots_message"] = exc.message
        said["attach_leader"] = c.attach_job(job, leader)["attached"]
    except (KrexError, OSError) as exc:
        said["error"] = repr(exc)
    os.write(out, (json.dumps(said) + "\n").encode())
    time.sleep(60)  # her connection (and so her job) lives until the test kills her


def _stopped(pid: int) -> bool:
    return psutil.Process(pid).status() == psutil.STATUS_STOPPED


def test_another_users_process_is_neither_attached_nor_frozen_with_a_users_job(node_daemon):
    r, w = os.pipe()
    alice = os.fork()
    if alice == 0:
        try:
            os.close(r)
            _alice(node_daemon.socket, w)
        finally:
            os._exit(0)
    os.close(w)
    said: dict = {}
    try:
        with os.fdopen(r) as f:
            said = json.loads(f.readline())
        assert "error" not in said, said
        # the refusal, and its control: her own process is attached
        assert said["attach_roots"] == "access_denied", said
        assert f"runs as uid 0, not as uid {ALICE}" in said["attach_roots_message"]
        assert said["attach_leader"] is True
        assert psutil.Process(said["roots"]).uids().effective == 0
        with node_daemon.client() as holder:  # root: another job's region freezes hers
            job = holder.register(name="holder", device="cpu")["job_id"]
            region = holder.acquire(job)["region"]
            try:
                wait_for(lambda: _stopped(said["mine"]), 5)  # the control: hers, frozen
                assert _stopped(said["leader"])
                time.sleep(0.2)
                assert not _stopped(said["roots"]), "root's process frozen with Alice's job"
            finally:
                holder.release(region)
            wait_for(lambda: not _stopped(said["mine"]), 5)
    finally:
        for pid in (said.get("leader"), said.get("mine"), said.get("roots"), alice):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in (said.get("leader"), said.get("mine"), said.get("roots"), alice):
            if pid:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
