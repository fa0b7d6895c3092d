"""Memory per rank under ZeRO stages 0-3: the syllabus's formulas, pure arithmetic.

A parameter costs `param_bytes + grad_bytes + optimizer_bytes` bytes (K = optimizer_bytes):
with mixed-precision Adam 2 + 2 + 12 = 16 (bf16 weight and gradient; fp32 master copy and two
moments). On d data-parallel ranks, ZeRO-1 shards the optimizer state, ZeRO-2 the gradients
too, ZeRO-3 (FSDP) the parameters as well.
"""
from __future__ import annotations

from dataclasses import dataclass

from helpers.checks import check_choice, check_int, check_number
from helpers.cost.activations import layer_bytes
from helpers.cost.model_shapes import Transformer

STAGES = {0: "plain DP", 1: "ZeRO-1 (optimizer state)", 2: "ZeRO-2 (+ gradients)",
          3: "ZeRO-3 / FSDP (+ parameters)"}
MIXED_PRECISION_ADAM_BYTES = 12  # K: fp32 master weight + two fp32 moments
FP32_ADAM_BYTES = 8              # K: two fp32 moments (torch's AdamW on fp32 parameters)


@dataclass(frozen=True)
class ZeroMemory:
    """Bytes per rank, by what they hold."""
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def zero_memory_per_rank(psi: float, d: int, stage: int, param_bytes: float = 2,
                         grad_bytes: float = 2,
                         optimizer_bytes: float = MIXED_PRECISION_ADAM_BYTES) -> ZeroMemory:
    """Bytes per rank for Ψ parameters on d ranks: stage 0 keeps all of (2 + 2 + K)Ψ;
    ZeRO-1 shards the optimizer state K (4Ψ + KΨ/d), ZeRO-2 the gradients too
    (2Ψ + (2 + K)Ψ/d), ZeRO-3 everything ((4 + K)Ψ/d)."""
    check_number("psi (number of parameters)", psi, low=0, low_inclusive=False)
    check_int("d (number of data-parallel ranks)", d)
    check_choice("stage", stage, STAGES)
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_bytes", optimizer_bytes)):
        check_number(name, value, low=0)
    return zero_terms(psi, d, stage, param_bytes, grad_bytes, optimizer_bytes)


def zero_terms(psi: float, d: int, stage: int, param_bytes: float, grad_bytes: float,
               optimizer_bytes: float) -> ZeroMemory:
    """zero_memory_per_rank's arithmetic without its checks, for callers that checked once
    (notebook 10's planner prices tens of thousands of layouts)."""
    return ZeroMemory(params=psi * param_bytes / (d if stage >= 3 else 1),
                      grads=psi * grad_bytes / (d if stage >= 2 else 1),
                      optimizer=psi * optimizer_bytes / (d if stage >= 1 else 1))


def zero_memory_table(psi: float, d: int, stage: int | None = None, param_bytes: float = 2,
                      grad_bytes: float = 2,
                      optimizer_bytes: float = MIXED_PRECISION_ADAM_BYTES) -> str:
    """All four stages side by side, in GB per rank (the chosen stage marked with >)."""
    lines = [f"Ψ = {psi:.3g} parameters, d = {d} ranks, bytes per parameter: "
             f"{param_bytes:g} (params) + {grad_bytes:g} (grads) + {optimizer_bytes:g} (optimizer)",
             f"  {'stage':<30}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}"]
    for s, name in STAGES.items():
        m = zero_memory_per_rank(psi, d, s, param_bytes, grad_bytes, optimizer_bytes)
        mark = ">" if s == stage else " "
        lines.append(f"{mark} {name:<30}" + "".join(f"{nbytes / 1e9:9.2f} GB".rjust(12) for nbytes
                                                  in (m.params, m.grads, m.optimizer, m.total)))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Notebook 08: this run's dtypes, activations, communication, and a planner's presets.
# ----------------------------------------------------------------------------------------

