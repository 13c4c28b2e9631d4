"""Honest candidates with known true speedups over kernels.reference."""

from kernels import work


def faster(x):  # true speedup 2
    return work(x, 1)


def same(x):  # true speedup 1
    return work(x, 2)


def slower(x):  # true speedup 0.5
    return work(x, 4)
