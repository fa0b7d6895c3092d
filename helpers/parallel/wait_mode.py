"""Wait mode for notebook 07's pipeline stage: every piece of compute waits instead of
computing, and every collective and hop stays real, with its real sizes.

On a laptop with fewer cores than ranks, a rank's compute takes a core from the others, and a
TP all-reduce then waits for a partner the scheduler has not run yet: what a layout costs is
set as much by the scheduler as by the network. A GPU cluster has one processor per rank. Wait
mode gives each rank that: a piece (one block's attention or MLP, the head) sleeps for the time
it took *alone* on one core (`time.sleep` uses no CPU), so the cores are free for whoever is
communicating, and the step's communication costs what the network makes it cost.

`to_wait_mode(stage, ...)` swaps a `Stage`'s modules in place for stand-ins that keep the real
parameters (same names, same shards, so DDP all-reduces the real gradient bytes and the
optimizer steps the real tensors) and the real Megatron f and g around attention and MLP (so
each block makes its 2 + 2 TP all-reduces of the (b, s, h) activation). The values are not
the model's: the stand-ins pass activations through and give zero gradients; a wait-mode step
measures time, not learning.
"""
from __future__ import annotations

import torch
from torch import nn

from helpers.parallel.tp import f, g
from helpers.timing import wait

BACKWARD_SHARE = 2 / 3  # backward ≈ 2 × forward: of a piece's forward + backward, 2/3 is backward


class _Wait(torch.autograd.Function):
    """Wait `forward_s`, pass x on (or zeros of `shape`); backward: wait `backward_s`, pass the
    gradient on (zeros where the shape changed) and give every parameter a zero gradient."""

    @staticmethod
    def forward(ctx, x, shape, forward_s, backward_s, *params):
        ctx.x_shape, ctx.backward_s = x.shape, backward_s
        ctx.params = [(q.shape, q.dtype) for q in params]
        wait(forward_s)
        return x.clone() if shape is None else x.new_zeros(shape)

    @staticmethod
    def backward(ctx, grad):
        wait(ctx.backward_s)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = grad if grad.shape == ctx.x_shape else grad.new_zeros(ctx.x_shape)
        return (dx, None, None, None, *(torch.zeros(s, dtype=t) for s, t in ctx.params))


def waiting(x: torch.Tensor, seconds: float, params, shape=None) -> torch.Tensor:
    """x through a piece whose forward + backward takes `seconds` (a third forward)."""
    return _Wait.apply(x, shape, (1 - BACKWARD_SHARE) * seconds, BACKWARD_SHARE * seconds,
                       *params)


def attention_share(hidden: int, seq: int) -> float:
    """The attention's part of a block's FLOPs: (8·h² + 4·s·h) / (24·h² + 4·s·h) per token
    (Q, K, V, out and the scores against the MLP's 16·h²; `cost.parallel3d.forward_flops`)."""
    return (8 * hidden + 4 * seq) / (24 * hidden + 4 * seq)


class WaitBlock(nn.Module):
    """A TP-sharded `Block` (`tp_transformer.shard_block`) whose attention and MLP wait their
    share of `seconds`, each between Megatron's f and g on `group`, with the residuals."""

    def __init__(self, block: nn.Module, seconds: float, share: float, group=None):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = (
            block.attn_norm, block.attn, block.mlp_norm, block.mlp)
        self.group = group
        self.seconds = (share * seconds, (1 - share) * seconds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for (norm, part), seconds in zip(((self.attn_norm, self.attn), (self.mlp_norm, self.mlp)),
                                         self.seconds):
            y = f(x, self.group)  # all-reduce of the input's gradient, backward
            y = waiting(y, seconds, [*norm.parameters(), *part.parameters()])
            x = x + g(y, self.group)  # all-reduce of the partial output, forward
        return x


class WaitEmbed(nn.Module):
    """The embedding, not a matmul (the cost model counts none): token ids (b, s) → zeros
    (b, s, h) at once, its parameters in the graph for their (zero) gradients."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.tokens, self.positions = embed.tokens, embed.positions

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(*ids.shape, self.tokens.embedding_dim)
        return waiting(x, 0.0, list(self.parameters()))


class WaitHead(nn.Module):
    """The final LayerNorm and LM head: waits `seconds`, gives zero logits (b, s, V)."""

    def __init__(self, head: nn.Module, seconds: float):
        super().__init__()
        self.norm, self.out = head.norm, head.out
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.out.out_features)
        return waiting(x, self.seconds, list(self.parameters()), shape)


def to_wait_mode(stage: nn.Module, block_s: float, head_s: float, config, group=None) -> nn.Module:
    """`stage` (a `parallel3d.Stage`, blocks sharded on `group`) in wait mode, in place: each
    block waits `block_s` per micro-batch forward + backward (split between attention and MLP
    as their FLOPs), the head `head_s`; parameter names unchanged."""
    share = attention_share(config.hidden, config.seq)
    for name, block in stage.blocks.items():
        stage.blocks[name] = WaitBlock(block, block_s, share, group)
    if stage.embed is not None:
        stage.embed = WaitEmbed(stage.embed)
    if stage.head is not None:
        stage.head = WaitHead(stage.head, head_s)
    return stage
