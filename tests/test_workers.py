"""The persistent context pool, without the daemon: clean namespaces, recycling, streaming."""

from __future__ import annotations

import json
import operator
import os
import queue
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers import reap, spawn, wait_for
from workers_support import run, write

from krex.errors import KrexError, WorkerFailed
from krex.workers import ExecRequest, ExecResult, PoolSpec, WorkerPool


@pytest.fixture
def pool():
    # json preloaded: the canary programs overwrite a global of a module the worker keeps
    p = WorkerPool(PoolSpec("cpu", min_workers=1, max_workers=1, preload=["numpy", "json"]))
    p.start()
    yield p
    p.shutdown()


def gone(pid: int) -> bool:
    """Exited and reaped: not running, not a zombie."""
    return not psutil.pid_exists(pid)


DIRTY = """
    import os, sys, signal, random, warnings, builtins
    import numpy as np
    import canary_mod
    canary_mod.VALUE = "dirty"
    X_GLOBAL = 42
    os.chdir("/")
    os.environ["KREX_CANARY"] = "dirty"
    sys.path.insert(0, "/nonexistent-canary")
    sys.argv.append("--dirty")
    signal.signal(signal.SIGUSR1, lambda *a: None)
    random.seed(0); np.random.seed(0)
    warnings.simplefilter("error")
    builtins.krex_canary = True
    os.umask(0o077)
    sys.setrecursionlimit(123456)
    import json; json.dumps = None
    print("dirty done", os.getpid())
"""

CHECK = """
    import os, sys, signal, random, warnings, builtins, json
    import numpy as np
    report = {
        "pid": os.getpid(),
        "global": "X_GLOBAL" in globals(),
        "cwd": os.getcwd(),
        "env": os.environ.get("KREX_CANARY"),
        "path_dirty": "/nonexistent-canary" in sys.path,
        "argv": sys.argv[1:],
        "sigusr1_default": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
        "canary_mod_loaded": "canary_mod" in sys.modules,
        "random": random.random(),
        "np_random": float(np.random.random()),
        "warnings_error": any(f[0] == "error" for f in warnings.filters),
        "builtins": hasattr(builtins, "krex_canary"),
        "umask": os.umask(0o022),
        "recursionlimit": sys.getrecursionlimit(),
        "json_dumps": json.dumps is not None,
    }
    import canary_mod
    report["canary_mod_value"] = canary_mod.VALUE
    print(json.dumps(report))
"""


def test_programs_in_a_row_share_a_worker_but_not_state(pool, tmp_path):
    write(tmp_path, "canary_mod.py", 'VALUE = "clean"\n')
    dirty, check = write(tmp_path, "dirty.py", DIRTY), write(tmp_path, "check.py", CHECK)
    first, out1 = run(pool, dirty)
    assert first.status == "ok", first
    assert not first.recycled, first.recycle_reason
    assert "signals:SIGUSR1" in first.restored and "globals:json.dumps" in first.restored
    seen = []
    for _ in range(2):  # random state must differ between programs too
        result, out = run(pool, check, "a1")
        assert result.status == "ok", out["stderr"]
        seen.append(json.loads(out["stdout"]))
    r = seen[0]
    assert r["pid"] == first.worker_pid == seen[1]["pid"]
    assert r["cwd"] == str(tmp_path) and r["env"] is None and r["argv"] == ["a1"]
    assert not r["global"] and not r["path_dirty"] and r["sigusr1_default"]
    assert not r["canary_mod_loaded"] and r["canary_mod_value"] == "clean"
    assert not r["warnings_error"] and not r["builtins"] and r["json_dumps"]
    assert r["umask"] == 0o022 and r["recursionlimit"] != 123456
    assert r["random"] != random_after_seed_0() and r["random"] != seen[1]["random"]
    assert r["np_random"] != seen[1]["np_random"]


def random_after_seed_0() -> float:
    import random

    return random.Random(0).random()


