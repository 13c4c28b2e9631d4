"""The gallery's kernel: y = x * sqrt(x*x + 1), per element (y(0) = 0), in float32.

``work(x, times)`` does the computation ``times`` times and returns the last
result: the reference does it twice, so honest candidates have known true
speedups (once: 2x, twice: 1x, four times: 0.5x).
"""

import numpy as np


def once(x):
    return x * np.sqrt(x * x + np.float32(1.0))


def work(x, times):
    out = None
    for _ in range(times):
        out = once(x)
    return out


def reference(x):
    return work(x, 2)
