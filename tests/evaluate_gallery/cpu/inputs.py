"""Inputs of the cpu gallery: one float32 matrix per seed; the second shape is held out."""

import numpy as np

SHAPES = [(256, 512), (96, 200)]


def make(seed, shape=(256, 512)):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape).astype(np.float32),)
