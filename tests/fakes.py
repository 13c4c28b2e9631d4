"""Fakes of the daemon's collaborators, for driving its core in-process.

A session that collects what the core pushes to it, an enforcement that does nothing
(but can be made to wait), and :func:`request`, which hands the core one message the
way a connection would and queues its direct reply as a pushed frame.
"""

from __future__ import annotations

import os
import queue
import threading
import time

from krex.daemon.core import Daemon
from krex.daemon.exclusivity import Evidence
from krex.enforce.process import ProcessRef
from krex.protocol import messages as m
from krex.protocol.peer import Peer
from krex.protocol.report import HostEvidence


class FakeSession:
    def __init__(self) -> None:
        self.peer = Peer(os.getpid(), os.getuid(), os.getgid())
        self.process = ProcessRef.of(os.getpid())
        self.verified: set[tuple[int, int]] = set()
        self.pushed: queue.Queue[m.Message] = queue.Queue()

    def push(self, message: m.Message) -> None:
        self.pushed.put(message)

    def reply(self, re: int, timeout_s: float = 5.0) -> m.Message:
        """The next frame pushed for request ``re`` (others are skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.pushed.get(timeout=max(0.01, deadline - time.monotonic()))
            if getattr(msg, "re", None) == re:
                return msg


class FakeHeld:
    def __init__(self, stopped: int) -> None:
        self.stopped = stopped

    def exit(self) -> Evidence:
        return Evidence(HostEvidence(siblings_frozen=self.stopped), None, [])


class ScriptedExclusivity:
    """Enforcement that does nothing, except wait in ``enter`` on ``slow`` devices."""

    def __init__(self) -> None:
        self.slow: dict[str, threading.Event] = {}
        self.entered: list[str] = []

    def enter(self, holder, siblings, request, others=()):
        gate = self.slow.get(request.device)
        if gate is not None:
            gate.wait(30)
        self.entered.append(request.device)
        return FakeHeld(len(siblings))

    def lock_clocks(self, devices):
        pass

    def create_cgroups(self, job_id, device="cpu"):
        return None

    def adopt(self, cgroups, process):
        pass

    def remove_cgroups(self, cgroups):
        pass

    def job_ended(self, job_id):
        pass

    def cgroup_paths(self, cgroups):
        return {}

    def job_env(self, job):
        return {}

    def check_guardian(self):
        return False

    def guardian_restarts(self):
        return 0

    def describe(self):
        return {}

    def close(self):
        pass


_ids = iter(range(1, 1 << 30))


def next_id() -> int:
    """A request id no other request of the run has (the core answers by id)."""
    return next(_ids)


def request(d: Daemon, s: FakeSession, msg_type: type[m.Message], **fields) -> int:
    rid = next_id()
    reply = d.handle(s, msg_type(id=rid, **fields))  # type: ignore[call-arg]
    if reply is not None:
        s.push(m.Reply(re=rid, data=reply))
    return rid
