"""The candidate's sandbox in a sealed evaluation (issue 42): what its process can reach.

A probe candidate computes the reference's answer (so every verdict below is about
the sandbox, not about speed) and, at import, writes down what it could reach: its
uid, the network, the reference's and the driver's descriptors and memory (what a
candidate would copy the reference's answers from, or forge the driver's samples
with), a root-only file, the daemon's socket, its tmp and its limits.

- Through a root daemon whose interpreter other users may run (tests/reachable.py,
  as a node installs krex): ``sandbox="auto"`` runs it as a uid of its own, without
  network, in a private tmp, under limits, and it reaches none of them.  The
  negative control, ``sandbox="off"``: the same probe runs as root and reaches all.
- Through the same daemon for a tenant (the driver is the tenant's uid, not root):
  the candidate keeps that uid, but the reference and the driver are not dumpable, it
  may signal only itself (seccomp) and it has no network; the control (``off``): it
  reads the reference's descriptors and could stop it.
- On this machine's own daemon (its Python under /root, 0700): ``auto`` names what
  it could not apply, ``required`` refuses to evaluate and says why.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import textwrap

import pytest
from evaluate_helpers import CPU, serving, spec, verdict_or_abstained
from helpers import NamespacedDaemon, open_tmp

from krex.client.connection import ACTING_FOR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="a candidate's own uid needs a root driver"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1)"),
]

REF, INPUTS = spec(CPU, "kernels.py:reference"), spec(CPU, "inputs.py:make")
PROBE = textwrap.dedent('''
    import errno, json, os, resource, socket, tempfile
    import numpy as np

    def _try(fn):
        try:
            fn()
            return "read"
        except OSError as exc:
            return errno.errorcode.get(exc.errno, type(exc).__name__)

    def _reference():
        me = os.getpid()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if int(pid) != me and ppid == os.getppid() and b"krex.evaluate.callee" in cmd:
                return int(pid)
        return None

    def _connect(family, address):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(address)
        finally:
            s.close()

    def _observe():
        ref, driver = _reference(), os.getppid()
        tmp = tempfile.gettempdir()
        seen = {"uid": os.getuid(), "tmp": tmp, "reference_found": ref is not None,
                "interfaces": sorted(name for _, name in socket.if_nameindex()),
                "loopback": _try(lambda: _connect(socket.AF_INET, ("127.0.0.1", 9))),
                "reference_fds": _try(lambda: os.listdir(f"/proc/{ref}/fd")),
                "reference_mem": _try(lambda: open(f"/proc/{ref}/mem", "rb").close()),
                "driver_fds": _try(lambda: os.listdir(f"/proc/{driver}/fd")),
                "driver_environ": _try(lambda: open(f"/proc/{driver}/environ").read()),
                "secret": _try(lambda: open(SECRET).read()),
                "signal_reference": _try(lambda: os.kill(ref, 0)),
                "signal_driver": _try(lambda: os.kill(driver, 0)),
                "signal_self": _try(lambda: os.kill(os.getpid(), 0)),
                "daemon": _try(lambda: _connect(socket.AF_UNIX, os.environ["KREX_SOCKET"])),
                "tmp_writable": _try(lambda: tempfile.NamedTemporaryFile(dir=tmp).close()),
                "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0],
                "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
                "core": resource.getrlimit(resource.RLIMIT_CORE)[0]}
        with open(REPORT, "w") as f:
            json.dump(seen, f)

    _observe()

    def candidate(x):
        out = None
        for _ in range(2):
            out = x * np.sqrt(x * x + np.float32(1.0))
        return out
''')


@pytest.fixture(scope="module")
def open_dir():
    """A directory every user may enter (tmp_path is root's only): the probe, its report
    and the root-only secret."""
    yield from open_tmp("krex-sandbox-test-")


@pytest.fixture(scope="module")
def node_daemon(open_dir):
    """A root daemon where other users can run the interpreter, with tenant users."""
    rt = os.path.join(open_dir, "rt")
    os.mkdir(rt, 0o700)
    yield from serving(NamespacedDaemon(rt, "--tenant-uids", "60500-60999"))


def _probe(open_dir: str, **kw) -> tuple[dict, object]:
    """The probe's evaluation, and what it saw."""
    import krex

    report, secret = os.path.join(open_dir, "seen.json"), os.path.join(open_dir, "secret")
    with open(secret, "w") as f:
        f.write("root's")
    os.chmod(secret, 0o600)
    with open(report, "w") as f:
        f.write("{}")
    os.chmod(report, 0o666)  # the candidate's uid writes it
    prog = os.path.join(open_dir, "probe.py")
    with open(prog, "w") as f:
        f.write(f"REPORT = {report!r}\nSECRET = {secret!r}\n" + PROBE)
    os.chmod(prog, 0o644)
    ev = krex.evaluate(REF, f"{prog}:candidate", INPUTS, fresh=True, save=False, cache="hot",
                       **kw)
    with open(report) as f:
        return json.load(f), ev


def test_a_candidate_runs_apart_with_nothing_to_reach(node_daemon, open_dir):
    seen, ev = _probe(open_dir)
    box = ev.integrity["sandbox"]
    assert ev.correct and not ev.invalid_findings, ev.summary()
    assert box["apart"] and box["missing"] == [] and box["network"] == "none", box
    assert 61000 <= seen["uid"] <= 61999 and seen["uid"] == box["uid"], seen
    assert seen["reference_found"], seen
    for what in ("reference_fds", "reference_mem", "driver_fds", "driver_environ",
                 "secret", "daemon", "signal_reference", "signal_driver"):
        assert seen[what] in ("EACCES", "EPERM"), (what, seen)
    assert seen["signal_self"] == "read" and box["signals"] == "own", (seen, box)
    assert seen["interfaces"] == ["lo"] and seen["loopback"] == "ENETUNREACH", seen
    assert seen["tmp"] == box["tmp"] != tempfile.gettempdir(), seen
    assert seen["tmp_writable"] == "read" and not os.path.exists(box["tmp"]), seen
    assert seen["nproc"] == 512 and seen["fsize"] == 1 << 30 and seen["core"] == 0, seen
    # an honest candidate apart still gets its verdict: the sandbox changes no timing
    import krex

    ev = krex.evaluate(REF, spec(CPU, "honest.py:faster"), INPUTS, fresh=True, save=False,
                       cache="hot")
    assert ev.integrity["sandbox"]["apart"] and verdict_or_abstained(ev, "faster"), ev.summary()
    # the negative control: the same probe, no sandbox, reaches everything as root
    seen, ev = _probe(open_dir, sandbox="off")
    assert ev.correct and ev.integrity["sandbox"]["mode"] == "off", ev.summary()
    assert seen["uid"] == 0 and seen["loopback"] == "ECONNREFUSED", seen
    for what in ("reference_fds", "reference_mem", "driver_fds", "driver_environ",
                 "secret", "daemon", "signal_reference", "signal_driver"):
        assert seen[what] == "read", (what, seen)


def test_a_candidate_of_its_drivers_uid_cannot_read_the_reference_or_the_driver(
        node_daemon, open_dir):
    """A tenant's evaluation: the driver is the tenant's uid, so is the candidate."""
    token = ACTING_FOR.set("alice")
    try:
        seen, ev = _probe(open_dir)
        control, ev_off = _probe(open_dir, sandbox="off")
    finally:
        ACTING_FOR.reset(token)
    box = ev.integrity["sandbox"]
    assert ev.correct and not box["apart"] and 60500 < seen["uid"] <= 60999, (box, seen)
    assert any(m.startswith("uid: the driver runs as uid") for m in box["missing"]), box
    for what in ("reference_fds", "reference_mem", "driver_fds", "driver_environ",
                 "signal_reference", "signal_driver"):  # its uid's, and still out of reach
        assert seen[what] in ("EACCES", "EPERM"), (what, seen)
    assert seen["signal_self"] == "read" and box["signals"] == "own", (seen, box)
    if box["network"] == "none":  # a user namespace of its own, where the kernel allows
        assert seen["interfaces"] == ["lo"], seen
    else:
        assert any(m.startswith("network:") for m in box["missing"]), box
    # the control: without the sandbox the same uid reads the reference's descriptors
    assert ev_off.correct and control["uid"] == seen["uid"], control
    assert control["reference_fds"] == "read" and control["driver_fds"] == "read", control
    assert control["signal_reference"] == "read", control  # it could stop the reference


def test_what_this_machine_cannot_apply_is_named_or_refused(daemon_m):
    import krex
    from krex.errors import EvaluationFailed
    from krex.evaluate.sandbox import reach
    from krex.protocol.runas import RunAs

    blocked = RunAs(61000, 61000, (), "/").cannot_reach(
        reach([REF.rsplit(":", 1)[0], INPUTS.rsplit(":", 1)[0]]), [])
    if blocked is None:
        pytest.skip("every user may run this interpreter: nothing to name")
    ev = krex.evaluate(REF, spec(CPU, "honest.py:same"), INPUTS, fresh=True, save=False,
                       cache="hot")
    box = ev.integrity["sandbox"]
    assert ev.correct and not box["apart"] and box["uid"] == 0, box
    assert box["network"] == "none" and box["limits"]["RLIMIT_FSIZE"] == 1 << 30, box
    assert any(blocked in m for m in box["missing"]), (blocked, box)
    from krex.enforce.doctor import _sandbox_check  # krex doctor says the same, and why

    check = _sandbox_check()
    assert not check["ok"] and blocked in check["detail"] and check["advice"], check
    with pytest.raises(EvaluationFailed, match="sandbox='required'.*does not let uid"):
        krex.evaluate(REF, spec(CPU, "honest.py:same"), INPUTS, fresh=True, save=False,
                      cache="hot", sandbox="required")
