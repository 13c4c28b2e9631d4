"""Node mode: one daemon for every user of the node, requests authorised by SO_PEERCRED.

Two uids on this machine, without creating accounts: the clients run as
uids 54321 and 54322 (no passwd entry is needed for the kernel's
credentials), both in the socket's group 54320; a third uid outside the
group cannot open the socket.  Needs root (setuid, and the daemon's
cgroups); skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import daemon_support
import pytest
from helpers import CONTENTION, REPO, Daemon, clean_but_contention, run_krex, shield_owner, why_not

from krex.client.connection import Client
from krex.errors import KrexError
from krex.protocol import messages as m

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as "
                                "other uids (setuid)")
UNIT = os.path.join(REPO, "contrib", "systemd", "krex.service")
GROUP, ALICE, BOB, EVE = daemon_support.NODE_GROUP, 54321, 54322, 54323

class User:
    """A forked child of this test running as ``uid`` (no exec: the interpreter under
    /root may not be readable by other uids), answering commands over pipes."""

    def __init__(self, uid: int, groups: list[int], socket_path: str,
                 job: bool = True) -> None:
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.close(self._cmd_w)
                os.close(self._out_r)
                os.setgroups(groups)
                os.setgid(groups[0] if groups else uid)
                os.setuid(uid)
                self._serve(socket_path, os.fdopen(cmd_r), os.fdopen(out_w, "w"), job)
                code = 0
            finally:
                os._exit(code)
        os.close(cmd_r)
        os.close(out_w)
        self._out = os.fdopen(self._out_r)

    @staticmethod
    def _serve(socket_path, commands, out, with_job) -> None:
        try:
            c = Client(socket_path, autostart=False)
            job = c.register(name="node-user", device="cpu")["job_id"] if with_job else None
        except (KrexError, OSError) as exc:
            out.write(json.dumps({"error": getattr(exc, "code", type(exc).__name__)}) + "\n")
            out.flush()
            return
        out.write(json.dumps({"job_id": job}) + "\n")
        out.flush()
        for line in commands:
            cmd, *arg = line.split()
            if cmd == "quit":  # (no EOF to wait for: later forks hold our pipe too)
                return
            try:
                if cmd == "acquire":
                    res = c.acquire(job, "cpu", timeout_s=float(arg[0]) if arg else None)
                elif cmd == "release":
                    res = c.release(int(arg[0]))["report"]
                elif cmd == "revoke":
                    res = c.conn.call(m.Revoke(region=int(arg[0])))
                else:
                    res = c.status()
            except KrexError as exc:
                res = {"error": exc.code}
            out.write(json.dumps(res) + "\n")
            out.flush()

    def hello(self) -> dict:
        return json.loads(self._out.readline())

    def send(self, line: str) -> None:
        os.write(self._cmd_w, (line + "\n").encode())

    def ask(self, line: str) -> dict:
        self.send(line)
        return json.loads(self._out.readline())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._cmd_w, b"quit\n")
        os.close(self._cmd_w)
        self._out.close()
        deadline = time.monotonic() + 10
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                return
            time.sleep(0.01)


@pytest.fixture
def node_daemon():
    yield from daemon_support.node_daemon()


@needs_root
def test_two_users_share_one_node_daemon_each_acting_only_on_its_own(node_daemon):
    st = os.stat(node_daemon.socket)
    assert st.st_gid == GROUP and st.st_mode & 0o777 == 0o660
    alice = User(ALICE, [GROUP], node_daemon.socket)
    bob = User(BOB, [GROUP], node_daemon.socket)  # a job: frozen while Alice holds
    bobs_shell = User(BOB, [GROUP], node_daemon.socket, job=False)  # no job: never frozen
    users = [alice, bob, bobs_shell]
    try:
        assert "job_id" in alice.hello() and "job_id" in bob.hello()
        assert bobs_shell.hello() == {"job_id": None}
        grant = alice.ask("acquire")
        region = grant["region"]
        assert grant["tenant"] == f"uid:{ALICE}"
        assert bobs_shell.ask(f"revoke {region}") == {"error": "access_denied"}
        assert bobs_shell.ask(f"release {region}") == {"error": "unknown_region"}
        seen = bobs_shell.ask("status")
        assert seen["other_jobs"] == 1 and [j["uid"] for j in seen["jobs"]] == [BOB]
        assert seen["scheduler"]["cpu"]["holder"]["label"] is None  # not Bob's to see
        # Alice's region excludes Bob's job (frozen by the node daemon): his acquire is
        # granted only after her release.
        bob.send("acquire")
        time.sleep(0.5)
        alice.send(f"release {region}")
        # Bob's grant first: once he holds, Alice's job is frozen in turn (she may not
        # have read her release's reply yet), and she reads it after Bob's release.
        theirs = bob.hello()  # the acquire's reply
        assert theirs["tenant"] == f"uid:{BOB}"
        bobs = bob.ask(f"release {theirs['region']}")
        report = alice.hello()  # her release's reply
        assert theirs["granted_mono_s"] > report["released_mono_s"]
        # Clean, or only the machine's own contention (a CPU loop beside the suite
        # preempting the holder; with another daemon owning the shield, no cores to
        # reserve): this test is about who may see and do what.
        for r in (report, bobs):
            assert r["outcome"] == "released" and (r["clean"] or clean_but_contention(r)
                                                   or _no_shield_here(r)), why_not(r)
    finally:
        for u in users:
            u.close()


def _no_shield_here(report: dict) -> bool:
    """Not clean only for want of cores, while another daemon on this machine owns the
    shield (and the rest of the cores): not this daemon's doing."""
    rest = [r for r in report["reasons"] if r["code"] not in CONTENTION]
    return shield_owner() is not None and all(
        r["code"] == "mechanism_unavailable" and r["message"].startswith("isolate:")
        for r in rest)


