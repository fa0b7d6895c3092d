"""Tensor parallelism for notebook 07's decoder block (`helpers.models.Block`): Megatron-LM's
layout, attention and MLP alike, over the t ranks of a TP group.

* Attention: the heads are split over the group. Q, K and V are column-parallel (rank r of t
  keeps rows r·h/t … (r+1)·h/t of each weight, i.e. whole heads r·heads/t … (r+1)·heads/t:
  the heads are contiguous column blocks of q, k and v), so `causal_attention` runs on the
  rank's heads/t heads with no communication at all. The output projection is row-parallel:
  its columns for those heads, giving a partial sum of the block's output.
* MLP, as in notebook 04: `up` column-parallel, `down` row-parallel (`tp.ColumnParallelLinear`
  and `tp.RowParallelLinear`).
* Megatron's conjugates: f (identity forward, all-reduce backward) before each attention and
  each MLP, g (all-reduce forward, identity backward) after: 2 all-reduces of a (b, s, h)
  activation per block forward, 2 backward. In attention, one f feeds Q, K and V together:
  three ColumnParallelLinears would each carry their own f, and all-reduce three partial
  input gradients backward where one all-reduce of their sum does.

What stays replicated (every rank of the TP group holds all of it): the two LayerNorms of every
block, the embeddings and the head (final LayerNorm + LM head). On this model they are small
next to the blocks (the LayerNorms are 2·h numbers each; V·h embedding and head weights are
cheap at V = 1024), and replicating them costs no communication. At scale the vocabulary
matrices dominate (V ≈ 50k-250k): Megatron then shards them too, *vocab-parallel* — the
embedding by rows of the vocabulary (each rank looks up the ids in its range, zeros elsewhere,
and an all-reduce sums the pieces), the LM head by columns, with the *vocab-parallel
cross-entropy* trick: never gather the (b, s, V) logits; each rank all-reduces its max and its
Σ exp over its vocabulary slice (and the target's logit from whichever rank owns it), which is
all the softmax's log-normaliser needs.

Why the replicated parameters get identical gradients on every TP rank, with no extra
collective: the residual stream they act on is identical on all ranks (g all-reduced it
forward), and so is the gradient flowing back into it (f's backward all-reduces the partial
input gradients the ranks' weight slices produce). A LayerNorm (or the embedding, or the head)
therefore sees the same input and the same output gradient on every rank and computes the same
parameter gradient (tests check it bit for bit).

Building by sharding: each rank builds the single-process model (`make_transformer`, same seed
everywhere) and keeps its slice of every weight (`tp.my_slice`), so the sharded model computes
exactly the single-process function.
"""
from __future__ import annotations

import torch
from torch import nn

from helpers.checks import check_divisible
from helpers.models import Attention, Block, FeedForward, causal_attention
from helpers.parallel.groups import group_size
from helpers.parallel.tp import ColumnParallelLinear, RowParallelLinear, f, my_slice

# Single-process parameter name (its ending) → the dimension its TP shards cut, of the
# nn.Linear weight (out, in): 0 for column-parallel (output features), 1 for row-parallel.
# Everything else is replicated on the TP group.
SHARDED_DIMS = {"attn.q.weight": 0, "attn.k.weight": 0, "attn.v.weight": 0,
                "attn.out.weight": 1, "mlp.up.weight": 0, "mlp.down.weight": 1}


def shard_dim(name: str) -> int | None:
    """The dimension TP cuts the single-process parameter `name` along, None if replicated."""
    return next((dim for end, dim in SHARDED_DIMS.items() if name.endswith(end)), None)


def check_tensor_degree(t: int, heads: int) -> None:
    """t must divide the heads (each rank keeps whole heads; then it divides h and 4h too)."""
    check_divisible("heads", heads, t, f"each of the t={t} tensor-parallel ranks keeps whole heads")


def _column_slice(linear: nn.Linear, group=None) -> nn.Linear:
    """An nn.Linear holding this rank's rows of `linear`'s weight (no f: the caller has one)."""
    weight = my_slice(linear.weight.detach(), dim=0, group=group)
    with torch.device("meta"):
        shard = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    shard.weight = nn.Parameter(weight)
    return shard


class TensorParallelAttention(nn.Module):
    """f → this rank's heads of Q, K, V → causal attention on them → row-parallel out → g."""

    def __init__(self, attention: Attention, group=None):
        super().__init__()
        t = group_size(group)
        check_tensor_degree(t, attention.heads)
        self.group, self.heads = group, attention.heads // t
        self.q, self.k, self.v = (_column_slice(x, group)
                                  for x in (attention.q, attention.k, attention.v))
        self.out = RowParallelLinear(attention.out, group=group)  # its g ends the block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = f(x, self.group)
        return self.out(causal_attention(self.q(x), self.k(x), self.v(x), self.heads))


def shard_feed_forward(mlp: FeedForward, group=None) -> FeedForward:
    """Notebook 04's pair, in place: `up` column-parallel (its f starts the MLP), `down`
    row-parallel (its g ends it)."""
    mlp.up = ColumnParallelLinear(mlp.up, group=group)
    mlp.down = RowParallelLinear(mlp.down, group=group)
    return mlp


def shard_block(block: Block, group=None) -> Block:
    """This rank's piece of `block`, in place: attention and MLP tensor-parallel over `group`,
    the LayerNorms left whole. Parameter names stay the single-process ones
    (attn.q.weight, mlp.up.weight, attn_norm.weight …), holding slices per `SHARDED_DIMS`."""
    block.attn = TensorParallelAttention(block.attn, group)
    block.mlp = shard_feed_forward(block.mlp, group)
    return block
