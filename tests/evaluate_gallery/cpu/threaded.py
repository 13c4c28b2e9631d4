"""A correct candidate whose module keeps an idle thread alive: on cpu the return probe
must still watch it (tests/test_evaluate.py)."""

import threading

from kernels import work

_never = threading.Event()
threading.Thread(target=_never.wait, daemon=True, name="idle").start()


def faster(x):  # true speedup 2
    return work(x, 1)
