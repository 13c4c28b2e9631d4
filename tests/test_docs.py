"""The doc check: every code block in README.md and docs/*.md marked runnable runs.

A block is marked by an HTML comment on the line before its fence (invisible
on GitHub):

    <!-- doc-check: run sh -->        bash -e, in a fresh environment, from the checkout
    <!-- doc-check: run python -->    the venv's python, fresh environment, from the checkout
    <!-- doc-check: skip (why) -->    never run (say why)

"Fresh" means what a newcomer's new shell has: a plain PATH without the venv,
HOME, and a private ``KREX_RUNTIME_DIR`` (so the auto-started daemon is this
block's own; it is stopped afterwards).  A block passes when it exits 0.
Markers may add ``timeout=S`` (default 240) and ``slow``.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import pytest
from helpers import PY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"<!--\s*doc-check:\s*(run|skip)\b(.*?)-->")
FENCE = re.compile(r"^```(\w*)\s*$")
PLAIN_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass
class Block:
    path: str
    line: int
    action: str  # run | skip
    lang: str
    code: str
    timeout_s: float = 240.0
    slow: bool = False

    @property
    def id(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


def blocks_of(path: str) -> list[Block]:
    """Every marked block of one markdown file (a marker must precede a fence)."""
    lines = open(path, encoding="utf-8").read().splitlines()
    out = []
    for i, line in enumerate(lines):
        m = MARKER.search(line)
        if not m:
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None:
            raise ValueError(f"{path}:{i + 1}: doc-check marker not followed by a ``` fence")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        words = m.group(2).split()
        lang = next((w for w in words if w in ("sh", "python")), fence.group(1) or "sh")
        timeout = next((float(w.split("=", 1)[1]) for w in words if w.startswith("timeout=")),
                       240.0)
        out.append(Block(path, i + 2, m.group(1), "python" if lang == "python" else "sh",
                         "\n".join(lines[i + 2:end]) + "\n", timeout, "slow" in words))
    return out


def documents() -> list[str]:
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs",
                                                                           "*.md")))]


def fresh_env(runtime_dir: str) -> dict[str, str]:
    """What a new login shell has, and nothing of this test process's krex settings."""
    return {"PATH": PLAIN_PATH, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
            "TERM": "dumb", "KREX_RUNTIME_DIR": runtime_dir, "KREX_IDLE_EXIT_S": "60"}


def run_block(block: Block, cwd: str = ROOT) -> subprocess.CompletedProcess:
    """Run one block as a newcomer would; stop the daemon it auto-started."""
    runtime = tempfile.mkdtemp(prefix="krex-doc-")
    env = fresh_env(runtime)
    if block.lang == "python":
        argv = [PY, "-"]
    else:
        argv = ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-s"]
    try:
        return subprocess.run(argv, input=block.code, env=env, cwd=cwd, text=True,
                              capture_output=True, timeout=block.timeout_s)
    finally:
        subprocess.run([PY, "-m", "krex", "stop"], env=env, cwd=cwd, capture_output=True,
                       timeout=60)
        shutil.rmtree(runtime, ignore_errors=True)


ALL = [b for doc in documents() for b in blocks_of(doc)]
RUNNABLE = [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else [])
            for b in ALL if b.action == "run"]


@pytest.mark.parametrize("block", RUNNABLE)
def test_runnable_block_runs(block):
    if not os.path.exists(os.path.join(ROOT, ".venv", "bin", "activate")):
        pytest.skip("no .venv in the checkout (run through `make test`)")
    done = run_block(block)
    assert done.returncode == 0, (
        f"{block.id} failed ({done.returncode}):\n{block.code}\n--- stdout\n"
        f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_the_docs_keep_runnable_blocks():
    runnable = {os.path.basename(b.path) for b in ALL if b.action == "run"}
    assert sum(b.action == "run" for b in ALL if b.path.endswith("README.md")) >= 3
    assert {"README.md", "measure.md", "protocol.md", "workers.md"} <= runnable


def test_a_failing_block_fails_the_check(tmp_path):
    doc = tmp_path / "bad.md"
    doc.write_text("text\n<!-- doc-check: run sh -->\n```sh\ntrue\nkrex-no-such-cmd\n"
                   "echo never\n```\n\n<!-- doc-check: run python -->\n```python\n"
                   "import krex\nkrex.measure(lambda: None, device='bogus')\n```\n")
    sh, py = blocks_of(str(doc))
    done = run_block(sh, cwd=str(tmp_path))
    assert done.returncode == 127 and "never" not in done.stdout  # bash -e stops there
    done = run_block(py, cwd=str(tmp_path))
    assert done.returncode == 1 and "UnknownDevice" in done.stderr


def test_a_marker_must_mark_a_block(tmp_path):
    doc = tmp_path / "dangling.md"
    doc.write_text("<!-- doc-check: run sh -->\nnot a fence\n")
    with pytest.raises(ValueError, match="not followed by"):
        blocks_of(str(doc))
