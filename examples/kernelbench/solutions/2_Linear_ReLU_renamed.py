"""Wrong: the fused solution with its layer named ``fc``.  No parameter of the
problem's has that name, so it keeps the weights it drew itself -- after its probe
vector, so not the problem's: a solution computes with the problem's weights only
under the problem's names."""

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.register_buffer("probe", torch.randn(in_features))  # drawn before the layer
        self.fc = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        w, b = self.fc.weight * self.scale, self.fc.bias * self.scale
        return torch.addmm(b, x, w.t()).clamp_min_(0)
