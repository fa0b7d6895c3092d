"""What a 3-D layout (d, t, p, m) of notebook 07's decoder should cost: pure arithmetic.

One step of `helpers.parallel.parallel3d.train_3d` on d·t·p ranks, predicted from three
calibrated numbers and the counts of its work:

* compute: the FLOPs of a rank's share (`forward_flops`, backward = 2 × forward), over the
  FLOP/s one rank reaches at its thread count *while every rank computes at once* (on a
  machine with fewer cores than ranks that is the honest rate: the ranks share the cores);
* TP and DP communication: every collective the layout calls, priced by
  `helpers.cost.alpha_beta.predict` with α–β fitted on the live ranks on that group size;
* the pipeline: the fill and drain of the schedule, `helpers.cost.bubble.bubble_theory`,
  plus the point-to-point hops of the activations and their gradients.

Notation: p pipeline stages, m micro-batches, t tensor degree, d data degree, b micro-batch
(sequences), s sequence length, h hidden width. Model sizes come as any object with the
attributes of `helpers.models.TransformerConfig` (vocab, hidden, heads, layers, seq,
batch): this module reads numbers only and imports no torch.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from helpers.checks import check_int, check_number
from helpers.cost.alpha_beta import Fit, relative_error
from helpers.cost.bubble import bubble_theory

BYTES_PER_FLOAT = 4  # float32 activations, gradients and weights


# ----------------------------------------------------------------------------------------
# FLOPs of the decoder (the one definition; helpers.models.transformer_flops calls it).
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TransformerFlops:
    """Forward FLOPs of one step (the whole batch), by part; a matmul (m×k)·(k×n) is 2·m·n·k.

    With n = batch·s tokens: one block's Linears are 24·n·h² (Q, K, V, out: 8·n·h²; MLP:
    16·n·h²), its attention 4·n·s·h (QKᵀ and AV over the full s×s scores: the math kernel
    computes the masked half too), the LM head 2·n·h·V. LayerNorm, GELU, softmax and the
    embedding lookups are not matmuls and are not counted. Backward is about 2× forward.
    """
    block_linears: int
    block_attention: int
    head: int
    layers: int

    @property
    def block(self) -> int:
        """One decoder block: what a pipeline stage pays per block it holds."""
        return self.block_linears + self.block_attention

    @property
    def total(self) -> int:
        return self.layers * self.block + self.head


def forward_flops(tokens: int, hidden: int, seq: int, vocab: int, layers: int) -> TransformerFlops:
    """Forward FLOPs of the decoder on `tokens` tokens (sequences of length `seq`)."""
    n, h, s = tokens, hidden, seq
    return TransformerFlops(block_linears=24 * n * h * h, block_attention=4 * n * s * h,
                            head=2 * n * h * vocab, layers=layers)
