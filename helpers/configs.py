"""The course's configurations: sizes and seeds of every model it trains, torch-free.

Models build from these (`helpers.models`), cost arithmetic reads them (`helpers.cost`), labs
pass them to rank functions; one record per model, each validated where it is made, and each
`with_(...)` copy validated the same way.

    MLPConfig / LECTURE          the lecture's deep MLP (CS336 lecture 8): notebooks 03-05
    TransformerConfig / TRANSFORMER   notebook 07's small GPT-style decoder (also 08, 09)
    SMALL                        notebook 08's decoder, small enough for 4 ranks on 2 cores
    MoEConfig / MOE              notebook 09's mixture-of-experts MLP
    RingConfig / RING            notebook 09's ring-attention shapes
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from helpers.checks import check_divisible, check_int, check_number


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


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes and seed of notebook 07's decoder. The defaults run a forward + backward on one
    CPU core in a fraction of a second; the lecture's MLP sizes are one `with_` away,
    e.g. `TransformerConfig().with_(hidden=LECTURE.hidden, layers=LECTURE.layers)`."""
    vocab: int = 1024     # V: token ids 0 … V−1
    hidden: int = 256     # h: the residual stream's width
    heads: int = 4        # attention heads; each gets h / heads dimensions
    layers: int = 4       # L: decoder blocks
    seq: int = 128        # s: tokens per sequence (and the positional table's length)
    batch: int = 8        # sequences in the full batch (the global batch, before any split)
    seed: int = 0         # weights use it; the tokens use seed + 1

    def __post_init__(self):
        for name in ("vocab", "hidden", "heads", "layers", "seq", "batch"):
            check_int(name, getattr(self, name))
        check_int("seed", self.seed, low=0)
        check_divisible("hidden", self.hidden, self.heads, "every head gets hidden/heads dims")

    def with_(self, **changes) -> "TransformerConfig":
        """A copy with some fields changed (validated like the original)."""
        return replace(self, **changes)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens(self) -> int:
        """n = batch · s, the tokens of one step."""
        return self.batch * self.seq

    @property
    def parameters(self) -> int:
        """Ψ: embeddings V·h + s·h; per block 12·h² + 4·h (Q, K, V, out: 4·h²; MLP: 8·h²;
        two LayerNorms: 4·h); final LayerNorm 2·h; LM head h·V."""
        h = self.hidden
        return (self.vocab * h + self.seq * h + self.layers * (12 * h * h + 4 * h)
                + 2 * h + h * self.vocab)


TRANSFORMER = TransformerConfig()


@dataclass(frozen=True)
class MoEConfig:
    """Sizes and router settings of notebook 09's mixture-of-experts MLP."""
    hidden: int = 64               # h: a token's width
    experts: int = 4               # E
    top_k: int = 1                 # k: experts per token (1: Switch, 2: GShard)
    capacity_factor: float = 1.25  # capacity = ⌈cf · tokens·k / E⌉ per group
    tokens: int = 256              # n: tokens of the full batch (`make_moe_batch`)
    groups: int = 1                # capacity groups (an expert-parallel run: e)
    skew: float = 0.0              # router bias −skew·i on expert i: 0 fair, larger favours expert 0
    aux_weight: float = 0.01       # weight of the load-balancing loss in `moe_loss`
    seed: int = 0                  # weights use it; the batch uses seed + 1

    def __post_init__(self):
        for name in ("hidden", "experts", "tokens", "groups"):
            check_int(name, getattr(self, name))
        check_int("top_k", self.top_k, 1, min(2, self.experts))
        check_number("capacity_factor", self.capacity_factor, 0, low_inclusive=False)
        check_number("skew", self.skew, 0, 10)
        check_number("aux_weight", self.aux_weight, 0)
        check_int("seed", self.seed, low=0)
        check_divisible("tokens", self.tokens, self.groups, "every capacity group gets as many tokens")

    def with_(self, **changes) -> "MoEConfig":
        """A copy with some fields changed (validated like the original)."""
        return replace(self, **changes)


MOE = MoEConfig()


@dataclass(frozen=True)
class RingConfig:
    """Shapes of one attention call: q, k and v are (batch, heads, seq, head_dim)."""
    batch: int = 2
    heads: int = 2
    seq: int = 256
    head_dim: int = 32
    seed: int = 0

    def __post_init__(self):
        for name in ("batch", "heads", "seq", "head_dim"):
            check_int(name, getattr(self, name))
        check_int("seed", self.seed, low=0)


RING = RingConfig()


# Notebook 08's model: notebook 07's decoder, small enough that 4 ranks train it on 2 cores
# in a fraction of a second per step (Ψ = 464,128).
SMALL = TransformerConfig(vocab=256, hidden=128, heads=4, layers=2, seq=32, batch=8)


