"""torch (CPU) kernels with nested outputs: (softplus(x), {"sum": row sums}) in float32."""

import torch

SHAPES = [(64, 128), (33, 70)]


def make(seed, shape=(64, 128)):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g),)


def reference(x):
    y = torch.log1p(torch.exp(x))
    return y, {"sum": y.sum(dim=1)}


def candidate(x):
    y = torch.nn.functional.softplus(x)
    return y, {"sum": y.sum(dim=1)}


def scribbles(x):
    """A cheat: the right result, then the input overwritten (the next call's work)."""
    out = candidate(x)
    x.zero_()
    return out
