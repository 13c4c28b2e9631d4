"""The sealed call loop on one CPU (krex.evaluate.onecore): pinned, put back, pinned
again after a region's grant moved the threads."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

from krex.evaluate.onecore import OneCore, current_cpu

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_the_driver_and_the_callees_share_one_cpu_and_get_their_masks_back(child):
    before = os.sched_getaffinity(0)
    child_before = os.sched_getaffinity(child)
    assert len(child_before) > 1  # control: not pinned to begin with
    core = OneCore([child])
    cpu = core.pin()
    try:
        assert cpu in before
        assert os.sched_getaffinity(0) == {cpu} == os.sched_getaffinity(child)
        assert current_cpu() == cpu
    finally:
        core.restore()
    assert os.sched_getaffinity(0) == before and os.sched_getaffinity(child) == child_before


def test_a_grant_that_resets_the_masks_is_pinned_again(child):
    everything = os.sched_getaffinity(0)
    core = OneCore([child])

    @contextlib.contextmanager
    def granting(device, **kw):  # a region whose grant moves the threads (cpuset attach)
        for tid in (0, child):
            os.sched_setaffinity(tid, everything)
        yield "region"

    core.pin()
    try:
        with core.region(granting)("cpu") as region:
            assert region == "region"
            assert os.sched_getaffinity(0) == {core.cpu} == os.sched_getaffinity(child)
    finally:
        core.restore()
    assert os.sched_getaffinity(0) == everything


def test_a_callee_already_gone_leaves_the_loop_unpinned(child):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    before = os.sched_getaffinity(0)
    core = OneCore([child, gone.pid])
    assert core.pin() is None
    assert os.sched_getaffinity(0) == before and core.saved == {}
