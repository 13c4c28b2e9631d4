"""The CLI as users run it: ``python -m krex …``, exit codes and output."""

import json
import os

import psutil
from helpers import PY, run_krex, wait_for


def test_run_passes_environment_and_exit_code(daemon):
    code = "import os,sys; print(os.environ['KREX_JOB_ID'], os.environ['KREX_DEVICE'], " \
           "os.environ['KREX_SOCKET']); sys.exit(7)"
    out = run_krex("run", "--name", "envcheck", "--", PY, "-c", code)
    assert out.returncode == 7
    job_id, device, sock = out.stdout.split()
    assert int(job_id) > 0 and device == "cpu" and sock == daemon.socket


def test_run_reports_a_signal_death_like_a_shell(daemon):
    out = run_krex("run", "--", PY, "-c", "import os,signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert out.returncode == 128 + 9


def test_run_job_runs_in_its_own_process_group(daemon):
    out = run_krex("run", "--", PY, "-c", "import os; print(os.getpgid(0) == os.getpid())")
    assert out.stdout.strip() == "True"


def test_usage_errors(daemon):
    out = run_krex("run")
    assert out.returncode == 1 and "krex: error: no command given (hint:" in out.stderr
    out = run_krex("run", "--device", "tpu", "--", "true")
    assert out.returncode == 1 and "invalid device" in out.stderr
    out = run_krex("run", "--", "/nonexistent/prog")
    assert out.returncode == 1 and "cannot run" in out.stderr
    assert run_krex("frobnicate").returncode == 2


def test_region_command_exit_code_and_report(daemon):
    out = run_krex("run", "--", PY, "-m", "krex", "region", "--label", "sh", "--", PY, "-c",
                   "raise SystemExit(3)")
    assert out.returncode == 3
    with daemon.client() as c:
        assert "sh" in [r["label"] for r in c.regions()]


def test_region_timeout_exits_124(daemon, tmp_path):
    from helpers import krex, reap

    holder = krex("run", "--", PY, os.path.join(os.path.dirname(__file__), "jobs",
                                                "hold_forever.py"))
    try:
        assert holder.stdout.readline().strip() == "inside"
        out = run_krex("region", "--timeout-s", "0.2", "--", "true")
        assert out.returncode == 124 and "not granted within" in out.stderr
    finally:
        reap(holder)


def test_status_json_and_table(daemon):
    out = run_krex("status", "--json")
    assert out.returncode == 0
    st = json.loads(out.stdout)
    assert st["daemon"]["socket"] == daemon.socket
    assert "cpu" in [d["name"] for d in st["devices"]]
    human = run_krex("status")
    assert human.returncode == 0 and "daemon pid" in human.stdout and "cpu" in human.stdout


def test_doctor_reports_capabilities():
    out = run_krex("doctor", "--json")
    assert out.returncode == 0
    checks = {c["check"]: c for c in json.loads(out.stdout)["checks"]}
    assert "root" in checks and "devices" in checks
    assert checks["freeze: signal"]["ok"]  # always available
    assert "freeze backend chosen" in checks and "isolate: affinity" in checks
    from krex.devices import fakegpu

    if fakegpu.available():
        test = checks["GPU interposer self-test"]
        assert test["ok"] and "cuGetProcAddress 1" in test["detail"], test
    assert run_krex("doctor").returncode == 0


def test_demo_runs_examples_without_overlap(daemon):
    out = run_krex("demo", "--copies", "1", "--reps", "3", "--json", timeout=180)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["overlaps"] == 0
    assert all(j["exit_code"] == 0 and j["regions"] >= 3 for j in summary["jobs"])
    assert len(summary["jobs"]) == 4


def test_serve_refuses_a_second_daemon(daemon):
    out = run_krex("serve", "--runtime-dir", daemon.runtime_dir, timeout=30)
    assert out.returncode == 1 and "already serves" in out.stderr


def test_autostart_then_stop(tmp_path, monkeypatch):
    rt = tmp_path / "auto"
    monkeypatch.delenv("KREX_SOCKET", raising=False)
    monkeypatch.setenv("KREX_RUNTIME_DIR", str(rt))
    out = run_krex("run", "--", PY, "-c", "import krex\nwith krex.region(): print('ok')")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    st = json.loads(run_krex("status", "--json").stdout)
    pid = st["daemon"]["pid"]
    assert psutil.pid_exists(pid)
    stop = run_krex("stop")
    assert stop.returncode == 0 and "stopped" in stop.stdout
    wait_for(lambda: not psutil.pid_exists(pid) or
             psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10)
    assert not os.path.exists(rt / "krexd.sock")
    assert "no daemon running" in run_krex("stop").stdout