def test_an_edited_module_is_imported_afresh(pool, tmp_path):
    write(tmp_path, "kernel.py", "VERSION = 1\n")
    prog = write(tmp_path, "prog.py", "import kernel\nprint(kernel.VERSION)\n")
    first, out1 = run(pool, prog)
    write(tmp_path, "kernel.py", "VERSION = 2\n")
    second, out2 = run(pool, prog)
    assert (out1["stdout"], out2["stdout"]) == ("1\n", "2\n")
    assert first.worker_pid == second.worker_pid


def test_exit_codes_and_remote_tracebacks(pool, tmp_path):
    boom = write(tmp_path, "boom.py", "def f():\n    raise ValueError('boom')\nf()\n")
    result, out = run(pool, boom)
    assert (result.status, result.exit_code, result.exception) == ("error", 1, "ValueError: boom")
    assert 'boom.py", line 2, in f' in result.traceback and "ValueError: boom" in out["stderr"]
    assert "runner.py" not in result.traceback
    result, _ = run(pool, write(tmp_path, "ex.py", "import sys\nsys.exit(3)\n"))
    assert (result.status, result.exit_code) == ("error", 3)
    result, _ = run(pool, write(tmp_path, "ok.py", "raise SystemExit(0)\n"))
    assert (result.status, result.exit_code, result.recycled) == ("ok", 0, False)


