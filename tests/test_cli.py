"""The CLI as users run it: ``python -m krex …``, exit codes and output."""

import json
import os
import subprocess

import psutil
import pytest
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


def test_usage_errors(daemon, tmp_path):
    out = run_krex("run")
    assert out.returncode == 2 and "krex: error: krex run: no command given (hint:" in out.stderr
    out = run_krex("region")
    assert out.returncode == 2 and "krex region -- " in out.stderr  # its own example
    out = run_krex("run", "--device", "tpu", "--", "true")
    assert out.returncode == 1 and "invalid device" in out.stderr
    assert run_krex("frobnicate").returncode == 2


def test_missing_or_unexecutable_commands_exit_like_a_shell(daemon, tmp_path):
    for verb in ("run", "region"):
        out = run_krex(verb, "--", "no-such-command-krex")
        assert out.returncode == 127, (verb, out.stderr)
        assert "command not found" in out.stderr and "protocol.md" not in out.stderr
        assert "Traceback" not in out.stderr
    script = tmp_path / "not_executable"
    script.write_text("#!/bin/sh\n")
    out = run_krex("run", "--", str(script))
    assert out.returncode == 126 and "chmod +x" in out.stderr


def test_run_python_uses_krexs_interpreter_when_paths_python_cannot_import_krex(daemon, tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    plain = fake_bin / "python"  # a python on PATH that cannot import krex
    plain.write_text("#!/bin/sh\nexec /usr/bin/env -u PYTHONPATH python3 -I -S \"$@\"\n")
    plain.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    code = "import krex, sys; print(sys.executable)"
    out = run_krex("run", "--", "python", "-c", code, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == PY and "cannot import krex" in out.stderr
    # negative control: a full path is run as given (and fails to import krex)
    out = run_krex("run", "--", str(plain), "-c", code, env=env)
    assert out.returncode == 1 and "ModuleNotFoundError" in out.stderr
    # the venv's own python on PATH is used as it is, without a note
    venv_env = {**os.environ, "PATH": f"{os.path.dirname(PY)}:{os.environ['PATH']}"}
    out = run_krex("run", "--", "python", "-c", code, env=venv_env)
    assert out.returncode == 0 and out.stderr == ""


def test_run_python_probes_krex_from_where_the_script_will_import(tmp_path, monkeypatch):
    """From a checkout (``./krex`` in the working directory), ``python examples/x.py``
    imports from ``examples/``, not from the working directory: the probe must agree."""
    from krex.client.job import python_for

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    plain = fake_bin / "python"  # cannot import an installed krex, but sees its sys.path[0]
    plain.write_text("#!/bin/sh\nexec /usr/bin/env -u PYTHONPATH /usr/bin/python3 -s \"$@\"\n")
    plain.chmod(0o755)
    checkout = tmp_path / "checkout"
    (checkout / "krex").mkdir(parents=True)
    (checkout / "krex" / "__init__.py").write_text("")
    (checkout / "examples").mkdir()
    (checkout / "examples" / "prog.py").write_text("import krex\n")
    monkeypatch.chdir(checkout)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    argv, note = python_for(["python", "examples/prog.py", "2"], env)
    assert argv[0] == PY and argv[1:] == ["examples/prog.py", "2"]
    assert note is not None and "cannot import krex" in note
    # negative control: with -c the working directory is on sys.path, ./krex is found
    assert python_for(["python", "-c", "import krex"], env) == (["python", "-c", "import krex"],
                                                                None)


def test_bench_gives_the_fields_skill_md_tells_an_agent_to_read(daemon, tmp_path):
    """SKILL.md: "Read `p50_ms`, `p95_ms`, `noise_rel`" — in --json, --export-json and
    the table (the hyperfine fields stay)."""
    exported = tmp_path / "bench.json"
    out = run_krex("bench", "--runs", "3", "--warmup", "0", "--json", "--export-json",
                   str(exported), "--", "true", timeout=120)
    assert out.returncode == 0, out.stderr
    for doc in (json.loads(out.stdout), json.loads(exported.read_text())):
        r = doc["results"][0]
        times_ms = sorted(t * 1e3 for t in r["times"])
        assert r["p50_ms"] == pytest.approx(times_ms[1]) and r["noise_rel"] >= 0, r
        assert times_ms[1] <= r["p95_ms"] <= times_ms[2], r
        assert r["median"] * 1e3 == pytest.approx(r["p50_ms"]), r  # the old field stays
    human = run_krex("bench", "--runs", "2", "--warmup", "0", "--", "true", timeout=120)
    assert human.returncode == 0 and "p95" in human.stdout and "noise" in human.stdout


def test_evaluate_with_a_misspelt_function_is_one_line_naming_the_defined_ones(daemon,
                                                                               tmp_path):
    (tmp_path / "ref.py").write_text("def softmax(x):\n    return x\n")
    (tmp_path / "inputs.py").write_text("def make(seed):\n    return (1.0,)\n")
    out = run_krex("evaluate", "--ref", "ref.py:softmx", "--cand", "ref.py:softmax",
                   "--inputs", "inputs.py:make", cwd=str(tmp_path), timeout=120)
    assert out.returncode == 1, out
    assert out.stderr.startswith("krex: error: reference file") and \
        out.stderr.count("\n") == 1, out.stderr
    assert "did you mean 'softmax'" in out.stderr and "Traceback" not in out.stderr


def test_an_invalid_verdict_prints_no_speed(capsys):
    """SKILL.md: never report an invalid candidate's speed; the console does not either."""
    from krex.cli.evaluate_cmds import _print_evaluation

    timing = {"pairs": 8, "reference": {"median_ms": 2.0}, "candidate": {"median_ms": 0.35},
              "region": {"clean": True}}
    ev = {"id": "abc123", "verdict": "invalid", "speedup": 5.741, "ci_low": 5.5,
          "ci_high": 6.0, "correct": False, "status": "ok", "reused": False, "findings": [],
          "timing": timing}
    _print_evaluation(ev)
    out = capsys.readouterr().out
    assert "verdict invalid" in out and "5.741" not in out and "0.35" not in out, out
    _print_evaluation({**ev, "verdict": "faster", "correct": True})  # negative control
    out = capsys.readouterr().out
    assert "speedup 5.741x" in out and "0.3500" in out, out


def test_region_command_exit_code_and_report(daemon):
    out = run_krex("run", "--", PY, "-m", "krex", "region", "--label", "sh", "--", PY, "-c",
                   "raise SystemExit(3)")
    assert out.returncode == 3
    with daemon.client() as c:
        assert "sh" in [r["label"] for r in c.regions()]


def test_region_says_what_its_region_was_and_help_says_what_it_does(daemon):
    out = run_krex("region", "--label", "said", "--", PY, "-c", "print('inside')")
    assert out.returncode == 0 and out.stdout == "inside\n", out  # stdout is the command's
    line = out.stderr.strip()
    assert line.startswith("krex: region ") and "'said'" in line and "on cpu" in line, line
    assert "waited " in line and "held " in line and ("clean" in line), line
    assert len(out.stderr.splitlines()) == 1, out.stderr
    quiet = run_krex("region", "--quiet", "--", "true")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet  # negative control
    helped = run_krex("region", "--help").stdout
    assert "exclusive" in helped and "one line on stderr" in helped, helped


def test_region_timeout_exits_124(runtime_dir, monkeypatch, tmp_path):
    from helpers import Daemon, krex, reap

    # Without freezing: with it, a process registering during a held region is frozen
    # until the region ends (a latecomer, issue 11) and cannot time out meanwhile.
    d = Daemon(str(runtime_dir), "--freeze", "off").start()
    monkeypatch.setenv("KREX_SOCKET", d.socket)
    holder = krex("run", "--", PY, os.path.join(os.path.dirname(__file__), "jobs",
                                                "hold_forever.py"))
    try:
        assert holder.stdout.readline().strip() == "inside"
        out = run_krex("region", "--timeout-s", "0.2", "--", "true")
        assert out.returncode == 124 and "not granted within" in out.stderr
    finally:
        reap(holder)
        d.stop()


def test_status_json_and_table(daemon):
    out = run_krex("status", "--json")
    assert out.returncode == 0
    st = json.loads(out.stdout)
    assert st["daemon"]["socket"] == daemon.socket
    assert "cpu" in [d["name"] for d in st["devices"]]
    human = run_krex("status")
    assert human.returncode == 0 and "daemon pid" in human.stdout and "cpu" in human.stdout
    assert "cgroup moves: " in human.stdout  # kept warm, or why not


def test_status_says_whether_cgroup_moves_are_kept_warm():
    from krex.cli.lean import _warm_line

    warm = {"state": "warm", "why": "", "hierarchy": "v2", "period_ms": 4.0, "linger_s": 30.0,
            "pings": 250, "slow_pings": 1, "ping_mean_us": 41.2}
    assert _warm_line(warm) == (
        "cgroup moves: kept warm while regions are taken, warm now (250 pings every 4 ms so "
        "far, mean 41.2 µs, 1 waited for a grace period)")
    off = {**warm, "state": "off", "why": "disabled by configuration (--warm-moves-ms 0)"}
    assert _warm_line(off) == ("cgroup moves: not kept warm (disabled by configuration "
                               "(--warm-moves-ms 0))")


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


def test_demo_runs_examples_without_overlap(runtime_dir, monkeypatch):
    """As `make demo` runs it: no daemon running, the demo starts one, and stops it at
    its end (tests/test_demo.py: one already running stays)."""
    monkeypatch.setenv("KREX_RUNTIME_DIR", str(runtime_dir))
    monkeypatch.delenv("KREX_SOCKET", raising=False)
    out = run_krex("demo", "--copies", "1", "--reps", "3", "--json", timeout=180)
    assert out.returncode == 0, out.stderr
    from krex.client.autostart import daemon_reachable

    assert not daemon_reachable(str(runtime_dir / "krexd.sock")), "the demo's daemon stayed"
    summary = json.loads(out.stdout)
    assert summary["overlaps"] == 0
    assert all(j["exit_code"] == 0 and j["regions"] >= 3 for j in summary["jobs"])
    assert len(summary["jobs"]) == 4
    # where each job's time went, from the daemon's accounts (docs/protocol.md)
    assert all(j["waited_total_s"] is not None and j["frozen_s"] is not None
               and j["enforce_total_s"] is not None for j in summary["jobs"]), summary
    assert sum(j["frozen_s"] for j in summary["jobs"]) > 0  # they ran side by side
    # compare_kernels asks for max_time_s=0.3: its regions hold within that plus the slack
    # (docs/measure.md: one ABBA block of pure-Python calls is a few ms here)
    (cmp,) = [j for j in summary["jobs"] if j["job"].startswith("compare_kernels")]
    assert cmp["held_max_s"] <= 0.3 + 0.05 + 0.05, cmp


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


def test_serve_flags_come_from_the_daemon_configuration():
    import dataclasses

    from krex.cli.daemon_cmds import config_from_args
    from krex.cli.main import build_parser
    from krex.daemon.config import DaemonConfig

    parser = build_parser()
    plain = config_from_args(parser.parse_args(["serve"]), DaemonConfig)
    assert dataclasses.replace(plain, runtime_dir="x", socket_path="") == \
        DaemonConfig(runtime_dir="x")  # every default is the configuration's own
    args = parser.parse_args(["serve", "--no-isolate", "--measure-cores", "0,2-3", "--preload",
                              "numpy,torch", "--freeze", "signal", "--idle-exit-s", "5"])
    cfg = config_from_args(args, DaemonConfig)
    assert (cfg.isolate, cfg.measure_cores, cfg.preload) == (False, [0, 2, 3], ["numpy", "torch"])
    assert (cfg.freeze, cfg.idle_exit_s, cfg.gate) == ("signal", 5.0, True)
    helptext = parser._subparsers._group_actions[0].choices["serve"].format_help()
    for f in dataclasses.fields(DaemonConfig):
        if f.metadata["cli"] and not f.metadata["hidden"]:
            flag = f.name.replace("_", "-")
            assert f"--{flag}" in helptext or f"--no-{flag}" in helptext, f.name
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--freeze", "sometimes"])  # choices from the config


def test_serve_refuses_impossible_numbers_with_a_usage_error(tmp_path):
    """Exit 2 and the flag named, no traceback; control: the same command with a valid
    number gets past the check (and fails later, on a runtime dir that is a file)."""
    for flags in (["--keep-jobs", "0"], ["--workers-min", "-1"]):
        out = run_krex("serve", "--runtime-dir", str(tmp_path / "rt"), *flags)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "krex serve:" in out.stderr and flags[0].strip("-").split("-")[0] in out.stderr
    (tmp_path / "file").write_text("")
    out = run_krex("serve", "--runtime-dir", str(tmp_path / "file"), "--keep-jobs", "1")
    assert out.returncode == 1 and "krex serve:" not in out.stderr, out.stderr


def test_flags_follow_a_changed_default():
    """Negative control: the flags restate nothing, so another default shows at once."""
    import argparse
    import dataclasses

    from krex.cli.daemon_cmds import add_config_flags, config_from_args
    from krex.daemon.config import flag

    @dataclasses.dataclass
    class Other:
        max_hold_s: float = dataclasses.field(default=7.5, metadata=flag("hold"))
        isolate: bool = dataclasses.field(default=False, metadata=flag("isolate"))

    p = argparse.ArgumentParser()
    add_config_flags(p, Other)
    assert "(default: 7.5)" in p.format_help() and "--isolate" in p.format_help()
    assert config_from_args(p.parse_args([]), Other) == Other()
    assert config_from_args(p.parse_args(["--isolate"]), Other).isolate is True


def test_client_commands_do_not_import_the_daemon(tmp_path):
    code = ("import sys\nfrom krex.cli.main import main\nrc = main(['stop'])\n"
            "print(rc, sorted(m for m in sys.modules if m.startswith('krex.daemon')))")
    env = {**os.environ, "KREX_RUNTIME_DIR": str(tmp_path)}
    env.pop("KREX_SOCKET", None)
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 []"
    serve = subprocess.run([PY, "-c", "import sys\nfrom krex.cli.main import build_parser\n"
                            "build_parser()\nprint('krex.daemon.config' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert serve.stdout.strip() == "True"  # negative control: serve's flags do import it


def test_one_json_flag_for_every_command_with_a_table():
    from krex.cli.main import build_parser
    from krex.cli.output import JSON_OUTPUT

    sub = build_parser()._subparsers._group_actions[0].choices
    shared = JSON_OUTPUT._actions[0].help
    parsers = [sub[n] for n in ("status", "doctor", "exec", "bench", "demo", "eval")]
    parsers.append(sub["cluster"]._subparsers._group_actions[0].choices["status"])
    for p in parsers:
        action = next(a for a in p._actions if "--json" in a.option_strings)
        assert action.help == shared, p.prog


def test_a_second_installation_is_refused_by_the_handshake_and_sees_the_daemon(daemon, tmp_path):
    import shutil

    import krex as this

    # a second checkout: the same package at another path, with its own native parts
    other = tmp_path / "checkout"
    shutil.copytree(os.path.dirname(this.__file__), other / "krex",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(other)}
    code = "import krex\nwith krex.region(): print('inside')"
    out = run_krex("run", "--", PY, "-c", code, env=env, cwd=tmp_path)  # cwd: not this repo
    assert out.returncode == 1 and "inside" not in out.stdout
    assert "daemon runs krex" in out.stderr and str(other / "krex") in out.stderr
    assert "krex stop" in out.stderr  # what to do
    status = run_krex("status", "--json", env=env, cwd=tmp_path)
    assert status.returncode == 0
    d = json.loads(status.stdout)["daemon"]
    assert d["krex_path"] == os.path.dirname(os.path.realpath(this.__file__))
    assert d["krex_version"] == this.__version__ and d["mismatch"]
    assert "note:" in run_krex("status", env=env, cwd=tmp_path).stdout
    # negative control: this installation uses it
    out = run_krex("run", "--", PY, "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "inside", out.stderr


def test_installation_mismatch_is_judged_on_path_and_version():
    from krex.protocol.installation import installation, mismatch

    mine = installation()
    assert mismatch(dict(mine), mine) is None
    assert "predates" in mismatch({}, mine)
    assert mismatch({**mine, "krex_path": "/elsewhere/krex"}, mine)
    assert mismatch({**mine, "krex_version": "0.0.1"}, mine)


def test_help_shows_defaults_and_every_serve_flag_has_help():
    bench = run_krex("bench", "--help").stdout
    assert "(default: 3)" in bench and "--ignore-failure" in bench and "--export-json" in bench
    serve = run_krex("serve", "--help").stdout
    for flag in ("--drain-timeout-s", "--drain-policy", "--max-hold-s"):
        after = serve.split(flag, 1)[1].split("\n  -", 1)[0]
        assert len(after.split()) > 3, (flag, after)  # more than the metavar: a help text


def test_the_auto_started_daemon_runs_this_krex_whatever_the_cwd(tmp_path):
    """A `krex/` folder in the caller's cwd (a checkout, say) must not become the daemon's
    krex: the client would then refuse its own auto-started daemon as another one's."""
    import shutil

    import krex as this

    shutil.copytree(os.path.dirname(this.__file__), tmp_path / "krex",
                    ignore=shutil.ignore_patterns("__pycache__"))
    here = subprocess.run([PY, "-c", "import krex; print(krex.__file__)"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert here.stdout.startswith(str(tmp_path))  # the hazard is real: -m/-c take the cwd's
    env = {**os.environ, "KREX_RUNTIME_DIR": str(tmp_path / "rt")}
    env.pop("KREX_SOCKET", None)
    script = os.path.join(os.path.dirname(PY), "krex")  # a console script: not the cwd's krex
    try:
        out = subprocess.run([script, "region", "--", "true"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        status = subprocess.run([script, "status", "--json"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=60)
        daemon = json.loads(status.stdout)["daemon"]
        assert daemon["krex_path"] == os.path.dirname(os.path.realpath(this.__file__))
    finally:
        subprocess.run([script, "stop"], cwd=tmp_path, env=env, capture_output=True, timeout=60)


def _eval_daemons(proc: subprocess.Popen) -> list[psutil.Process]:
    """The private daemons (``krex serve``) a running ``krex eval`` started."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for k in kids:
        try:
            if "serve" in k.cmdline():
                out.append(k)
        except psutil.Error:
            pass
    return out


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return f"pid {p.pid} (gone)"


@pytest.mark.slow
def test_eval_stops_its_private_daemons_on_sigterm(tmp_path, monkeypatch):
    monkeypatch.setenv("KREX_RUNTIME_DIR", str(tmp_path / "rt"))
    proc = subprocess.Popen([PY, "-m", "krex", "eval", "--quick", "--device", "cpu", "--out",
                             str(tmp_path / "out")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    daemons: list[psutil.Process] = []
    try:
        daemons = wait_for(lambda: _eval_daemons(proc), timeout_s=120, interval_s=0.05)
        everything = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(15)  # to krex eval alone, as a job runner stopping it would
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 143, out.decode()[-2000:]
        # Control: SIGTERM's default action ends krex eval at once, and these stay.
        gone, alive = psutil.wait_procs(daemons + everything, timeout=30)
        assert not alive, ([_cmdline(p) for p in alive], out.decode()[-2000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        for p in daemons + _eval_daemons(proc):
            try:
                p.kill()
            except psutil.Error:
                pass