# (param_bytes, grad_bytes, optimizer_bytes) of the two runs the course prices.
PRECISIONS = {"fp32 AdamW (this CPU run)": (4, 4, FP32_ADAM_BYTES),
              "mixed-precision AdamW (the lecture's GPU run)": (2, 2, MIXED_PRECISION_ADAM_BYTES)}
FP32_RUN, MIXED_RUN = PRECISIONS


def zero_memory_for(psi: float, d: int, stage: int, precision: str = FP32_RUN) -> ZeroMemory:
    """zero_memory_per_rank with one of PRECISIONS' byte counts: fp32 AdamW is
    4 + 4 + 8 = 16 bytes per parameter (stage 1: 8Ψ + 8Ψ/d, stage 2: 4Ψ + 12Ψ/d, stage 3:
    16Ψ/d); mixed precision 2 + 2 + 12 = 16 (4Ψ + 12Ψ/d, 2Ψ + 14Ψ/d, 16Ψ/d)."""
    check_choice("precision", precision, PRECISIONS)
    param, grad, optimizer = PRECISIONS[precision]
    return zero_memory_per_rank(psi, d, stage, param, grad, optimizer)


def comm_volume(stage: int, d: int, psi: float, bytes_per_value: float = 4) -> float:
    """Bytes one rank sends (and receives) per step under `stage`, ring algorithms.

    Stages 0-2 move 2Ψ values: an all-reduce of the gradients (stage 0) or a reduce-scatter
    of them plus an all-gather of the updated parameters (1, 2); stage 3 adds a second
    all-gather (forward and again in backward): 3Ψ. Each ring collective moves (d−1)/d of its
    buffer per rank, so at finite d these are 2Ψ(d−1)/d and 3Ψ(d−1)/d; the ZeRO paper's 2Ψ
    and 3Ψ are the d → ∞ limit."""
    check_choice("stage", stage, STAGES)
    check_int("d (number of data-parallel ranks)", d)
    buffers = 3 if stage == 3 else 2
    return buffers * psi * bytes_per_value * (d - 1) / d


@dataclass(frozen=True)
class ActivationShape:
    """What one rank's forward pass sees: b sequences of s tokens, width h, `heads` heads,
    `layers` blocks, vocabulary V (the head's log-softmax keeps b·s·V values)."""
    batch: float      # b: sequences on this rank (may be fractional in a planner)
    seq: int          # s
    hidden: int       # h
    heads: int
    layers: int
    vocab: int

    def __post_init__(self):
        check_number("batch (sequences per rank)", self.batch, low=0, low_inclusive=False)
        for name in ("seq", "hidden", "heads", "layers", "vocab"):
            check_int(name, getattr(self, name))


# What autograd keeps per block of notebook 07's decoder, in values of b·s·h (read off the ops'
# saved tensors; tests/test_memory_measured.py checks it against saved_tensors_hooks):
# the block input x and its LayerNorm's output (2), q, k, v (3), the attention output (1; the
# CPU kernel lays it out so that `out` reads it without a copy), the residual x₁ and its
# LayerNorm's output (2), up's output (4), GELU's output (4). These are Korthikanti et al.'s
# 34·sbh of a GPT layer (notebook 10's `activations.layer_bytes`) in 4-byte values, without
# dropout masks and without the s × s scores, which the CPU's flash-attention kernel never keeps.
BLOCK_VALUES_PER_TOKEN_H = 16
# … plus, per token: two LayerNorms' mean and 1/std (4 values) and attention's log-sum-exp
# (one value per head), which the paper's count leaves out.
BLOCK_VALUES_PER_TOKEN = 4


