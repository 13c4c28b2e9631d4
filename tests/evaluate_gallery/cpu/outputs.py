"""Outputs that exercise the sealed dispatcher's copy (tests/test_evaluate_dispatch.py)."""

import numpy as np


def nested(x):
    return (x * 2, {"a": x[:2] + 1, "b": 3.5, "c": [None, True, 7]}, (x * 3).T)  # not C order


def raises(x):
    raise ValueError("broken on purpose")


def alias(x):
    return x


def mutate(x):
    x[0, 0] = 99.0
    return x * 2


class ndarray:  # noqa: N801  a lookalike
    __module__ = "numpy"

    def __init__(self, x):
        self.shape, self.dtype, self._x = x.shape, x.dtype, x

    def __array__(self, dtype=None, copy=None):
        return self._x * 2


def lookalike(x):
    return ndarray(x)


class Sub(np.ndarray):
    pass


def subclass(x):
    return (x * 2).view(Sub)


def objects(x):
    return np.array([object(), 1], dtype=object)


def big_int(x):
    return 1 << 80


def slow(x):
    import time

    time.sleep(0.01)
    return x * 2


def segfault(x):
    import ctypes

    return ctypes.string_at(0)
