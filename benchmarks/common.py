"""Shared by the benchmark scripts: a private daemon, atomic results, markdown tables.

Quantiles and inflation readings come from :mod:`krex.measure.stats` (one definition).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from krex import resultfile
from krex.client.autostart import spawn_daemon
from krex.protocol.address import SOCKET_NAME

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
FORMAT_VERSION = 1


def machine() -> dict[str, Any]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write_results(name: str, data: dict[str, Any], path: str | None = None) -> str:
    """Write results/<name>.json (or ``path``) atomically with a format version and the
    machine description (:mod:`krex.resultfile`)."""
    path = path or os.path.join(RESULTS, f"{name}.json")
    doc = {"benchmark": name, "machine": machine(),
           "command": " ".join([os.path.basename(sys.executable), *sys.argv]), **data}
    return resultfile.write(path, doc, format=FORMAT_VERSION, indent=2)


@contextlib.contextmanager
def private_daemon(*args: str) -> Iterator[str]:
    """Start ``krex serve`` on a fresh runtime dir; yield its socket path; stop it."""
    rt = tempfile.mkdtemp(prefix="krex-bench-")
    proc = spawn_daemon(rt, [*args, "--exit-with", str(os.getpid())], new_session=False)
    sock = os.path.join(rt, SOCKET_NAME)
    try:
        old = os.environ.get("KREX_SOCKET")
        os.environ["KREX_SOCKET"] = sock
        try:
            yield sock
        finally:
            if old is None:
                os.environ.pop("KREX_SOCKET", None)
            else:
                os.environ["KREX_SOCKET"] = old
    except BaseException:
        stop_process(proc)  # its runtime dir (daemon.log) is kept for a look
        print(f"daemon runtime dir kept: {rt}", file=sys.stderr)
        raise
    stop_process(proc)
    shutil.rmtree(rt, ignore_errors=True)


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 15.0) -> None:
    """Terminate, then kill after ``timeout_s``; always reaped."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def md_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