@needs_root
def test_a_user_outside_the_group_cannot_connect(node_daemon):
    eve = User(EVE, [EVE], node_daemon.socket)
    try:
        assert eve.hello() == {"error": "access_denied"}  # EACCES: the group's directory
    finally:
        eve.close()


def test_the_systemd_unit_starts_a_node_daemon_with_flags_krex_serve_takes():
    lines = open(UNIT).read().splitlines()
    (start,) = [line for line in lines if line.startswith("ExecStart=")]
    argv = start.split("=", 1)[1].split()
    assert argv[1:4] == ["serve", "--node", "--group"]
    helptext = run_krex("serve", "--help").stdout
    assert all(a in helptext for a in argv if a.startswith("--"))


FALLBACK = r"""
import json, os, sys, time
import krex
import importlib
r = importlib.import_module("krex.client.region")

timings, conns = [], set()
for _ in range(20):
    t0 = time.perf_counter()
    with krex.region("cpu"):
        pass
    timings.append(time.perf_counter() - t0)
    conns.add(id(r._state.conn))
print(json.dumps({"path": r._state.conn.path, "connections": len(conns),
                  "first_s": timings[0], "later_max_s": max(timings[1:])}))
"""


def _stale_socket(path: str) -> None:
    """What a SIGKILLed node daemon leaves: a socket file nobody listens on."""
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()


def test_a_dead_node_daemons_socket_falls_back_to_the_per_user_daemon(tmp_path):
    """Before: the client took the stale node socket (it exists and is ours to open),
    autostart tried to start a daemon in the node's directory, and every region
    failed with daemon_not_running.  Now: one refused connect, then the per-user
    daemon (autostarted), one connection reused by every later region; and a node
    daemon that comes back (a new socket) is found again."""
    import subprocess

    from helpers import PY

    node, xdg = tmp_path / "node", tmp_path / "xdg"
    node.mkdir(mode=0o700)
    xdg.mkdir(mode=0o700)
    _stale_socket(str(node / "krexd.sock"))
    env = {k: v for k, v in os.environ.items() if k not in ("KREX_RUNTIME_DIR", "KREX_SOCKET")}
    env.update(KREX_NODE_DIR=str(node), XDG_RUNTIME_DIR=str(xdg), KREX_IDLE_EXIT_S="30")
    own = xdg / "krex"
    try:
        out = subprocess.run([PY, "-c", FALLBACK], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout)
        assert got["path"] == str(own / "krexd.sock")
        assert got["connections"] == 1, "a new connection per region: the fallback is redone"
        assert not (node / "krexd.lock").exists(), "tried to start a daemon in the node dir"
        node_daemon = Daemon(str(node)).start()  # a node daemon again: a new socket
        try:
            out = subprocess.run([PY, "-c", FALLBACK], env=env, capture_output=True,
                                 text=True, timeout=120)
            assert out.returncode == 0, out.stderr[-2000:]
            assert json.loads(out.stdout)["path"] == str(node / "krexd.sock")
        finally:
            node_daemon.stop()
    finally:
        for rt in (own, node):  # (before the fix, one was autostarted in the node dir)
            with contextlib.suppress(KrexError, OSError):
                Client(str(rt / "krexd.sock"), autostart=False,
                       check_installation=False).stop()
                _wait_gone(rt / "krexd.sock")


def _wait_gone(path, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_lean_cli_passes_over_a_dead_node_daemons_socket(tmp_path):
    """`krex exec` (the CLI's lean path, krex.cli.lean) with a stale node socket: one
    refused connect, then the per-user daemon, autostarted in the user's own directory
    (never in the node's).  Control: with the node socket named explicitly
    ($KREX_SOCKET) there is no fallback, and the error names the node socket."""
    import subprocess

    from helpers import PY

    node, xdg = tmp_path / "node", tmp_path / "xdg"
    node.mkdir(mode=0o700)
    xdg.mkdir(mode=0o700)
    _stale_socket(str(node / "krexd.sock"))
    prog = tmp_path / "p.py"
    prog.write_text("print('served')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("KREX_RUNTIME_DIR", "KREX_SOCKET")}
    env.update(KREX_NODE_DIR=str(node), XDG_RUNTIME_DIR=str(xdg), KREX_IDLE_EXIT_S="30")
    own = xdg / "krex"
    try:
        out = subprocess.run([PY, "-m", "krex", "exec", str(prog)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout == "served\n", out.stderr[-2000:]
        assert (own / "krexd.sock").exists()
        assert not (node / "krexd.lock").exists(), "tried to start a daemon in the node dir"
        named = subprocess.run([PY, "-m", "krex", "exec", str(prog)],
                               env={**env, "KREX_SOCKET": str(node / "krexd.sock")},
                               capture_output=True, text=True, timeout=120)
        assert named.returncode != 0 and f"no krex daemon at {node}" in named.stderr, named.stderr
    finally:
        with contextlib.suppress(KrexError, OSError):
            Client(str(own / "krexd.sock"), autostart=False, check_installation=False).stop()
            _wait_gone(own / "krexd.sock")
