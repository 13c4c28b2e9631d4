"""fakegpu kernels: the result is computed on the host, the device time is a spin kernel.

The reference "launches" 2 x 400 us; honest candidates launch 400 us (2x), 2 x 400 us (1x)
or 4 x 400 us (0.5x).
"""

import numpy as np
from fg import spin

UNIT_US = 400


def result(x):
    return x * np.float32(2.0) + np.float32(1.0)


def run(x, units):
    for _ in range(units):
        spin(UNIT_US)
    return result(x)


def reference(x):
    return run(x, 2)


def faster(x):
    return run(x, 1)


def same(x):
    return run(x, 2)


def slower(x):
    return run(x, 4)
