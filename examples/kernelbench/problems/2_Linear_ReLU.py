"""A KernelBench-format problem with weights: ReLU(x W^T + b), then scaled."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        y = self.linear(x)
        y = torch.relu(y)
        return y * self.scale


batch_size, in_features, out_features, scale = 128, 512, 256, 0.5


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scale]
