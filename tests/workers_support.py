"""Programs for a worker pool (no tests here): write one, run it, collect its output."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from krex.workers import ExecRequest, ExecResult, WorkerPool


def write(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def run(pool: WorkerPool, path: str, *args: str, **kw) -> tuple[ExecResult, dict[str, str]]:
    out = {"stdout": "", "stderr": ""}

    def collect(stream: str, text: str) -> None:
        out[stream] += text

    req = ExecRequest.for_path(path, list(args), cwd=os.path.dirname(path), **kw)
    return pool.submit(req, collect), out