def test_callable_returns_its_value(pool, tmp_path, monkeypatch):
    result = pool.submit(ExecRequest.for_callable(operator.mul, 6, 7))
    assert result.ok and result.returned() == 42 and result.dispatch_s is not None
    write(tmp_path, "helper_mod.py", "import os\ndef where(x):\n    return os.getcwd(), x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import helper_mod

    req = ExecRequest.for_callable(helper_mod.where, 21)
    req.cwd = str(tmp_path)
    result = pool.submit(req)
    assert result.ok, result.traceback
    assert result.returned() == (str(tmp_path), 42)
    roundtrip = ExecResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert roundtrip == result


def test_output_is_streamed_while_the_program_runs(pool, tmp_path):
    flag = tmp_path / "seen"
    prog = write(tmp_path, "live.py", f"""
        import os, sys, time
        print("early")
        deadline = time.monotonic() + 20
        while not os.path.exists({str(flag)!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("late", os.path.exists({str(flag)!r}), file=sys.stderr)
    """)
    chunks = []

    def on_output(stream: str, text: str) -> None:
        chunks.append((stream, text))
        if "early" in text:
            flag.touch()

    result = pool.submit(ExecRequest.for_path(prog), on_output)
    assert result.ok
    assert chunks[0] == ("stdout", "early\n")
    assert ("stderr", "late True\n") in chunks


def test_leaked_thread_recycles_the_worker(pool, tmp_path):
    prog = write(tmp_path, "thread.py", """
        import threading, time
        threading.Thread(target=time.sleep, args=(60,), name="spinner", daemon=True).start()
    """)
    result, _ = run(pool, prog)
    assert result.status == "ok" and result.recycled
    assert result.recycle_reason == "leaked_thread: spinner"
    wait_for(lambda: gone(result.worker_pid))
    after, _ = run(pool, write(tmp_path, "ok.py", "pass\n"))
    assert after.ok and after.worker_pid != result.worker_pid
    assert pool.status()["recycles"] == {"leaked_thread": 1}


def test_foreground_threads_are_waited_for(pool, tmp_path):
    prog = write(tmp_path, "fg.py", """
        import threading, time
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread done"))).start()
    """)
    result, out = run(pool, prog)
    assert result.ok and not result.recycled and out["stdout"] == "thread done\n"


def test_timeout_kills_and_replaces_the_worker(pool, tmp_path):
    prog = write(tmp_path, "slow.py", "import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    result, out = run(pool, prog, timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    assert (result.status, result.exit_code, result.recycled) == ("timeout", 124, True)
    assert result.recycle_reason.startswith("timeout") and out["stdout"] == "started\n"
    wait_for(lambda: gone(result.worker_pid))
    after, _ = run(pool, write(tmp_path, "ok.py", "pass\n"))
    assert after.ok and after.worker_pid != result.worker_pid


def test_segfault_is_reported_and_the_pool_keeps_serving(pool, tmp_path):
    prog = write(tmp_path, "crash.py", "import ctypes\nprint('before')\nctypes.string_at(0)\n")
    result, out = run(pool, prog)
    assert (result.status, result.exit_code, result.recycled) == ("crashed", 139, True)
    assert "SIGSEGV" in result.exception and result.recycle_reason == "crashed: died from SIGSEGV"
    assert "Segmentation fault" in result.traceback and "crash.py" in result.traceback
    assert out["stdout"] == "before\n"
    wait_for(lambda: gone(result.worker_pid))
    after, _ = run(pool, write(tmp_path, "ok.py", "pass\n"))
    assert after.ok and after.worker_pid != result.worker_pid


def test_leaked_child_process_is_killed_and_the_worker_recycled(pool, tmp_path):
    prog = write(tmp_path, "child.py", """
        import subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(p.pid)
    """)
    result, out = run(pool, prog)
    assert result.ok and result.recycle_reason.startswith("leaked_child_process")
    wait_for(lambda: gone(int(out["stdout"])))


def test_descendants_follow_the_subtree_not_the_whole_machine():
    """The canary finds a program's leftovers from the subtree's own ``children`` files:
    the same PIDs as a scan of every process in /proc (a grandchild included, parents
    first, a zombie left out), without reading the rest of the machine."""
    import subprocess

    from krex.workers import canary

    script = ("import subprocess, sys, time\n"
              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "z = subprocess.Popen(['true'])\n"
              "print(g.pid, z.pid, flush=True)\n"
              "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        grandchild, zombie = map(int, child.stdout.readline().split())
        wait_for(lambda: getattr(canary.task_stat(zombie), "state", None) == "Z")
        walked = canary.descendants(os.getpid())
        assert child.pid in walked and grandchild in walked and zombie not in walked
        assert walked.index(child.pid) < walked.index(grandchild)
        # the child's subtree is still (other fixtures' processes under this one may come
        # and go between two readings of the whole tree)
        assert canary.descendants(child.pid) == canary._scanned_tree(child.pid) == [grandchild]
        assert canary.descendants(2 ** 22 + 7) == []  # no such process: the scan finds none
    finally:
        for pid in canary.descendants(child.pid):
            os.kill(pid, 9)
        child.kill()
        child.wait()


def test_the_snapshot_puts_module_globals_back_and_sees_an_unchanged_heap_in_one_pass():
    """``snapshot.restore``'s globals step: nothing changed -> nothing named (the one flat
    pass); a rebound, an added and a deleted global are named and put back (negative
    controls of the fast path); an added dunder is not the program's change to undo; a
    "module" whose namespace is a class's mappingproxy is judged too."""
    import types

    from krex.workers import snapshot

    mod = types.ModuleType("krex_fake_snap")
    mod.value, mod.gone = [1], "x"

    class Proxy:
        attr = 1

    sys.modules["krex_fake_snap"], sys.modules["krex_fake_snap_proxy"] = mod, Proxy
    try:
        snap = snapshot.take()
        assert snap.bindings is not None and snap.bindings.unchanged()
        assert snapshot._restore_globals(snap) == []
        original = mod.value
        mod.value, mod.added = [1], 2
        del mod.gone
        assert not snap.bindings.unchanged()
        assert sorted(snapshot._restore_globals(snap)) == [
            "krex_fake_snap.added", "krex_fake_snap.gone", "krex_fake_snap.value"]
        assert mod.value is original and mod.gone == "x" and not hasattr(mod, "added")
        mod.__warningregistry__ = {}  # a dunder: not undone, not named
        assert snapshot._restore_globals(snap) == []
        del mod.__warningregistry__
        assert snap.bindings.unchanged()
        Proxy.attr = 2
        assert not snap.bindings.unchanged()
    finally:
        del sys.modules["krex_fake_snap"], sys.modules["krex_fake_snap_proxy"]


def test_taking_a_snapshot_changes_nothing_it_then_compares():
    """A module that warns when a class's ``__module__`` is read (torch's deprecated
    aliases do) and ``__mp_main__`` bound to the program's main (torch's import does):
    a snapshot taken beside them sees an unchanged heap at once.  Before, with torch
    imported, it did not (the warning's ``__warningregistry__`` was added to the
    snapshot module after its namespaces were copied, and ``__mp_main__`` is the
    program's own namespace), and the snapshot test above failed after any torch test
    in the same process."""
    import types
    import warnings

    from krex.workers import snapshot

    class Warns(type):
        def __getattribute__(cls, name):
            if name == "__module__":
                warnings.warn("deprecated alias", FutureWarning, stacklevel=2)
            return super().__getattribute__(name)

    mod = types.ModuleType("krex_fake_deprecated")
    mod.Alias = Warns("Alias", (), {})
    main = types.ModuleType("krex_fake_main")
    sys.modules["krex_fake_deprecated"], sys.modules["__mp_main__"] = mod, main
    registry = vars(snapshot).pop("__warningregistry__", None)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            snap = snapshot.take()
            main.x = 1  # the program's own global
            assert snap.bindings is not None and snap.bindings.changed() == set()
        assert not seen, [str(w.message) for w in seen]  # nor is the program warned
    finally:
        del sys.modules["krex_fake_deprecated"], sys.modules["__mp_main__"]
        if registry is not None:
            vars(snapshot)["__warningregistry__"] = registry


def test_the_snapshot_puts_class_attributes_back():
    """``snapshot.restore``'s classes step: a rebound, an added and a removed attribute of
    a class some module defines are named and put back, past a metaclass that refuses
    (an enum's); negative control: without the step (``classes=None``) the patch stays."""
    import enum
    import json

    from krex.workers import snapshot

    class Colour(enum.Enum):
        RED = 1

    original = json.JSONEncoder.default
    mod = type(sys)("krex_fake_classes")
    mod.Colour, Colour.__module__, Colour.__qualname__ = Colour, "krex_fake_classes", "Colour"
    sys.modules["krex_fake_classes"] = mod
    try:
        snap = snapshot.take()
        assert snapshot._restore_classes(snap) == []
        json.JSONEncoder.default = lambda self, o: "patched"
        json.JSONEncoder.krex_added = 1
        del json.JSONDecoder.decode
        type.__setattr__(Colour, "RED", "patched")  # Colour.RED = ... would be refused
        assert sorted(snapshot._restore_classes(snap)) == [
            "json.decoder.JSONDecoder.decode", "json.encoder.JSONEncoder.default",
            "json.encoder.JSONEncoder.krex_added", "krex_fake_classes.Colour.RED"]
        assert json.JSONEncoder.default is original and Colour.RED.value == 1
        assert not hasattr(json.JSONEncoder, "krex_added") and hasattr(json.JSONDecoder, "decode")
        assert snapshot._restore_classes(snap) == []
        snap.classes = None  # the control
        json.JSONEncoder.default = lambda self, o: "patched"
        snapshot.restore(snap)
        assert json.JSONEncoder.default is not original
    finally:
        json.JSONEncoder.default = original
        del sys.modules["krex_fake_classes"]


def test_a_patched_class_is_put_back_for_the_next_program(pool, tmp_path):
    """One program's class patches never reach the next one in the same worker; a type
    that cannot be put back (an immutable one, changed through its dict) recycles it."""
    patch = write(tmp_path, "patch.py", """
        import json, threading
        json.JSONEncoder.default = lambda self, o: "patched"
        threading.Thread.krex_added = 1
        """)
    result, _ = run(pool, patch)
    assert result.ok and result.recycle_reason is None
    assert "classes:json.encoder.JSONEncoder.default" in result.restored
    check = write(tmp_path, "check.py", """
        import json, os, threading
        print(json.dumps([os.getpid(), json.JSONEncoder.default.__qualname__,
                          hasattr(threading.Thread, "krex_added")]))
        """)
    result, out = run(pool, check)
    assert result.ok and result.recycle_reason is None
    pid, default, added = json.loads(out["stdout"])
    assert default == "JSONEncoder.default" and not added
    immutable = write(tmp_path, "immutable.py", """
        import gc
        import numpy as np
        next(r for r in gc.get_referents(vars(np.ndarray)) if isinstance(r, dict))["krex_x"] = 1
        """)
    result, _ = run(pool, immutable)
    assert result.ok and result.recycle_reason is not None
    assert result.recycle_reason.startswith("restore_failed: classes:numpy.ndarray")
    result, out = run(pool, check)
    assert json.loads(out["stdout"])[0] != pid  # a fresh worker


def test_process_state_that_cannot_be_put_back_recycles(pool, tmp_path):
    result, _ = run(pool, write(tmp_path, "nice.py", "import os\nos.nice(1)\n"))
    assert result.ok and result.recycle_reason == "leaked_state: nice"


def test_krex_modules_are_preloaded_and_a_replaced_one_recycles(pool, tmp_path):
    loaded = write(tmp_path, "loaded.py", """
        import sys
        print(sorted(m for m in ("krex.measure.compare", "krex.evaluate.worker")
                     if m in sys.modules))
        """)
    result, out = run(pool, loaded)
    assert result.ok and result.recycle_reason is None
    assert out["stdout"] == "['krex.evaluate.worker', 'krex.measure.compare']\n"
    # a module global rebound: put back by the snapshot, the worker serves on
    rebind = write(tmp_path, "rebind.py",
                   "import krex.measure.stats as s\ns.median = lambda v: 0.0\n")
    result, _ = run(pool, rebind)
    assert result.ok and result.recycle_reason is None
    # a method of a class replaced: put back by the snapshot's classes step, too
    patch = write(tmp_path, "patch.py", """
        from krex.measure.timers import CpuTimer
        CpuTimer.elapsed_ms = lambda self, p: 1.0
        """)
    result, _ = run(pool, patch)
    assert result.ok and result.recycle_reason is None
    assert "classes:krex.measure.timers.CpuTimer.elapsed_ms" in result.restored
    # a method's code swapped (the snapshot does not reach it): recycled (negative control)
    swap = write(tmp_path, "swap.py", """
        from krex.measure.timers import CpuTimer
        CpuTimer.elapsed_ms.__code__ = (lambda self, p: 1.0).__code__
        """)
    result, _ = run(pool, swap)
    assert result.ok and result.recycle_reason.startswith("krex_modified: ")
    assert "krex.measure.timers.CpuTimer.elapsed_ms" in result.recycle_reason


def test_atexit_handlers_run_when_the_program_ends(pool, tmp_path):
    prog = write(tmp_path, "ae.py", "import atexit\natexit.register(print, 'bye')\nprint('hi')\n")
    result, out = run(pool, prog)
    assert result.ok and out["stdout"] == "hi\nbye\n"
    result, out = run(pool, write(tmp_path, "ok.py", "print('next')\n"))
    assert out["stdout"] == "next\n"


def test_a_worker_serves_at_most_max_programs(tmp_path):
    with WorkerPool(PoolSpec("cpu", max_workers=1, max_programs=2, preload=[])) as p:
        prog = write(tmp_path, "ok.py", "pass\n")
        results = [run(p, prog)[0] for _ in range(3)]
    assert results[0].worker_pid == results[1].worker_pid != results[2].worker_pid
    assert results[1].recycle_reason == "max_programs" and not results[0].recycled


@pytest.mark.parametrize("spare, most", [(0, 2), (1, 3)])
def test_pool_scales_up_with_the_queue_and_down_when_idle(tmp_path, spare, most):
    """Up to ``max_workers`` under a queue, back down to ``min_workers + spare_workers``."""
    spec = PoolSpec("cpu", min_workers=1, max_workers=most, preload=[], idle_shutdown_s=0.3,
                    spare_workers=spare)
    # long enough for a worker to start (numpy and krex's own modules) while the others wait
    prog = write(tmp_path, "wait.py", "import time\ntime.sleep(1.5)\n")
    with WorkerPool(spec) as p:
        results: list[ExecResult] = []
        threads = [threading.Thread(target=lambda: results.append(run(p, prog)[0]))
                   for _ in range(most)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len({r.worker_pid for r in results}) == most
        wait_for(lambda: len(p.status()["workers"]) == 1 + spare, timeout_s=10)
        assert p.status()["recycles"].get("idle_scale_down") == 1
    pids = [r.worker_pid for r in results]
    assert all(gone(pid) for pid in pids)


def test_status_reports_workers_and_missing_preloads():
    spec = PoolSpec("cpu", preload=["json", "krex_no_such_module"])
    with WorkerPool(spec) as p:
        s = p.status()
        pid = s["workers"][0]["pid"]
    assert s["preloaded"] == ["json"] and "krex_no_such_module" in s["missing"]
    assert s["workers"][0]["programs"] == 0 and s["queue_length"] == 0
    assert gone(pid)


def test_a_device_that_cannot_start_is_a_clear_error():
    with pytest.raises(WorkerFailed, match="unknown device kind"):
        WorkerPool(PoolSpec("nosuchdevice:0", preload=[])).start()


class _FailingLauncher:
    """A launcher whose ``prepare`` fails the way the daemon's did when its device server
    would not start: with a KrexError, not an OSError."""

    def prepare(self, index):
        raise KrexError("the fakegpu server did not start", hint="see its stderr")

    def started(self, pid):
        pass

    def exited(self, pid):
        pass


@pytest.mark.timeout(60)
def test_a_launcher_that_fails_is_a_clear_error_not_a_start_in_progress_forever():
    # A pool start thread that died of it left the start counted as in progress: the pool
    # never started another, and `krex eval` waited for its warm workers without end.
    pool = WorkerPool(PoolSpec("cpu", preload=[], start_timeout_s=5), launcher=_FailingLauncher())
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match="fakegpu server did not start"):
        pool.start()
    assert time.monotonic() - t0 < 30
    assert pool.status()["starting"] == 0


FAKEGPU = Path(__file__).resolve().parent.parent / "krex" / "_native"
FAKE_LIBCUDA = FAKEGPU / "fakegpu" / "libcuda.so.1"
FAKE_SERVER = FAKEGPU / "bin" / "krex-fakegpu-server"

POISON = """
    import ctypes, os
    lib = ctypes.CDLL(os.environ["KREX_LIBCUDA"])
    module, fn = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cuModuleLoadData(ctypes.byref(module), b"x") == 0
    assert lib.cuModuleGetFunction(ctypes.byref(fn), module, b"poison") == 0
    lib.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, None, None)
    print("sync", lib.cuCtxSynchronize())
"""


@pytest.fixture
def fakegpu_env(tmp_path):
    """A private fakegpu device server; the environment that points workers at it."""
    if not (FAKE_LIBCUDA.exists() and FAKE_SERVER.exists()):
        pytest.skip("the fakegpu driver is not built (krex/_native/fakegpu/libcuda.so.1)")
    sock = str(tmp_path / "fakegpu.sock")
    server = spawn([str(FAKE_SERVER), sock])
    try:
        wait_for(lambda: os.path.exists(sock) or server.poll() is not None)
        assert server.poll() is None, server.stderr.read()
        yield {"KREX_FAKEGPU_SOCKET": sock, "KREX_LIBCUDA": str(FAKE_LIBCUDA)}
    finally:
        reap(server)


def test_poisoned_fakegpu_context_recycles_the_worker(fakegpu_env, tmp_path):
    with WorkerPool(PoolSpec("fakegpu:0", preload=[]), launcher=_EnvLauncher(fakegpu_env)) as p:
        assert p.status()["context"]["backend"] == "cuda-driver"
        result, out = run(p, write(tmp_path, "poison.py", POISON))
        assert result.ok, out["stderr"]
        assert out["stdout"].startswith("sync ") and out["stdout"] != "sync 0\n"
        assert result.recycled and result.recycle_reason.startswith("device_error: cuCtx")
        wait_for(lambda: gone(result.worker_pid))
        after, _ = run(p, write(tmp_path, "ok.py", "pass\n"))
        assert after.ok and not after.recycled and after.worker_pid != result.worker_pid


class _EnvLauncher:
    def __init__(self, extra: dict[str, str]) -> None:
        self.extra = extra
        self.started_pids: list[int] = []
        self.exited_pids: list[int] = []

    def prepare(self, index):
        return {**os.environ, **self.extra}, None

    def started(self, pid):
        self.started_pids.append(pid)

    def exited(self, pid):
        self.exited_pids.append(pid)


def test_the_worker_is_spawned_not_forked_and_the_launcher_sees_it():
    launcher = _EnvLauncher({})
    with WorkerPool(PoolSpec("cpu", preload=[]), launcher=launcher) as p:
        pid = p.status()["workers"][0]["pid"]
        cmdline = psutil.Process(pid).cmdline()
    assert cmdline[:3] == [sys.executable, "-m", "krex.workers.worker"]
    assert launcher.started_pids == launcher.exited_pids == [pid]


ALLOC = """
import ctypes, sys
lib = ctypes.CDLL("libcuda.so.1")
ptr = ctypes.c_uint64()
rc = lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(sys.argv[1]) << 20))
print("rc", rc)
if rc == 0:
    lib.cuMemFree_v2(ptr)
"""


def test_device_memory_cap_per_worker(tmp_path):
    """A worker's device allocations stop at its cap (fakegpu's driver enforces it)."""
    from krex.devices import fakegpu

    if not fakegpu.available():
        pytest.skip("fakegpu was not built")
    prog = tmp_path / "alloc.py"
    prog.write_text(ALLOC)
    with fakegpu.FakeGpu() as gpu:
        spec = PoolSpec("fakegpu:0", min_workers=1, max_workers=1, preload=[],
                        device_memory_cap_mb=64)
        launcher = _PlainEnvLauncher(gpu.env())
        with WorkerPool(spec, launcher) as pool:
            assert pool.status()["memory_cap"] == {"mb": 64, "enforced_by": "fakegpu driver"}
            seen = []
            for mb in (32, 128, 32):
                req = ExecRequest.for_path(str(prog), [str(mb)], env=gpu.env())
                result = pool.submit(req, lambda s, t: seen.append(t))
                assert result.ok, result.exception
    out = "".join(seen).split()
    assert out == ["rc", "0", "rc", "2", "rc", "0"]  # 2: CUDA_ERROR_OUT_OF_MEMORY


class _PlainEnvLauncher:
    def __init__(self, env):
        self.env = env

    def prepare(self, index):
        return dict(self.env), None

    def started(self, pid):
        pass

    def exited(self, pid):
        pass


@pytest.mark.parametrize("spare", [1, 0])
def test_after_a_crash_the_next_program_finds_a_spare_worker_ready(tmp_path, spare):
    """With a spare, the program after a crash runs on a worker that was ready before the
    crash (no start-up wait); negative control: ``spare_workers=0`` waits for a new one."""
    spec = PoolSpec("cpu", min_workers=1, max_workers=2, preload=[], spare_workers=spare)
    flag = tmp_path / "go"
    crash = write(tmp_path, "crash.py", "import os, sys, time\n"
                  "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.01)\nos._exit(3)\n")
    ok = write(tmp_path, "ok.py", "pass\n")
    with WorkerPool(spec) as p:
        out: list[ExecResult] = []
        t = threading.Thread(target=lambda: out.append(run(p, crash, str(flag))[0]))
        t.start()
        ready = (lambda: sum(not w["busy"] for w in p.status()["workers"]) == 1) if spare \
            else (lambda: p.status()["workers"][0]["busy"])
        wait_for(ready, timeout_s=30)
        crashed_wall_s = time.time()  # the crash comes after the flag: a replacement may
        flag.touch()  # start before this thread sees the result, never before the flag
        t.join(30)
        nxt, _ = run(p, ok)
        started = {w["pid"]: w["started_wall_s"] for w in p.status()["workers"]}
    assert (out[0].status, out[0].exit_code) == ("crashed", 3)  # as `python crash.py` exits
    assert nxt.status == "ok"
    assert (started[nxt.worker_pid] < crashed_wall_s) is bool(spare), (started, crashed_wall_s)


class _LateEvents(queue.Queue):
    """A worker's event queue as a starved IO thread fills it: control messages (the
    ``done``) come at once, everything read from the program's pipes ``hold_s`` late and
    in order (an ``eof`` never overtakes the output before it, as with the real thread)."""

    def __init__(self, hold_s: float) -> None:
        super().__init__()
        self.hold_s, self.held, self.timer = hold_s, [], None
        self.lock = threading.Lock()

    def put(self, item, block=True, timeout=None):
        if item[0] == "msg":
            return super().put(item, block, timeout)
        with self.lock:
            self.held.append(item)
            if self.timer is None:
                self.timer = threading.Timer(self.hold_s, self._release)
                self.timer.daemon = True
                self.timer.start()
        return None

    def _release(self) -> None:
        with self.lock:  # puts wait: a later batch cannot overtake this one
            for item in self.held:
                super().put(item)
            self.held, self.timer = [], None


@pytest.mark.parametrize("wait_s", [0.05, None])
def test_output_that_comes_late_is_waited_for_or_said_to_be_missing(tmp_path, monkeypatch,
                                                                    wait_s):
    """The worker's IO thread may reach the program's last output after the pool has its
    ``done`` (a starved thread on a loaded machine; here: everything from the program's
    pipes comes 0.3 s late, in order).  The pool waits for the end-of-output sentinels;
    when they do not come in time, the result says its output may be incomplete (on
    stderr), never silently short.  Control: with the default wait the whole output
    arrives."""
    from krex.workers import execution
    from krex.workers.process import WorkerProcess

    if wait_s is not None:
        monkeypatch.setattr(execution, "_SYNC_WAIT_S", wait_s)
    init = WorkerProcess.__init__

    def late_events(self, *args, **kw):  # the worker writes nothing before its init message
        init(self, *args, **kw)
        early, self.events = self.events, _LateEvents(0.3)
        while not early.empty():
            self.events.put(early.get_nowait())

    monkeypatch.setattr(WorkerProcess, "__init__", late_events)
    p = WorkerPool(PoolSpec("cpu", min_workers=1, max_workers=1))
    try:
        prog = write(tmp_path, "token.py", 'print("token-42")\n')
        result, out = run(p, prog)
    finally:
        p.shutdown()
    assert result.ok, result
    if wait_s is None:
        assert out["stdout"].strip() == "token-42", (out, result)
        assert execution.INCOMPLETE not in out["stderr"], out
    else:  # the output came after this wait: the result says so
        assert execution.INCOMPLETE in out["stderr"], out
