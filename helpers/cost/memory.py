"""Memory per rank under ZeRO stages 0-3: the syllabus's formulas, pure arithmetic.

A parameter costs `param_bytes + grad_bytes + optimizer_bytes` bytes (K = optimizer_bytes):
with mixed-precision Adam 2 + 2 + 12 = 16 (bf16 weight and gradient; fp32 master copy and two
moments). On d data-parallel ranks, ZeRO-1 shards the optimizer state, ZeRO-2 the gradients
too, ZeRO-3 (FSDP) the parameters as well.
"""
from __future__ import annotations

from dataclasses import dataclass

from helpers.checks import check_choice, check_int, check_number

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
