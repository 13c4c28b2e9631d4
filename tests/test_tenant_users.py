"""A root daemon runs a tenant's code as the tenant's own uid, never as root (issue 44).

Through a real root daemon with ``--tenant-uids``: a program run for tenant
alice runs as a uid of hers (not 0, not bob's), takes regions charged to her
(on fakegpu too: her worker's interposer maps its gate file, made hers),
and cannot read bob's home, the daemon's tenant map or its event log, nor see
the daemon's environment; the operator's own program (no tenant named) runs as
root and reads them all (the negative control: the probe sees root, the files
and the variable are there).  With
``--tenant-uids off`` a root daemon refuses a tenant's program; where the
interpreter is out of other users' reach the refusal names the directory.
Through a real service in front of such a daemon: an exec job and a bench's
commands run as the tenant's uid, an evaluation gives its verdict, and bob's
job cannot read alice's job folder, the jobs or records database or the tokens,
which alice's own job (her folder) and the root service (the stores) can.

This machine keeps its Python under /root (0700), as a developer's machine does;
the daemon here runs where that directory lets others in (tests/reachable.py: a
mount namespace of its own, the same files), as a node installs krex.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap

import pytest
from evaluate_helpers import CPU, spec
from helpers import NamespacedDaemon, open_tmp, run_krex, wait_for

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root daemon"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1)"),
]

RANGE = "60500-60999"
NODE_GROUP = 60400  # a node daemon's --group (a number: no such group need exist)
PROBE = textwrap.dedent("""
    import json, os, sys
    import krex
    seen = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
            "home": os.environ["HOME"]}
    with open("/proc/self/environ", "rb") as f:  # what the worker started with
        seen["secret"] = b"DAEMON_SECRET=" in f.read()
    for path in sys.argv[1:]:
        try:
            with open(path, "rb") as f:
                f.read(1)
            seen[path] = "read"
        except OSError as exc:
            seen[path] = type(exc).__name__
    with open("/proc/self/status") as f:  # set-user-ID programs give it nothing back
        seen["no_new_privs"] = [ln.split()[1] for ln in f if ln.startswith("NoNewPrivs")]
    gate = os.environ.get("KREX_GATE_FILE")  # a GPU job's: its interposer maps it
    seen["gate"] = os.access(gate, os.R_OK | os.W_OK) if gate else None
    with krex.region(os.environ["KREX_DEVICE"], label="probe") as r:
        pass
    seen["clean"] = r.report.clean
    print("SEEN " + json.dumps(seen))
