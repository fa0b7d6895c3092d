"""The course's models, seeded so every rank can rebuild them, and their one loss.

The running example of notebooks 03-05 is the lecture's (CS336 lecture 8): a deep MLP of
`layers` square matrices with a GELU after each, trained on a batch of random inputs, with the
loss "average squared magnitude" of the output. `MLPConfig` holds its sizes; `LECTURE` is
the lecture's own (b = 128 rows, h = 1024, 4 layers); every configuration lives in
`helpers.configs`, torch-free. Data, tensor and pipeline parallelism
all build from `make_mlp` and `make_batch`: DP shards the batch, TP shards every weight,
PP slices the layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers.checks import check_divisible
from helpers.configs import LECTURE, MOE, TRANSFORMER, MLPConfig, MoEConfig, TransformerConfig
from helpers.cost.experts import capacity as expert_capacity
from helpers.cost.parallel3d import TransformerFlops, forward_flops


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


# ----------------------------------------------------------------------------------------
# Notebook 07's model: a small GPT-style decoder, for 3-D (data × tensor × pipeline) parallelism.
# ----------------------------------------------------------------------------------------
#
# Built to be cut up: `embed` (token + position), `blocks` (an nn.ModuleList a pipeline slices
# into stages), `head` (final LayerNorm + LM head). Inside a block every matmul is its own
# nn.Linear with a name (attn.q/k/v/out, mlp.up/down), so tensor parallelism can swap Q, K, V
# and `up` for column-parallel Linears and `out` and `down` for row-parallel ones, and call
# `causal_attention` on its local heads.


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal multi-head attention: (b, s, heads·d) queries, keys, values → (b, s, heads·d).

    Heads are independent, so a tensor-parallel rank calls this on its own slice of the
    columns with `heads // t` heads and gets its slice of the output.
    """
    b, s, width = q.shape

    def split(x):  # (b, s, heads·d) → (b, heads, s, d)
        return x.view(b, s, heads, width // heads).transpose(1, 2)

    out = nn.functional.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
    return out.transpose(1, 2).reshape(b, s, width)


# No biases in the block's Linears: a row-parallel Linear would have to add its bias once
# after the all-reduce rather than on each of the t ranks; without them every Linear is one
# matmul that splits cleanly.
class Attention(nn.Module):
    """Separate Q, K, V Linears (not one fused QKV): column-splitting each of them hands a TP
    rank whole heads of q, k and v, with no re-interleaving of a fused weight."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        h = config.hidden
        self.heads = config.heads
        self.q, self.k, self.v = (nn.Linear(h, h, bias=False) for _ in range(3))
        self.out = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(causal_attention(self.q(x), self.k(x), self.v(x), self.heads))


class FeedForward(nn.Module):
    """h → 4h → GELU → h."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden, 4 * config.hidden, bias=False)
        self.down = nn.Linear(4 * config.hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden)
        self.attn = Attention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Embed(nn.Module):
    """Token ids (b, s') → token embedding + learned position embedding (b, s', h), s' ≤ s."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.hidden)
        self.positions = nn.Embedding(config.seq, config.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        where = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(where)


class Head(nn.Module):
    """Final LayerNorm and the LM head, (b, s, h) → logits (b, s, V).

    Untied from the token embedding: tying would make the first and the last pipeline stage
    share one weight (its gradient summed across them every step) and force the embedding
    into the head's tensor-parallel split; untied, each stage and each split owns its weights.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden)
        self.out = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class Transformer(nn.Module):
    """embed → blocks[0] … blocks[L−1] → head."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.embed = Embed(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.head = Head(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_transformer(config: TransformerConfig = TRANSFORMER) -> Transformer:
    """The decoder with GPT-2's initialisation, drawn from `config.seed` alone.

    Every weight matrix and embedding ~ N(0, 0.02²), the two projections that write into the
    residual stream (attn.out, mlp.down) scaled by 1/√(2L); LayerNorms start at 1 and 0. The
    same config gives the same weights in every process, and the global RNG is not touched
    (the modules are built on the meta device, then filled in a fixed order).
    """
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(config.seed)
    residual = 0.02 / math.sqrt(2 * config.layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                std = residual if name.endswith(("attn.out.weight", "mlp.down.weight")) else 0.02
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


class Tokens(NamedTuple):
    """A batch of token ids: `inputs` (batch, s) and `targets`, the same sequences shifted by
    one (targets[:, i] is the token after inputs[:, i])."""
    inputs: torch.Tensor
    targets: torch.Tensor


def make_tokens(config: TransformerConfig = TRANSFORMER) -> Tokens:
    """The full batch of uniformly random token ids; identical in every process."""
    # seed + 1: the tokens must not replay the random stream the weights were drawn from
    generator = torch.Generator().manual_seed(config.seed + 1)
    ids = torch.randint(config.vocab, (config.batch, config.seq + 1), generator=generator)
    return Tokens(ids[:, :-1], ids[:, 1:])


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """Next-token cross-entropy, the mean over tokens of −log softmax(logits)[target].

    A rank holding only some of the tokens (a DP shard, a micro-batch) passes the whole batch's
    token count as `numel`: the pieces Σ CE / numel then add up to the loss of the whole batch.
    At initialisation the loss is about ln V (the logits are near zero, every token equally likely).
    """
    total = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                        targets.reshape(-1), reduction="sum")
    return total / (targets.numel() if numel is None else numel)


def transformer_flops(config: TransformerConfig = TRANSFORMER) -> TransformerFlops:
    """Forward FLOPs per step of `make_transformer(config)` on `make_tokens(config)`: the
    formula lives in `helpers.cost.parallel3d` (arithmetic only, no torch)."""
    return forward_flops(tokens=config.tokens, hidden=config.hidden, seq=config.seq,
                         vocab=config.vocab, layers=config.layers)


# ----------------------------------------------------------------------------------------
# Notebook 09's mixture-of-experts MLP: the one-process layer expert parallelism reproduces,
# and `make_moe_transformer`, notebook 07's decoder with an MoE layer in every block.
# ----------------------------------------------------------------------------------------
#
# A router (one Linear h → E) scores every token against E experts (each a FeedForward,
# h → 4h → h); the token goes to its top-k experts and its output is their outputs weighted by
# the router's probabilities (renormalised over the k chosen when k > 1, as GShard does).
# An expert takes at most `capacity` token slots per group of tokens (Switch Transformer's
# capacity factor); the slots beyond it are *dropped*: that expert contributes nothing to the
# token (in a transformer block the residual connection still carries it). The queue is
# GShard's: every token's first choice before any second choice, tokens in order within one.
# `groups` cuts the tokens into groups with a capacity each (GShard's G): an expert-parallel
# rank routes its own tokens with its own capacity, so the one-process layer with groups = e
# makes exactly the same choices as e ranks.


class Routing(NamedTuple):
    """The router's decisions for one group of n tokens (k = top-k, E experts)."""
    expert: torch.Tensor     # (n, k) chosen experts, best first
    gate: torch.Tensor       # (n, k) their weights (differentiable)
    keep: torch.Tensor       # (n, k) bool: the slot fits in its expert's capacity
    load: torch.Tensor       # (E,) slots that chose each expert, drops included
    aux_loss: torch.Tensor   # E · Σ_i f_i · P_i (differentiable through P)


def route(logits: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """Top-k routing of one group's (n, E) router logits with a capacity per expert.

    The load-balancing loss (Switch Transformer, GShard): f_i is the share of the n·k slots
    that chose expert i, P_i the mean router probability of i; E · Σ f_i P_i is 1 when both
    are uniform and grows as the router piles tokens onto few experts. f has no gradient
    (an argmax), P does: the loss pushes probability away from the crowded experts.
    """
    n, experts = logits.shape
    probs = logits.softmax(dim=-1)
    gate, expert = probs.topk(top_k, dim=-1)
    if top_k > 1:
        gate = gate / gate.sum(dim=-1, keepdim=True)
    # Queue position of every slot in its expert: slot-major (all first choices, then seconds).
    chosen = nn.functional.one_hot(expert.T.reshape(-1), experts)     # (k·n, E)
    position = ((chosen.cumsum(0) - 1) * chosen).sum(-1).view(top_k, n).T
    load = chosen.sum(0)
    share = load.to(probs.dtype) / (n * top_k)
    aux_loss = experts * (share * probs.mean(0)).sum()
    return Routing(expert, gate, position < capacity, load, aux_loss)


class Slots(NamedTuple):
    """The kept slots of one group, sorted by expert (token order within an expert): the
    order rows are sent to the experts in, on one process and across ranks alike."""
    token: torch.Tensor   # (m,) token index in the group
    expert: torch.Tensor  # (m,) its expert
    gate: torch.Tensor    # (m,) its weight


def kept_slots(routing: Routing) -> Slots:
    k = routing.expert.shape[1]
    flat = routing.keep.reshape(-1).nonzero().squeeze(1)            # token-major
    experts = routing.expert.reshape(-1)[flat]
    order = torch.sort(experts, stable=True).indices
    flat = flat[order]
    return Slots(flat // k, experts[order], routing.gate.reshape(-1)[flat])


@dataclass(frozen=True)
class MoEStats:
    """What the last forward's router did, per capacity group (plain ints: picklable)."""
    load: tuple[tuple[int, ...], ...]   # [group][expert] slots that chose it
    kept: tuple[tuple[int, ...], ...]   # [group][expert] slots it took (≤ capacity)
    capacity: int

    @property
    def dropped(self) -> int:
        return sum(map(sum, self.load)) - sum(map(sum, self.kept))


def stats_of(routings: list[Routing], capacity: int) -> MoEStats:
    experts = routings[0].load.numel()

    def kept(r):
        return torch.bincount(r.expert[r.keep], minlength=experts)

    return MoEStats(tuple(tuple(r.load.tolist()) for r in routings),
                    tuple(tuple(kept(r).tolist()) for r in routings), capacity)


class MoE(nn.Module):
    """Router + E experts (each a FeedForward), one process. (…, h) in, (…, h) out.

    After each forward, `aux_loss` holds the load-balancing loss (mean over groups) and
    `stats` the router's loads and drops.
    """

    def __init__(self, config: MoEConfig = MOE):
        super().__init__()
        self.config = config
        h, experts = config.hidden, config.experts
        generator = torch.Generator().manual_seed(config.seed)
        self.router = nn.Linear(h, experts, bias=False)
        width = TransformerConfig(hidden=h, heads=1)   # FeedForward's sizes: h → 4h → h
        self.experts = nn.ModuleList(FeedForward(width) for _ in range(experts))
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))
        self.register_buffer("router_bias", -config.skew * torch.arange(experts, dtype=torch.float32),
                             persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.stats: MoEStats | None = None

    def route_groups(self, x: torch.Tensor, groups: int) -> list[Routing]:
        """Route (n, h) tokens cut into `groups` equal groups, each with its own capacity."""
        c = self.config
        check_divisible("tokens", x.shape[0], groups, "every capacity group gets as many tokens")
        capacity = expert_capacity(x.shape[0] // groups, c.experts, c.top_k, c.capacity_factor)
        logits = self.router(x) + self.router_bias
        routings = [route(part, c.top_k, capacity) for part in logits.chunk(groups)]
        self.aux_loss = torch.stack([r.aux_loss for r in routings]).mean()
        self.stats = stats_of(routings, capacity)
        return routings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        groups = self.config.groups
        slots = [kept_slots(r) for r in self.route_groups(x, groups)]
        size = x.shape[0] // groups
        token = torch.cat([s.token + g * size for g, s in enumerate(slots)])
        expert = torch.cat([s.expert for s in slots])
        gate = torch.cat([s.gate for s in slots])
        y = torch.zeros_like(x)
        for i, ffn in enumerate(self.experts):
            mine = expert == i
            rows = token[mine]
            y = y.index_add(0, rows, gate[mine, None] * ffn(x[rows]))
        return y.view(shape)


def make_moe_batch(config: MoEConfig = MOE) -> torch.Tensor:
    """The full batch of token vectors, (n, h); identical in every process."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    return torch.randn(config.tokens, config.hidden, generator=generator)


def moe_loss(output: torch.Tensor, aux_loss: torch.Tensor, config: MoEConfig = MOE,
             numel: int | None = None, share: float = 1.0) -> torch.Tensor:
    """The lecture's mean squared output plus `aux_weight` × the load-balancing loss.

    A rank holding part of the output passes the full output's `numel` and its `share` of the
    auxiliary loss (1/e when each of e ranks holds one group's): the pieces add up."""
    return mlp_loss(output, numel) + config.aux_weight * share * aux_loss


def make_moe_transformer(config: TransformerConfig = TRANSFORMER, moe: MoEConfig = MOE) -> nn.Module:
    """Notebook 07's decoder with every block's MLP replaced by an MoE layer of width h
    (`moe.experts`, `moe.top_k`, `moe.capacity_factor`, `moe.groups` capacity groups of whole
    sequences — e for a run on e expert-parallel ranks; block j's seeded config.seed + j).
    Train it with `moe_transformer_loss`."""
    model = make_transformer(config)
    for j, block in enumerate(model.blocks):
        block.mlp = MoE(moe.with_(hidden=config.hidden, tokens=config.tokens, seed=config.seed + j))
    return model


def moe_transformer_loss(model: nn.Module, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`lm_loss` plus each MoE block's `aux_weight` × its last load-balancing loss."""
    return lm_loss(logits, targets) + sum(block.mlp.config.aux_weight * block.mlp.aux_loss
                                          for block in model.blocks)

# Notebook 08: activation checkpointing per block.
# ----------------------------------------------------------------------------------------


def transformer_forward(model: Transformer, ids: torch.Tensor,
                        checkpointed: bool = False) -> torch.Tensor:
    """`model(ids)`, or with `checkpointed` each block under `torch.utils.checkpoint`
    (non-reentrant): a block keeps only its input for backward and runs its forward again
    there, so activation memory drops from every block's intermediates to one input per block
    (plus one block's intermediates while it is recomputed)."""
    if not checkpointed:
        return model(ids)
    x = model.embed(ids)
    for block in model.blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return model.head(x)
