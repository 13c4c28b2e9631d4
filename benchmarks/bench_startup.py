"""The CLI's start-up: ``krex exec`` of a trivial program and ``krex status``, end to end.

Agents call ``krex`` once per command, so its start-up is on every command's
path (issue 14: targets ``krex exec`` ≤ 60 ms p50 and ``krex status`` ≤ 60 ms
on ``cpu``).  Each command runs as a fresh process against one private,
warm daemon, interleaved round-robin with ``python -c pass`` (the same
interpreter: the floor no Python CLI can go under) so machine drift hits
every row alike.  With ``--before REF`` the same commands also run from the
tree of git revision REF (extracted with ``git archive``; each tree has its
own daemon, as a client talks only to a daemon of its own installation), so
before and after are measured side by side in one run.

Each command is started as the console script does (``from krex.cli.main
import main; sys.exit(main())``) with ``PYTHONPATH`` naming the tree.

Bytecode: an installed package has its modules compiled (pip does it at
install; Python writes ``__pycache__`` on first import).  This machine sets
``PYTHONDONTWRITEBYTECODE=1``, so without cached bytecode every start
compiles each krex module it imports from source.  By default each tree is
compiled first (``compileall``), as an install would; ``--no-compile``
measures without (the caches a tree already has are removed first).

Writes results/bench_startup.json (atomically, with a format version).
Usage: python benchmarks/bench_startup.py [--runs N] [--before REF] [--no-compile] [--out PATH]
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import subprocess
import sys
import tempfile
import time

from common import stop_process, write_results

from krex.client.autostart import daemon_reachable
from krex.measure import stats
from krex.protocol.address import SOCKET_NAME

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = "import sys\nfrom krex.cli.main import main\nsys.exit(main())"


def extract(ref: str) -> str:
    """The tree of ``ref`` in a temporary directory (krex/_native shared from here)."""
    where = tempfile.mkdtemp(prefix="krex-before-")
    archive = subprocess.run(["git", "archive", ref, "krex"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
    native = os.path.join(ROOT, "krex", "_native")
    if os.path.isdir(native) and not os.path.exists(os.path.join(where, "krex", "_native")):
        os.symlink(native, os.path.join(where, "krex", "_native"))
    return where


def bytecode(tree: str, compiled: bool) -> None:
    """Compile the tree's krex package (as an install would), or remove its caches."""
    package = os.path.join(tree, "krex")
    if compiled:
        compileall.compile_dir(package, quiet=1)
        return
    for where, dirs, _ in os.walk(package):
        if "__pycache__" in dirs:
            shutil.rmtree(os.path.join(where, "__pycache__"), ignore_errors=True)


def start_daemon(tree: str) -> tuple[subprocess.Popen[bytes], str]:
    """``krex serve`` of ``tree`` on a fresh runtime directory (a client talks only to a
    daemon of its own installation); the process and its socket."""
    rt = tempfile.mkdtemp(prefix="krex-bench-startup-")
    env = {**os.environ, "PYTHONPATH": tree}
    env.pop("KREX_SOCKET", None)
    proc = subprocess.Popen([sys.executable, "-m", "krex", "serve", "--runtime-dir", rt],
                            cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    sock = os.path.join(rt, SOCKET_NAME)
    deadline = time.monotonic() + 30
    while not daemon_reachable(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise SystemExit(f"the daemon of {tree} did not start")
        time.sleep(0.02)
    return proc, sock


def variants(trees: dict[str, str], sockets: dict[str, str],
             prog: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (argv, environment); ``--version`` only where the tree has it."""
    out = {"python -c pass": ([sys.executable, "-c", "pass"], dict(os.environ))}
    for label, tree in trees.items():
        env = {**os.environ, "PYTHONPATH": tree, "KREX_SOCKET": sockets[label]}
        krex = [sys.executable, "-c", ENTRY]
        for name, args in (("krex --version", ["--version"]), ("krex exec trivial.py",
                           ["exec", prog]), ("krex status", ["status"]),
                           ("krex status --json", ["status", "--json"])):
            if args == ["--version"] and not once([*krex, *args], env, check=False):
                continue
            out[f"{name} [{label}]"] = ([*krex, *args], env)
    return out


def once(argv: list[str], env: dict[str, str], check: bool = True) -> float:
    """Seconds from start to exit; with ``check=False`` 0.0 where the command failed.
    The working directory is a neutral one: ``python -c`` puts it first on sys.path."""
    t = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          timeout=60, cwd=tempfile.gettempdir())
    elapsed = time.perf_counter() - t
    if done.returncode != 0 and not check:
        return 0.0
    if done.returncode != 0:
        raise SystemExit(f"{argv[3:]} failed ({done.returncode}): {done.stderr.decode()}")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40, help="runs of each command (default 40)")
    ap.add_argument("--before", metavar="REF", help="also run the CLI of git revision REF")
    ap.add_argument("--quick", action="store_true", help="10 runs")
    ap.add_argument("--no-compile", action="store_true",
                    help="no cached bytecode for krex: each start compiles what it imports")
    ap.add_argument("--out", help="results file (default results/bench_startup.json)")
    args = ap.parse_args()
    runs = 10 if args.quick else args.runs
    trees = {"after": ROOT}
    if args.before:
        trees = {"before": extract(args.before), **trees}
    for tree in trees.values():
        bytecode(tree, compiled=not args.no_compile)
    with tempfile.TemporaryDirectory() as tmp:
        prog = os.path.join(tmp, "trivial.py")
        with open(prog, "w") as f:
            f.write("pass\n")
        daemons = {label: start_daemon(tree) for label, tree in trees.items()}
        try:
            rows = variants(trees, {label: d[1] for label, d in daemons.items()}, prog)
            times: dict[str, list[float]] = {name: [] for name in rows}
            for argv, env in rows.values():  # warm up: the pools, the page cache
                once(argv, env)
            for _ in range(runs):
                for name, (argv, env) in rows.items():
                    times[name].append(once(argv, env))
        finally:
            for proc, sock in daemons.values():
                stop_process(proc)
                shutil.rmtree(os.path.dirname(sock), ignore_errors=True)
            if "before" in trees:
                shutil.rmtree(trees["before"], ignore_errors=True)
    table = {}
    for name, xs in times.items():
        q = stats.quantiles(xs, (0.5, 0.95))
        table[name] = {"p50_ms": 1e3 * q["p50"], "p95_ms": 1e3 * q["p95"], "n": len(xs)}
    floor = table["python -c pass"]["p50_ms"]
    print(f"{'command':40} {'p50 ms':>8} {'p95 ms':>8} {'p50 - floor':>12}")
    for name, row in table.items():
        row["p50_over_floor_ms"] = row["p50_ms"] - floor
        print(f"{name:40} {row['p50_ms']:8.1f} {row['p95_ms']:8.1f} "
              f"{row['p50_over_floor_ms']:12.1f}")
    path = write_results("bench_startup", {"runs": runs, "before": args.before,
                                           "bytecode": not args.no_compile,
                                           "commands": table}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
