"""Scaling laws (docs/cost_model.md §3): from a model width `d` to the whole training run.

Everything is snapped to "round" numbers `k·2^i` (k ∈ {1,3,5,7,9}) as the model's model does,
which is why the curves built from these laws are step-shaped rather than smooth.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from .settings import Settings

_SNAP_VALUES = sorted({k * 2**i for k in (1, 3, 5, 7, 9) for i in range(60)})
SEQ_LEN = 2048
D_MIN, D_MAX = 12288, 12288 * 128


def snap(x: float) -> int:
    """The nearest `k·2^i` (k ∈ {1,3,5,7,9}, 0 ≤ i < 60); on a tie, the smaller."""
    j = bisect.bisect_left(_SNAP_VALUES, x)
    if j == 0:
        return _SNAP_VALUES[0]
    if j == len(_SNAP_VALUES):
        return _SNAP_VALUES[-1]
    lo, hi = _SNAP_VALUES[j - 1], _SNAP_VALUES[j]
    return lo if x - lo <= hi - x else hi


@dataclass(frozen=True)
class Model:
    """One grid point: the model shape and the run the scaling laws give it."""

    d: int          # d_model
    f: int          # d_ff
    L: int          # layers
    s: int          # sparsity factor (experts); 1 = dense
    P: int          # total parameters (FFN matrices only)
    D: float        # training tokens
    C: float        # training compute, FLOP
    batch: int      # global batch in sequences
    B: int          # global batch in tokens
    seq_len: int = SEQ_LEN

    @property
    def active_params(self) -> int:
        return self.P // self.s

    # The course's names for the paper's d and f (docs/cost_model.md, notation).
    @property
    def h_model(self) -> int:
        return self.d

    @property
    def h_ff(self) -> int:
        return self.f


def sparsity(d: int, f: int, sparse: bool) -> int:
    return snap(8 * math.sqrt(d * f / (4 * 12288**2))) if sparse else 1


def batch_sequences(C: float, s: int, law: str, seq_len: int = SEQ_LEN) -> int:
    """The critical-batch-size law, in sequences, snapped per expert group."""
    if law == "default":
        bs = math.sqrt(s) * (C / 3e23) ** (1 / 6) * 2048 * 2048 / seq_len
    elif law == "none":
        bs = 2**22 / seq_len
    elif law == "deepseek":
        bs = math.sqrt(s) * 0.2920 * C**0.3271 / seq_len
    else:
        raise ValueError(f"batch_law must be one of default, none, deepseek; got {law!r}")
    return s * snap(bs / s)


def model_for_width(d: int, settings: Settings) -> Model:
    f = 4 * d
    L = snap(settings.depth_coef * (d * f) ** settings.depth_exp)
    s = sparsity(d, f, settings.sparse)
    P = 2 * d * f * L * s
    D = settings.tokens_per_param * P
    C = 6 * (P // s) * D
    batch = batch_sequences(C, s, settings.batch_law)
    return Model(d=d, f=f, L=L, s=s, P=P, D=D, C=C, batch=batch, B=batch * SEQ_LEN)


def width_grid() -> list[int]:
    """Model widths of the curve: `k·2^i`, k odd ≤ 15, between 12288 and 128 × that."""
    return sorted(k * 2**i for k in range(1, 16, 2) for i in range(11, 22)
                  if D_MIN <= k * 2**i <= D_MAX)


def grid(settings: Settings) -> list[Model]:
    return [model_for_width(d, settings) for d in width_grid()]
