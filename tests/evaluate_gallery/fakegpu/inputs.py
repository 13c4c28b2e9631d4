"""Inputs of the fakegpu gallery (host arrays; the device time is fakegpu's spin kernels)."""

import numpy as np

SHAPES = [(64, 64), (48, 40)]


def make(seed, shape=(64, 64)):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape).astype(np.float32),)
