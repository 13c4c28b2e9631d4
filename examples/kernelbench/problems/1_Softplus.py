"""A KernelBench-format problem: softplus written as two elementwise passes."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.log1p(torch.exp(x))


batch_size, dim = 64, 8192


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