""")


@pytest.fixture
def shared_tmp():
    """A directory every user may enter (/tmp's own tmp_path is root's only)."""
    yield from open_tmp("krex-tenants-")


@pytest.fixture
def tenant_daemon(request, shared_tmp, monkeypatch):
    """A root daemon with tenant users: per-user (the socket's group is the range's first
    id) or a node daemon (its --group's)."""
    rt = os.path.join(shared_tmp, "rt")
    os.mkdir(rt, 0o700)
    node = getattr(request, "param", "per-user") == "node"
    mode = ["--node", "--group", str(NODE_GROUP)] if node else []
    d = NamespacedDaemon(rt, "--tenant-uids", RANGE, *mode)
    d.start()
    monkeypatch.setenv("KREX_SOCKET", d.socket)
    try:
        yield d
    finally:
        d.stop()


def _probe(client, shared_tmp: str, tenant: str | None, *paths: str,
           device: str = "cpu") -> dict:
    prog = os.path.join(shared_tmp, "probe.py")
    if not os.path.exists(prog):
        with open(prog, "w") as f:
            f.write(PROBE)
        os.chmod(prog, 0o644)
    out: list[str] = []
    result = client.exec(prog, list(paths), timeout_s=60, cwd="/", tenant=tenant,
                         device=device, on_output=lambda stream, text: out.append(text))
    assert result.exit_code == 0, (result.exception, "".join(out))
    line = next(ln for ln in "".join(out).splitlines() if ln.startswith("SEEN "))
    return json.loads(line[5:])


@pytest.mark.parametrize("tenant_daemon", ["per-user", "node"], indirect=True)
def test_a_tenants_program_runs_as_its_own_uid_and_reads_nothing_of_others(
        tenant_daemon, shared_tmp):
    rt = tenant_daemon.runtime_dir
    with tenant_daemon.client() as c:
        bob = _probe(c, shared_tmp, "bob")
        secret = os.path.join(bob["home"], "secret")
        private = [secret, os.path.join(rt, "tenant-uids.json"), os.path.join(rt,
                   "events.jsonl")]
        with open(secret, "w") as f:  # written by root for bob: his file, his home
            f.write("bob's")
        os.chown(secret, bob["uid"], bob["gid"])
        alice = _probe(c, shared_tmp, "alice", *private)
        operator = _probe(c, shared_tmp, None, *private)
        gpu = _probe(c, shared_tmp, "alice", device="fakegpu:0")
        regions = c.regions()
    first, last = map(int, RANGE.split("-"))
    assert first < alice["uid"] <= last and first < bob["uid"] <= last, (alice, bob)
    assert alice["uid"] != bob["uid"] and alice["gid"] == alice["uid"], (alice, bob)
    group = NODE_GROUP if os.stat(tenant_daemon.socket).st_gid == NODE_GROUP else first
    assert alice["groups"] == [group], alice  # the socket's group: her regions
    assert alice["home"] == os.path.join(rt, "homes", str(alice["uid"])), alice
    assert all(alice[p] == "PermissionError" for p in private), alice
    assert alice["secret"] is False, alice  # the daemon's environment stays its own
    assert alice["no_new_privs"] == ["1"], alice  # no set-user-ID way back to root
    # the control: the operator's own program is root, and the files are there to read
    assert operator["uid"] == 0 and all(operator[p] == "read" for p in private), operator
    assert operator["secret"] is True and operator["no_new_privs"] == ["0"], operator
    # on a GPU her worker's interposer maps its gate file (another uid's job's: hers)
    assert gpu["uid"] == alice["uid"] and gpu["gate"] is True, gpu
    tenants = {r.get("label"): set() for r in regions}
    for r in regions:
        tenants[r.get("label")].add(r.get("tenant"))
    assert tenants["probe"] >= {"alice", "bob"}, tenants  # her regions are hers


def test_a_root_daemon_without_tenant_uids_refuses_a_tenants_program(make_daemon, tmp_path):
    from krex.errors import AccessDenied

    prog = tmp_path / "p.py"
    prog.write_text("print('ran')\n")
    d = make_daemon("--tenant-uids", "off")
    with d.client() as c:
        with pytest.raises(AccessDenied, match="does not run tenant 'alice'"):
            c.exec(str(prog), [], timeout_s=60, tenant="alice")
        assert c.exec(str(prog), [], timeout_s=60, on_output=lambda *a: None).exit_code == 0


def test_a_tenant_user_that_cannot_reach_the_interpreter_is_named(make_daemon, tmp_path):
    from krex.errors import AccessDenied
    from krex.protocol.runas import RunAs

    nobody = RunAs(uid=60999, gid=60999, groups=(), home="/")
    if nobody.cannot_reach([os.path.realpath(sys.executable), os.__file__], []) is None:
        pytest.skip("this machine's interpreter is readable by every user")
    prog = tmp_path / "p.py"
    prog.write_text("print('ran')\n")
    d = make_daemon("--tenant-uids", RANGE)
    with d.client() as c, pytest.raises(AccessDenied, match="cannot run krex here: /"):
        c.exec(str(prog), [], timeout_s=60, tenant="alice")


# -- through a real service ------------------------------------------------------------------

ALICE_JOB = textwrap.dedent("""
    import os, time
    with open("secret", "w") as f:
        f.write("alice's")
    time.sleep(float(os.environ.get("HOLD_S", "0")))
""")


def test_service_jobs_run_as_their_tenant_and_cannot_read_each_other(tenant_daemon,
                                                                      shared_tmp):
    from pathlib import Path

    from service_support import Service

    state = os.path.join(shared_tmp, "state")
    tokens = {name: run_krex("service", "token", "add", name, "--state-dir",
                             state).stdout.strip() for name in ("alice", "bob")}
    auth = {name: {"Authorization": f"Bearer {t}"} for name, t in tokens.items()}
    s = Service(Path(state), "--runners", "3")
    try:
        # an evaluation's programs run as the tenant and still give a verdict (and its
        # record is stored, where bob's job tries to read it below)
        _, e = s.call("POST", "/v1/jobs/evaluate", EVALUATION, headers=auth["alice"])
        ev = s.wait(e["id"], wait_s=60, headers=auth["alice"])
        assert ev["state"] == "succeeded" and ev["result"]["correct"] is True, ev
        _, a = s.call("POST", "/v1/jobs/exec", {"program": ALICE_JOB, "env": {"HOLD_S": "20"}},
                      headers=auth["alice"])
        work = os.path.join(state, "jobs", a["id"], "work")

        def written() -> bool:
            job = s.call("GET", f"/v1/jobs/{a['id']}", headers=auth["alice"])[1]
            assert job["state"] in ("queued", "running"), (job.get("error"), job.get("result"))
            return os.path.exists(os.path.join(work, "secret"))
        wait_for(written, timeout_s=60, interval_s=0.05)
        stores = [os.path.join(state, n) for n in ("jobs.sqlite3", "records.sqlite3",
                                                   "tokens.json", "token")]
        files = [os.path.join(work, "secret"), os.path.join(os.path.dirname(work),
                                                           "program.py"), *stores]
        _, b = s.call("POST", "/v1/jobs/exec", {"program": READER, "args": files},
                      headers=auth["bob"])
        bob = s.wait(b["id"], wait_s=60, headers=auth["bob"])
        assert bob["state"] == "succeeded", bob
        seen = json.loads(bob["result"]["stdout"].split("SEEN ", 1)[1])
        assert all(seen[f] == "PermissionError" for f in files), {f: seen[f] for f in files}
        assert seen["uid"] != 0, seen
        # the controls: alice's job wrote its secret there, and the stores are there
        assert open(files[0]).read() == "alice's"
        assert all(os.path.exists(p) for p in stores), stores
        s.call("POST", f"/v1/jobs/{a['id']}/cancel", headers=auth["alice"])
        # a bench's commands run as the tenant: its uid is not 0 (and the control, a
        # command that asks for root, fails)
        for check, state_wanted in (("-ne", "succeeded"), ("-eq", "failed")):
            _, j = s.call("POST", "/v1/jobs/bench",
                          {"command": f"test $(id -u) {check} 0", "runs": 1, "warmup": 0},
                          headers=auth["bob"])
            done = s.wait(j["id"], wait_s=60, headers=auth["bob"])
            assert done["state"] == state_wanted, (check, done)
    finally:
        s.stop()


READER = textwrap.dedent("""
    import json, os, sys
    seen = {"uid": os.getuid()}
    for path in sys.argv[1:]:
        try:
            open(path, "rb").read(1)
            seen[path] = "read"
        except OSError as exc:
            seen[path] = type(exc).__name__
    print("SEEN " + json.dumps(seen))
""")

EVALUATION = {
    "reference": spec(CPU, "kernels.py:reference"), "inputs": spec(CPU, "inputs.py:make"),
    "candidate": {"source": "import numpy as np\n\n\ndef fast(x):\n"
                            "    return x * np.sqrt(x * x + np.float32(1.0))\n",
                  "function": "fast"},
    "cache": "hot", "seeds": 2}