def block_activation_bytes(shape: ActivationShape, bytes_per_value: float = 4,
                           checkpointed: bool = False) -> float:
    """Bytes one block keeps for its backward: 16·bsh + (4 + heads)·bs values; with
    activation checkpointing only its input, b·s·h (the rest is recomputed in backward).
    The 16·bsh (and the checkpointed b·s·h) are notebook 10's planner's `layer_bytes` for
    this shape, as a GPU run would keep them, in this run's bytes per value."""
    tokens = shape.batch * shape.seq
    gpt = Transformer("notebook 07's decoder", shape.layers, shape.hidden, shape.heads,
                      4 * shape.hidden, shape.vocab)
    kept = layer_bytes(gpt, shape.seq, tokens, recompute="full" if checkpointed else "selective",
                       dropout=False, value_bytes=bytes_per_value)
    stats = 0 if checkpointed else tokens * (BLOCK_VALUES_PER_TOKEN + shape.heads) * bytes_per_value
    return kept + stats


def head_activation_bytes(shape: ActivationShape, bytes_per_value: float = 4) -> float:
    """Embedding and head: the final LayerNorm's input, output and statistics (2·bsh + 2·bs
    values), the log-softmax of the logits (bsV values); int64 token ids (b(s+1), the batch
    the inputs are a slice of), positions (s) and the flattened targets (bs); the loss's
    4-byte total weight."""
    tokens = shape.batch * shape.seq
    return (tokens * (2 * shape.hidden + 2 + shape.vocab) * bytes_per_value
            + 8 * (shape.batch * (shape.seq + 1) + shape.seq + tokens) + 4)


def activation_bytes(shape: ActivationShape, bytes_per_value: float = 4,
                     checkpointed: bool = False) -> float:
    """Everything the forward pass keeps for backward: L blocks plus embedding and head."""
    return (shape.layers * block_activation_bytes(shape, bytes_per_value, checkpointed)
            + head_activation_bytes(shape, bytes_per_value))


@dataclass(frozen=True)
class ModelPreset:
    """A model for the planner: its Ψ and the shape of one rank's forward. `batch` None means
    the global batch of `global_batch` sequences is split over d (as this notebook's runs);
    otherwise each rank runs `batch` sequences per micro-batch, whatever d."""
    name: str
    parameters: float
    seq: int
    hidden: int
    heads: int
    layers: int
    vocab: int
    global_batch: int = 8
    batch: int | None = None

    def shape(self, d: int) -> ActivationShape:
        check_int("d (number of data-parallel ranks)", d)
        b = self.global_batch / d if self.batch is None else self.batch
        return ActivationShape(b, self.seq, self.hidden, self.heads, self.layers, self.vocab)


def gpt_parameters(vocab: int, seq: int, hidden: int, layers: int) -> int:
    """Ψ of notebook 07's decoder shape (as TransformerConfig.parameters, without torch)."""
    h = hidden
    return vocab * h + seq * h + layers * (12 * h * h + 4 * h) + 2 * h + h * vocab


def preset(name: str, vocab: int, seq: int, hidden: int, heads: int, layers: int,
           global_batch: int = 8, batch: int | None = None) -> ModelPreset:
    return ModelPreset(name, gpt_parameters(vocab, seq, hidden, layers), seq, hidden, heads,
                       layers, vocab, global_batch, batch)


@dataclass(frozen=True)
class PlannedMemory:
    """Bytes per rank: ZeRO's three terms plus the activations."""
    state: ZeroMemory
    activations: float

    @property
    def total(self) -> float:
        return self.state.total + self.activations


def plan_memory(model: ModelPreset, d: int, stage: int, checkpointed: bool,
                precision: str = FP32_RUN) -> PlannedMemory:
    """The planner's bar: ZeRO memory of `model` at (d, stage, precision) plus its
    activations (2 bytes per value in mixed precision, 4 in fp32)."""
    state = zero_memory_for(model.parameters, d, stage, precision)
    value_bytes = PRECISIONS[precision][0]
    return PlannedMemory(state, activation_bytes(model.shape(d), value_bytes, checkpointed))


# ----------------------------------------------------------------------------------------
# Mixed precision in FSDP: what a rank keeps, what it sends, and how far a reduction may round.
# ----------------------------------------------------------------------------------------

