"""Shared by the benchmark scripts: a private daemon, percentiles, atomic results."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from krex.client.autostart import daemon_reachable

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
FORMAT_VERSION = 1


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    xs = sorted(values)
    if not xs:
        return {f"p{q:g}": float("nan") for q in qs}
    out = {}
    for q in qs:
        k = (len(xs) - 1) * q / 100
        lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
        out[f"p{q:g}"] = xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
    return out


def machine() -> dict[str, Any]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write_results(name: str, data: dict[str, Any]) -> str:
    """Write results/<name>.json atomically with a format version and machine description."""
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    doc = {"format": FORMAT_VERSION, "benchmark": name, "machine": machine(),
           "command": " ".join([os.path.basename(sys.executable), *sys.argv]), **data}
    fd, tmp = tempfile.mkstemp(dir=RESULTS, prefix=f".{name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def private_daemon(*args: str) -> Iterator[str]:
    """Start ``krex serve`` on a fresh runtime dir; yield its socket path; stop it."""
    rt = tempfile.mkdtemp(prefix="krex-bench-")
    sock = os.path.join(rt, "krexd.sock")
    proc = subprocess.Popen([sys.executable, "-m", "krex", "serve", "--runtime-dir", rt, *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not daemon_reachable(sock):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("benchmark daemon did not start")
            time.sleep(0.01)
        old = os.environ.get("KREX_SOCKET")
        os.environ["KREX_SOCKET"] = sock
        try:
            yield sock
        finally:
            if old is None:
                os.environ.pop("KREX_SOCKET", None)
            else:
                os.environ["KREX_SOCKET"] = old
    finally:
        stop_process(proc)


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
