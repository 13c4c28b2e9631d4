"""krex's one /proc stat parser (krex.enforce.process.TaskStat)."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import reap, wait_for

from krex.enforce.process import TaskStat, task_stat


def test_a_comm_with_parentheses_and_spaces_does_not_shift_the_fields():
    """The comm may hold ') R 1 (' itself: fields are read after its last ')'."""
    tail = " ".join(str(n) for n in range(4, 53))  # fields 4..52 hold their own numbers
    st = TaskStat.parse(f"7 (evil) S 9 9 (x) S {tail}".encode())
    assert st is not None and st.comm == "evil) S 9 9 (x"
    assert (st.state, st.ppid, st.pgrp, st.flags, st.nice, st.start_time, st.processor) == (
        "S", 4, 5, 9, 19, 22, 39)
    assert TaskStat.parse(b"7 (cut) R 1 2 3") is None  # cut short: no fields invented


def test_a_live_process_and_a_thread_read_as_the_kernel_says():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        st = wait_for(lambda: task_stat(child.pid))
        assert st.ppid == os.getpid() and st.state in "SR" and st.comm.startswith("python")
        main = task_stat(child.pid, child.pid)  # its main thread's own file
        assert main is not None and (main.start_time, main.ppid) == (st.start_time, st.ppid)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == st.nice
    finally:
        reap(child)
    assert task_stat(child.pid) is None  # gone (reaped): None, not an error
