"""The course's models, seeded so every rank can rebuild them, and their one loss.

The running example of notebooks 03-05 is the lecture's (CS336 lecture 8): a deep MLP of
`layers` square matrices with a GELU after each, trained on a batch of random inputs, with the
loss "average squared magnitude" of the output. `MLPConfig` holds its sizes; `LECTURE` is
the lecture's own (b = 128 rows, h = 1024, 4 layers). Data, tensor and pipeline parallelism
all build from `make_mlp` and `make_batch`: DP shards the batch, TP shards every weight,
PP slices the layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from helpers.checks import check_int


@dataclass(frozen=True)
class MLPConfig:
    """Sizes and seed of the running example; every default in the course comes from here."""
    batch: int = 128      # rows of the full batch (the global batch, before any split)
    hidden: int = 1024    # h: every weight is h × h
    layers: int = 4       # Linear + GELU blocks
    seed: int = 0         # weights use it; the batch uses seed + 1

    def __post_init__(self):
        for name in ("batch", "hidden", "layers"):
            check_int(name, getattr(self, name))
        check_int("seed", self.seed, low=0)

    def with_(self, **changes) -> "MLPConfig":
        """A copy with some fields changed (validated like the original)."""
        return replace(self, **changes)

    @property
    def parameters(self) -> int:
        """Ψ, the number of parameters: layers · h²."""
        return self.layers * self.hidden ** 2


LECTURE = MLPConfig()


def make_mlp(config: MLPConfig = LECTURE) -> nn.Sequential:
    """`layers` × (Linear(h, h, no bias) → GELU), weights ~ N(0, 1/h).

    The same config gives the same weights in every process, whatever the global RNG state.
    """
    generator = torch.Generator().manual_seed(config.seed)
    blocks = []
    for _ in range(config.layers):
        linear = nn.Linear(config.hidden, config.hidden, bias=False)
        with torch.no_grad():  # scaled like the lecture's get_init_params
            linear.weight.copy_(torch.randn(config.hidden, config.hidden, generator=generator)
                                / math.sqrt(config.hidden))
        blocks += [linear, nn.GELU()]
    return nn.Sequential(*blocks)


def mlp_layers(model: nn.Sequential, start: int, stop: int) -> nn.Sequential:
    """Blocks [start, stop) of `make_mlp`'s model (each block is Linear + GELU): a pipeline
    stage's share of the layers."""
    return model[2 * start:2 * stop]


def make_batch(config: MLPConfig = LECTURE) -> torch.Tensor:
    """The full batch of inputs, shape (batch, h); identical in every process."""
    # seed + 1: the inputs must not replay the random stream the weights were drawn from
    generator = torch.Generator().manual_seed(config.seed + 1)
    return torch.randn(config.batch, config.hidden, generator=generator)


def mlp_loss(output: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """The lecture's loss: the mean of the squared outputs (no labels needed).

    A rank holding only part of the output passes the full output's `numel`: the pieces
    Σ y² / numel then add up across ranks to the loss of the whole batch.
    """
    return output.square().sum() / (output.numel() if numel is None else numel)
