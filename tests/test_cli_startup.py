"""The CLI's start-up path: what a client command imports, ``--version``, exit codes.

Speed itself is a benchmark (benchmarks/bench_startup.py, docs/benchmarks.md);
these tests hold the reasons for it: a client command imports only what it
uses, and never the service's optional dependencies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import PY, run_krex

HEAVY = ("rich", "psutil", "numpy", "fastapi", "uvicorn", "starlette", "pydantic", "mcp",
         "prometheus_client", "krex.measure", "krex.daemon", "krex.evaluate", "krex.records",
         "krex.workers.pool", "krex.enforce", "krex.eval", "krex.integrations", "krex.service",
         "krex.cli.bench_cmds", "krex.cli.eval_cmds", "krex.cli.cluster_cmds")


def imported_by(argv: list[str], env: dict[str, str] | None = None,
                heavy_names: tuple[str, ...] = HEAVY) -> tuple[int, set[str]]:
    """Run ``krex ARGV`` through the console script's own entry point in a fresh
    interpreter; its exit code and the heavy modules it imported."""
    code = ("import sys\nfrom krex.cli.main import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "sys.stdout.flush()\nmodules = sorted(sys.modules)\nimport json\n"
            "print('\\nMODULES', json.dumps(modules), file=sys.stderr)\nsys.exit(rc)")
    out = subprocess.run([PY, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                         env=env)
    line = next(ln for ln in out.stderr.splitlines() if ln.startswith("MODULES "))
    modules = set(json.loads(line.removeprefix("MODULES ")))
    heavy = {m for m in modules if m.split(".")[0] in heavy_names
             or m.startswith(heavy_names)}
    return out.returncode, heavy


def test_version_prints_the_installed_version_and_imports_nothing():
    from krex.version import __version__

    out = run_krex("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"krex {__version__}"
    rc, heavy = imported_by(["--version"])
    assert rc == 0 and heavy == set()


def test_help_builds_every_parser_without_the_commands_machinery():
    """``krex --help`` (179 ms, #48) imports each command's module for its parser, not
    the client, the measurement or the experiment those commands use when they run."""
    running = tuple(n for n in HEAVY if not n.startswith("krex.cli."))  # parsers: needed
    rc, heavy = imported_by(["--help"], heavy_names=running + ("krex.client",
                                                               "krex.protocol.messages"))
    assert rc == 0 and heavy == set(), sorted(heavy)
    rc, heavy = imported_by(["demo", "--help"], heavy_names=("argparse",))
    assert rc == 0 and heavy == {"argparse"}  # negative control: the check sees imports


# What the lean path (krex.cli.lean) of a plain `krex exec` / `krex status` must not import:
# argparse, dataclasses (and with it inspect, ast, dis, tokenize), typing, the dataclass
# messages, the full client (ExecRequest/ExecResult dataclasses) — they cost ~40 ms.
LEAN_HEAVY = ("argparse", "dataclasses", "inspect", "typing", "ast", "dis", "tokenize",
              "krex.protocol.messages", "krex.protocol.framing", "krex.client",
              "krex.workers", "krex.cli.output", "krex.cli.job_cmds", "krex.cli.daemon_cmds")


def imported_by_lean(argv: list[str]) -> tuple[int, set[str]]:
    """Like :func:`imported_by`, with :data:`LEAN_HEAVY` counted as heavy too."""
    return imported_by(argv, heavy_names=HEAVY + LEAN_HEAVY)


def test_exec_imports_only_the_lean_client(daemon, tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("print('hi')\n")
    rc, heavy = imported_by_lean(["exec", str(prog)])
    assert rc == 0 and heavy == set(), heavy
    rc, heavy = imported_by_lean(["exec", "--json", "--device", "cpu", "--timeout-s=30",
                                  str(prog), "--an-arg"])
    assert rc == 0 and heavy == set(), heavy


@pytest.mark.parametrize("argv", [["status"], ["status", "--json"]])
def test_status_imports_only_the_lean_client(daemon, argv):
    rc, heavy = imported_by_lean(argv)
    assert rc == 0 and heavy == set(), heavy


# Everything the lean path may import beyond what the interpreter has at start: a new
# module on it (stdlib or krex) fails the test below until it is added here on purpose.
LEAN_ALLOWED = frozenset({
    "krex", "krex.cli", "krex.cli.main", "krex.cli.lean", "krex.version", "krex.lazy",
    "krex.errors", "krex.protocol", "krex.protocol.address", "krex.protocol.liveness",
    "krex.protocol.outcome",  # krex exec --json: the outcome word (no imports)
    "krex.cli.leanjson", "_json",  # not json (re, enum, functools: ~20 ms of every start)
    "_socket",  # not socket.py (its enums, selectors and array: ~3 ms of every start)
    "grp",  # krex.protocol.address: the socket's group
    # what site imported before when krex was installed through setuptools' editable
    # finder (the Makefile installs a plain path entry now): cheap, mostly frozen
    "__future__", "importlib", "importlib._bootstrap", "importlib._bootstrap_external",
    "warnings",
})


def new_modules(argv: list[str]) -> tuple[int, set[str]]:
    """``krex ARGV`` as the console script runs it: its exit code and the modules it
    imported that the interpreter had not at start."""
    code = ("import sys\nbase = set(sys.modules)\nfrom krex.cli.main import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "new = sorted(set(sys.modules) - base)\nimport json\nsys.stdout.flush()\n"
            "print('\\nMODULES', json.dumps(new), file=sys.stderr)\nsys.exit(rc)")
    out = subprocess.run([PY, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    line = next(ln for ln in out.stderr.splitlines() if ln.startswith("MODULES "))
    return out.returncode, set(json.loads(line.removeprefix("MODULES ")))


def test_exec_and_status_import_nothing_outside_the_allow_list(daemon, tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("print('hi')\n")
    for argv in (["exec", str(prog)], ["exec", "--json", "--device", "cpu", str(prog), "-x"],
                 ["status"], ["status", "--json"]):
        rc, new = new_modules(argv)
        assert rc == 0 and new, (argv, rc)
        assert new <= LEAN_ALLOWED, (argv, sorted(new - LEAN_ALLOWED))
    # Negative control: the full parser's path (``--help``) imports far outside it.
    rc, new = new_modules(["exec", "--help"])
    assert rc == 0 and {"argparse", "krex.cli.job_cmds"} <= new - LEAN_ALLOWED, sorted(new)


@pytest.mark.parametrize("argv", [["run", "--", "true"], ["region", "--", "true"]])
def test_client_commands_import_only_what_they_use(daemon, argv):
    rc, heavy = imported_by(argv)
    assert rc == 0, argv
    allowed = {"psutil"} if argv[0] == "run" else set()  # a managed job's process tree
    assert {m for m in heavy if m.split(".")[0] not in allowed} == set(), heavy


def test_the_full_parser_imports_what_the_lean_path_does_not(daemon, tmp_path):
    """Negative control: the tests see an import when there is one (``--help`` and an
    abbreviated flag take the full parser, which imports argparse)."""
    rc, heavy = imported_by_lean(["status", "--help"])
    assert rc == 0 and "argparse" in heavy
    prog = tmp_path / "p.py"
    prog.write_text("import sys\nsys.exit(7)\n")
    rc, heavy = imported_by_lean(["exec", "--dev", "cpu", str(prog)])  # argparse's prefix
    assert rc == 7 and "argparse" in heavy
    assert not heavy & {"rich", "fastapi", "uvicorn", "mcp", "prometheus_client"}


def test_the_lean_path_speaks_the_protocol_of_krex_protocol():
    from krex.cli import lean
    from krex.protocol.framing import MAX_FRAME
    from krex.protocol.messages import VERSION

    assert (lean.VERSION, lean.MAX_FRAME) == (VERSION, MAX_FRAME)


@pytest.mark.parametrize("argv, parsed", [
    (["p.py"], {"program": "p.py", "args": []}),
    (["--json", "--device", "fakegpu:0", "p.py", "--json", "x"],
     {"json_out": True, "device": "fakegpu:0", "program": "p.py", "args": ["--json", "x"]}),
    (["--timeout-s=2.5", "--device=cpu", "p.py"],
     {"timeout_s": 2.5, "device": "cpu", "program": "p.py", "args": []}),
    (["--help"], None), (["--cluster", "ray://x", "p.py"], None), (["--dev", "cpu", "p.py"], None),
    (["--timeout-s", "soon", "p.py"], None), (["--device"], None), ([], None), (["--json"], None),
    (["--", "p.py"], None),
])
def test_the_lean_path_parses_what_the_full_parser_would_or_leaves_it(argv, parsed):
    from krex.cli.lean import _exec_options

    got = _exec_options(argv)
    if parsed is None:
        assert got is None
    else:
        assert got == {"json_out": False, "device": None, "timeout_s": None, **parsed}


def test_the_whole_parser_is_built_for_help_and_a_typo():
    out = run_krex("--help")
    assert out.returncode == 0
    for name in ("exec", "status", "evaluate", "service", "mcp", "serve"):
        assert name in out.stdout
    typo = run_krex("exce", "x.py")
    assert typo.returncode == 2 and "invalid choice" in typo.stderr and "exec" in typo.stderr
    rc, heavy = imported_by(["service", "--help"])
    assert rc == 0 and not heavy & {"fastapi", "uvicorn", "mcp", "prometheus_client"}


@pytest.mark.parametrize("source, code", [
    ("import os\nos._exit(3)\n", 3),  # the worker dies with the program's status
    ("import sys\nsys.exit(4)\n", 4),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", 137),
    ("raise ValueError('x')\n", 1),
])
def test_exec_exits_as_the_program_would_alone(daemon, tmp_path, source, code):
    prog = tmp_path / "p.py"
    prog.write_text(source)
    alone = subprocess.run([sys.executable, str(prog)], capture_output=True, timeout=30)
    out = run_krex("exec", str(prog))
    assert out.returncode == code == (128 + 9 if alone.returncode == -9 else alone.returncode)
    if code == 3:
        assert "krex: error" not in out.stderr  # os._exit(3) is an exit, not an error
        assert "recycled: crashed: exited with status 3" in out.stderr
    if code == 137:
        assert "krex: error: program ended crashed" in out.stderr


def test_exec_json_carries_the_exit_code(daemon, tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("import os\nos._exit(5)\n")
    out = run_krex("exec", "--json", str(prog), env={**os.environ})
    assert out.returncode == 5
    assert json.loads(out.stdout)["exit_code"] == 5


def test_lazy_public_names_resolve_to_the_objects_whatever_was_imported_first():
    """``krex.region`` is the function even when the submodule krex.client.region (of the
    same name) was imported before: a regression the suite caught (`'module' object is
    not callable`)."""
    code = ("import krex.measure.regions, krex.client.region, krex\n"
            "assert callable(krex.region) and krex.region.__module__ == 'krex.client.region'\n"
            "assert isinstance(krex.Region, type) and krex.Client.__name__ == 'Client'\n"
            "from krex import measure, bench, compare, RegionReport, KrexError, evaluate\n"
            "assert callable(measure) and callable(bench) and callable(evaluate)\n")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("command", ["service", "mcp"])
def test_service_commands_without_the_extra_say_how_to_install_it(command, tmp_path):
    """The core install has no FastAPI/mcp: the error names the extra (a hidden module
    stands in for a missing one)."""
    code = ("import sys\nsys.modules['fastapi'] = None\nfrom krex.cli.main import main\n"
            f"sys.exit(main([{command!r}, '--state-dir', {str(tmp_path)!r}]))")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "krex: error:" in out.stderr and "pip install 'krex[server]'" in out.stderr


LEANJSON_CASES = [
    {}, [], "", 0, -1, 2**70, 1.5, -0.0, 1e300, 3.14159e-12, float("nan"), float("inf"),
    float("-inf"), True, False, None, "é ü \u2603 \U0001f600 \x00\n\t\"\\/",
    {"a": [1, 2.5, {"b": None, "c": [True, False, []]}], "d": {}, "e": ""},
    (1, 2, (3,)), {1: "int key", 2.5: "float key", False: "bool", None: "none"},
    {"path": object.__name__, "set": {3}},  # a set: written as its str, as default=str
]


@pytest.mark.parametrize("indent", [None, 2])
def test_leanjson_writes_what_json_writes(indent):
    """The lean path's encoder (krex/cli/leanjson.py) against json.dumps(default=str)
    on edge cases; compact separators when not indented, as the wire uses."""
    from krex.cli import leanjson

    for case in LEANJSON_CASES:
        seps = (",", ":") if indent is None else None
        want = json.dumps(case, indent=indent, default=str, separators=seps)
        assert leanjson.dumps(case, indent=indent) == want, case


def test_leanjson_reads_what_json_reads_and_refuses_what_it_refuses():
    from krex.cli import leanjson

    for case in LEANJSON_CASES[:-2]:
        text = json.dumps(case, indent=2)
        got, want = leanjson.loads(text.encode()), json.loads(text)
        assert json.dumps(got, default=str) == json.dumps(want, default=str), case
    for bad in (b"", b"  ", b"{", b'{"a": 1} x', b"[1,]", b"nul", b'"\\x"', b"\xff"):
        with pytest.raises(ValueError):
            json.loads(bad)  # the control: json refuses it too
        with pytest.raises(ValueError):
            leanjson.loads(bad)


def test_leanjson_round_trips_the_daemons_real_replies(daemon, tmp_path):
    """The daemon's status reply and an exec result, as krex status --json / krex exec
    --json print them through leanjson, parse back to what the full client gets."""
    prog = tmp_path / "p.py"
    prog.write_text("print('hi')\n")
    for argv in (["status", "--json"], ["exec", "--json", str(prog)]):
        out = run_krex(*argv)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout[out.stdout.index("{"):])
        assert isinstance(doc, dict) and doc, out.stdout
