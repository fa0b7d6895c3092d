"""The lecture's running example: a deep MLP and its data, seeded so every rank can rebuild them.

CS336 lecture 8 trains `num_layers` square matrices with a GELU after each, on a batch of
random inputs, with the loss "average squared magnitude" of the output. Defaults follow it:
batch 128, hidden 1024, 4 layers. Notebooks 03-05 all start from these two functions.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def make_mlp(hidden: int = 1024, layers: int = 4, seed: int = 0) -> nn.Sequential:
    """`layers` x (Linear(hidden, hidden, no bias) -> GELU), weights ~ N(0, 1/hidden).

    The same seed gives the same weights in every process, whatever the global RNG state.
    """
    for name, value in (("hidden", hidden), ("layers", layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(layers):
        linear = nn.Linear(hidden, hidden, bias=False)
        with torch.no_grad():  # scaled like the lecture's get_init_params
            linear.weight.copy_(torch.randn(hidden, hidden, generator=generator) / math.sqrt(hidden))
        blocks += [linear, nn.GELU()]
    return nn.Sequential(*blocks)


def make_batch(batch: int = 128, hidden: int = 1024, seed: int = 0) -> torch.Tensor:
    """The full batch of inputs, shape (batch, hidden); identical in every process."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    # seed + 1: the inputs must not replay the random stream the weights were drawn from
    return torch.randn(batch, hidden, generator=torch.Generator().manual_seed(seed + 1))


def mlp_loss(output: torch.Tensor) -> torch.Tensor:
    """The lecture's loss: mean of the squared outputs (no labels needed)."""
    return output.square().mean()
