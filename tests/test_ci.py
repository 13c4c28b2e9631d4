"""CI runs the README's test command and the lint, and fails when either fails."""

import os
import subprocess

import pytest
from helpers import REPO

FAKE_MAKE = """#!/bin/sh
echo "$@" >> "$MAKE_LOG"
case "$1" in test) exit "$TEST_RC";; lint) exit "$LINT_RC";; esac
"""


@pytest.mark.parametrize("test_rc,lint_rc,ok", [(0, 0, True), (1, 0, False), (0, 2, False)])
def test_ci_runs_make_test_then_make_lint(tmp_path, test_rc, lint_rc, ok):
    (tmp_path / "make").write_text(FAKE_MAKE)
    (tmp_path / "make").chmod(0o755)
    # .ci/run's best-effort browser step installs Chromium where it is missing (apt, up
    # to minutes): a stand-in on PATH skips it, as on a machine that has one
    (tmp_path / "chromium").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "chromium").chmod(0o755)
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "MAKE_LOG": str(log),
           "TEST_RC": str(test_rc), "LINT_RC": str(lint_rc)}
    done = subprocess.run([os.path.join(REPO, ".ci", "run")], env=env, timeout=30)
    assert log.read_text().split() == ["test", "lint"]  # both run, whatever the first gave
    assert (done.returncode == 0) is ok


def test_make_test_fails_when_pytest_collects_nothing():
    """The Makefile turns pytest's exit 5 (no tests collected) into a failure."""
    makefile = open(os.path.join(REPO, "Makefile")).read()
    assert "if [ $$rc -eq 5 ]" in makefile and "exit 1" in makefile


def test_lint_runs_ruff_and_mypy():
    lint = subprocess.run(["make", "-n", "lint"], cwd=REPO, capture_output=True, text=True,
                          timeout=30).stdout
    assert "ruff check krex tests benchmarks" in lint and "mypy" in lint


def test_make_test_prints_skip_reasons():
    """CI's log says why each skipped test was skipped (pytest -rs)."""
    test = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True,
                          timeout=30).stdout
    assert "pytest -q -rs" in test