# Bytes per value and unit roundoff u (half the gap between 1 and the next number: 2^−p for
# p significant bits, the implicit one included) of the floating dtypes the collectives carry,
# by torch's name.
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bfloat16": 2.0 ** -8,
                 "float16": 2.0 ** -11}


def mixed_precision_bytes(compute_dtype: str = "bfloat16", reduce_dtype: str = "bfloat16",
                          master_dtype: str = "float32") -> tuple[int, int, int]:
    """(param_bytes, grad_bytes, optimizer_bytes) per parameter of FSDP with these dtypes and
    AdamW: the weight in the compute dtype, its gradient as reduced, and the master weight
    with Adam's two moments in the master dtype. bf16 everywhere but the masters: the
    lecture's 2 + 2 + 12; reducing in fp32: 2 + 4 + 12."""
    for name, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype),
                        ("master_dtype", master_dtype)):
        check_choice(name, dtype, DTYPE_BYTES)
    return DTYPE_BYTES[compute_dtype], DTYPE_BYTES[reduce_dtype], 3 * DTYPE_BYTES[master_dtype]


def fsdp_wire_bytes(d: int, psi: float, gather_bytes: float = 4, reduce_bytes: float = 4) -> float:
    """Bytes one FSDP rank sends per step on a ring: two all-gathers of the weights (forward,
    backward) in the compute dtype and one reduce-scatter of the gradients in the reduce
    dtype, each (d−1)/d of its Ψ values. fp32 throughout: comm_volume(3, d, Ψ)."""
    check_int("d (number of data-parallel ranks)", d)
    check_number("psi (number of parameters)", psi, low=0, low_inclusive=False)
    return (2 * gather_bytes + reduce_bytes) * psi * (d - 1) / d


def gamma(n: int, u: float) -> float:
    """Higham's γₙ = nu / (1 − nu): the relative error bound of n roundings."""
    check_int("n (number of roundings)", n, low=0)
    if n * u >= 1:
        raise ValueError(f"gamma: n·u = {n * u:g} must be below 1")
    return n * u / (1 - n * u)


def reduction_tolerance(d: int, reduce_dtype: str = "bfloat16",
                        master_dtype: str = "float32") -> float:
    """τ such that FSDP's averaged gradient ĝ and the exact mean g = (1/d)·Σ_r g_r of the d
    ranks' gradients (each g_r in the compute dtype) differ, element by element, by at most
    τ · (1/d)·Σ_r |g_r|:  τ = γ_{d−1}(u_R) + u_M·(1 + γ_{d−1}(u_R)).

    Why. Casting g_r to the reduce dtype is exact (it holds the compute dtype's numbers).
    The reduce-scatter adds d numbers: whatever order or tree the backend uses, d − 1
    additions, each rounding to the reduce dtype's unit roundoff u_R; for every order
    |ŝ − s| ≤ γ_{d−1}·Σ|g_r| (Higham, *Accuracy and Stability of Numerical Algorithms*,
    2nd ed., 2002, §4.2; an addition whose result underflows is exact, so gradual underflow
    does not break it). The reduction depth d − 1 is the worst case: a tree of depth ⌈log₂ d⌉
    rounds less. Casting ŝ to the master dtype is exact, and dividing by d rounds once more,
    by u_M relative to |ŝ|/d ≤ (1 + γ_{d−1})·Σ|g_r|/d (exact when d is a power of two).
    bf16 at d = 4: τ ≈ 3·2⁻⁸ ≈ 1.2 %; in fp32 about 2·10⁻⁷."""
    check_int("d (number of data-parallel ranks)", d)
    check_choice("reduce_dtype", reduce_dtype, UNIT_ROUNDOFF)
    check_choice("master_dtype", master_dtype, UNIT_ROUNDOFF)
    reduction = gamma(d - 1, UNIT_ROUNDOFF[reduce_dtype])
    return reduction + UNIT_ROUNDOFF[master_dtype] * (1 + reduction)
