"""krex on a local two-node Ray cluster (loopback only): routing, regions, lost daemons.

One Ray cluster for the module (head + one worker node, each a krex node with its
own daemon on ``cpu``).  Ray's processes are children of this test process;
they are registered as infrastructure while the cluster runs and must all be gone
after it shuts down.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'krex[ray]')")

from helpers import INFRASTRUCTURE, descendants, reap  # noqa: E402

import krex.ray  # noqa: E402
from krex.integrations.ray.local import LocalCluster  # noqa: E402

pytestmark = pytest.mark.timeout(180)

PROGRAM = '''"""A benchmarking program for tests/test_ray.py: work, a region, its own timestamps."""

import os
import sys
import time

import krex
import krex.ray

outside_ms, inside_ms = float(sys.argv[1]), float(sys.argv[2])


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


spin(outside_ms)
with krex.region(label="timed"):
    entered = time.monotonic_ns()
    spin(inside_ms)
    left = time.monotonic_ns()
print(f"program {sys.argv[3]} done")
krex.ray.emit({"index": int(sys.argv[3]), "pid": os.getpid(), "entered_ns": entered,
               "left_ns": left, "socket": os.environ.get("KREX_SOCKET")})
'''


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("krex-ray")
    before = {p.pid for p in descendants()}
    lc = LocalCluster(2, cpus_per_node=1, serve_args=["--no-isolate"], root=str(root / "rt"))
    infra: set[int] = set()
    try:
        lc.start()
        infra = {p.pid for p in psutil.Process().children() if p.pid not in before}
        INFRASTRUCTURE.update(infra)
        prog = root / "timed_region.py"
        prog.write_text(PROGRAM)
        yield lc, str(prog)
    finally:
        lc.close()
        INFRASTRUCTURE.difference_update(infra)
        _assert_gone([p for p in descendants() if p.pid not in before])


def _assert_gone(procs: list[psutil.Process], timeout_s: float = 15.0) -> None:
    """Every process must exit by itself; reap (and report) any that does not."""
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    alive = [p for p in alive if _running(p)]
    for p in alive:
        reap(p)
    assert not alive, f"left running: {[p.pid for p in alive]}"


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _programs(prog: str, n: int, outside_ms: float, inside_ms: float) -> list:
    return [(prog, [outside_ms, inside_ms, i]) for i in range(n)]


def _assert_no_overlap(intervals: list[tuple[int, int]], what: str) -> None:
    intervals = sorted(intervals)
    for (a0, a1), (b0, b1) in zip(intervals, intervals[1:], strict=False):
        assert b0 >= a1, f"{what}: regions overlap: [{a0}, {a1}] and [{b0}, {b1}]"


def _by_node(results: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in results:
        out.setdefault(r["node_id"], []).append(r)
    return out


def test_forty_programs_over_two_nodes(cluster):
    lc, prog = cluster
    results = ray.get(krex.ray.map(_programs(prog, 40, 20, 5)), timeout=120)

    assert len(results) == 40
    assert all(r["status"] == "ok" for r in results), [r["exception"] for r in results]
    assert sorted(r["returned"]["index"] for r in results) == list(range(40))
    assert all(r["stdout"] == f"program {r['returned']['index']} done\n" for r in results)
    by_node = _by_node(results)
    assert set(by_node) == {info["node_id"] for info in lc.infos}, "both nodes must serve"
    sockets = {n: {r["returned"]["socket"] for r in rs} for n, rs in by_node.items()}
    assert all(len(s) == 1 for s in sockets.values()), sockets
    assert len(set.union(*sockets.values())) == 2, "each node runs its own daemon"

    for node_id, rs in by_node.items():
        own = [(r["returned"]["entered_ns"], r["returned"]["left_ns"]) for r in rs]
        _assert_no_overlap(own, f"node {node_id[:8]} (programs' own clocks)")
        for r in rs:
            assert [g["label"] for g in r["regions"]] == ["timed"], (r["regions"], r["timings"])

    records = krex.ray.regions()
    for node_id, regions in records.items():
        timed = [g for g in regions if g["label"] == "timed"]
        assert len(timed) >= len(by_node[node_id])
        _assert_no_overlap([(g["granted_mono_s"], g["granted_mono_s"] + g["held_s"])
                            for g in timed], f"node {node_id[:8]} (daemon records)")


def test_killed_daemon_loses_only_its_programs(cluster):
    lc, prog = cluster
    victim = lc.infos[1]["node_id"]
    handle = krex.ray.node_actors()[victim]
    pid = ray.get(handle.daemon_pid.remote())
    kids = psutil.Process(pid).children(recursive=True)
    # programs of 0.3 s: the two or so in flight when the counters are read are still
    # running in the daemon at the kill (with 30 ms ones, on a loaded machine, they had
    # finished by then and none was lost)
    refs = krex.ray.map(_programs(prog, 40, 300, 10))
    pending, on_victim = refs, 0
    while pending and on_victim < 2:  # the victim has run programs: its daemon is in use
        ready, pending = ray.wait(pending, num_returns=1, timeout=60)
        assert ready, "no program finished within 60 s"
        on_victim += ray.get(ready[0])["node_id"] == victim
    counters = ray.get(handle.info.remote())["counters"]
    assert counters["inflight"] > 0, f"the victim ran all its programs already: {counters}"
    os.kill(pid, signal.SIGKILL)
    results = ray.get(refs, timeout=120)

    lost = [r for r in results if r["status"] == "lost"]
    assert lost, ("the kill happened while programs were in flight: some must be lost",
                  counters, [(r["status"], r["node_id"] == victim, r["exception"])
                             for r in results])
    for r in lost:
        assert r["node_id"] == victim and r["outcome"] == "unknown"
        assert r["lost"]["what"] == "daemon" and str(pid) in r["lost"]["reason"]
    assert all(r["status"] == "ok" for r in results if r["status"] != "lost")
    assert len(results) == 40
    survivor = [r for r in results if r["node_id"] != victim]
    assert survivor and all(r["status"] == "ok" for r in survivor)

    after = ray.get(krex.ray.map(_programs(prog, 6, 1, 1)), timeout=60)
    assert all(r["status"] == "ok" for r in after)
    restarted = {r["daemon_pid"] for r in after if r["node_id"] == victim}
    assert pid not in restarted
    _assert_gone(kids)


def test_cluster_status_and_cli_exec(cluster):
    lc, prog = cluster
    nodes = krex.ray.status()
    assert {n["node_id"] for n in nodes} == {i["node_id"] for i in lc.infos}
    for n in nodes:
        assert "cpu" in n["devices"] and n["daemon"]["daemon"]["pid"] == n["daemon_pid"]
        assert n["daemon"]["pools"]["cpu"]["workers"], "each node keeps warm workers"

    from helpers import run_krex

    done = run_krex("exec", "--cluster", lc.address, "--json", prog, "1", "1", "7", timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "program 7 done" in done.stdout
    assert '"status": "ok"' in done.stdout


def test_cluster_status_from_another_shell_needs_the_token_and_says_so(cluster):
    import time

    from helpers import run_krex

    lc, _ = cluster
    shell = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # without the cluster's token: a krex error within the connect timeout, not a hang
    # (3 s: Ray retries until it, so the test waited out all of a 10 s one)
    t0 = time.monotonic()
    out = run_krex("cluster", "status", "--address", lc.address, "--connect-timeout-s", "3",
                   env=shell, timeout=60)
    assert out.returncode == 1 and time.monotonic() - t0 < 40
    assert "krex: error: Ray did not connect" in out.stderr and "RAY_AUTH_TOKEN" in out.stderr
    assert "Traceback" not in out.stderr
    # with what LocalCluster.shell_env() says another shell needs: it works
    out = run_krex("cluster", "status", "--json", env={**shell, **lc.shell_env()}, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "export RAY_AUTH_TOKEN=" in lc.shell_exports()


def test_a_wrong_address_fails_at_once():
    from helpers import run_krex

    out = run_krex("cluster", "status", "--address", "127.0.0.1:9", timeout=30)
    assert out.returncode == 1 and "no Ray cluster answers at 127.0.0.1:9" in out.stderr
