"""Checked exercises: each `check_*` says right or wrong and why, so a reader can test an answer alone."""
from __future__ import annotations
from dataclasses import dataclass

@dataclass(frozen=True)
class Verdict:
    right: bool
    why: str
    def __str__(self) -> str:
        return ("✓ right: " if self.right else "✗ not yet: ") + self.why
    def _repr_markdown_(self) -> str:
        return str(self)

def close_to(answer: float, expected: float, rel: float = 0.02) -> bool:
    return abs(answer - expected) <= rel * abs(expected)


# -- notebooks 03-05 ----------------------------------------------------------------------

def _judge(answer: int, right: int, why: str, known: dict[int, str], otherwise: str) -> Verdict:
    """An exact answer: right, one of the usual wrong ones (each with its explanation), or a hint."""
    if answer == right:
        return Verdict(True, why)
    return Verdict(False, known.get(answer, f"{answer}: {otherwise}"))


# -- notebook 03: data parallelism ------------------------------------------------------------

def check_dp_ring_bytes(answer: float) -> Verdict:
    """Bytes each of d = 4 ranks sends per step to all-reduce the lecture MLP's fp32 gradients
    (Ψ = 4·1024² parameters) with a ring."""
    gradient = 4 * 1024 * 1024 * 4  # Ψ parameters × 4 bytes = 16 MiB
    expected = 2 * (4 - 1) / 4 * gradient
    if close_to(answer, expected):
        return Verdict(True, f"2(d−1)/d × 16 MiB = {expected:,.0f} B (24 MiB): a reduce-scatter "
                             "and an all-gather, each (d−1)/d of the buffer.")
    if close_to(answer, gradient):
        return Verdict(False, "that is the gradient's size; a ring all-reduce sends it almost "
                              "twice: (d−1)/d in the reduce-scatter, as much in the all-gather.")
    return Verdict(False, f"{answer:,.0f} B is not 2(d−1)/d times the 16 MiB gradient.")


def check_dp_buckets(answer: int) -> Verdict:
    """All-reduces per step of BucketedDDP(bucket_size_mb=12) on the lecture MLP (four 4 MiB
    weight matrices, buckets filled last layer first)."""
    return _judge(answer, 2, "layers 3, 2, 1 fill the first bucket (12 MiB, not more than the "
                             "cap), layer 0 goes alone in the second: 2 all-reduces.",
                  {3: "a bucket holds gradients while their total stays ≤ 12 MiB: three 4 MiB "
                      "layers fit exactly."},
                  "all-reduces: count how many 4 MiB layers fit in 12 MiB.")


def check_dp_zero1_gb(answer: float) -> Verdict:
    """ZeRO-1 memory per rank (GB, 1e9 bytes) for Ψ = 7.5e9, d = 64, mixed-precision Adam
    (2 + 2 bytes of bf16 weight and gradient, K = 12 bytes of optimizer state)."""
    psi, d = 7.5e9, 64
    expected = (4 * psi + 12 * psi / d) / 1e9
    if close_to(answer, expected, rel=0.01):
        return Verdict(True, f"4Ψ + 12Ψ/d = 30 GB + {12 * psi / d / 1e9:.2f} GB = "
                             f"{expected:.2f} GB (the ZeRO paper's 31.4 GB).")
    if close_to(answer, 16 * psi / 1e9, rel=0.01):
        return Verdict(False, "that is plain data parallelism (16Ψ): ZeRO-1 divides only the "
                              "optimizer state by d.")
    if close_to(answer, 16 * psi / d / 1e9, rel=0.01):
        return Verdict(False, "that is ZeRO-3 (16Ψ/d): ZeRO-1 keeps weights and gradients whole.")
    return Verdict(False, f"{answer} GB: add weights and gradients (4Ψ) to the sharded 12Ψ/d.")


# -- notebook 04: tensor parallelism ----------------------------------------------------------

def check_tp_megatron_bytes(answer: float) -> Verdict:
    """Bytes each rank sends per training step, Megatron layout, lecture MLP (L = 4, b = 128,
    h = 1024, fp32), t = 8, ring all-reduces."""
    n = 128 * 1024 * 4
    expected = 2 * 4 * (8 - 1) / 8 * n
    if close_to(answer, expected):
        return Verdict(True, f"2L(t−1)/t · n = 8 · 7/8 · {n:,} B = {expected:,.0f} B: L/2 "
                             "all-reduces forward and L/2 backward, each 2(t−1)/t · n.")
    if close_to(answer, 3 * 4 * (8 - 1) / 8 * n):
        return Verdict(False, "that is the lecture layout (3L(t−1)/t · n); Megatron needs one "
                              "all-reduce per pair of layers in each pass.")
    return Verdict(False, f"{answer:,.0f} B: count the all-reduces per step (L/2 forward, L/2 "
                          "backward) and what each sends under a ring.")


def check_tp_comm_ratio(answer: float) -> Verdict:
    """Communication / compute per layer, α left aside, for t = 8, h = 8192, bf16 (2 bytes),
    F = 989 TFLOP/s (H100 dense bf16), W = 450 GB/s (NVLink 4)."""
    expected = (8 - 1) * 2 * 989e12 / (3 * 8192 * 450e9)
    if close_to(answer, expected, rel=0.03):
        return Verdict(True, f"(t−1)·bytes·F/(3·h·W) = {expected:.2f}: even on NVLink the "
                             "all-reduce costs a little more than the compute at t = 8.")
    return Verdict(False, f"{answer}: the ratio is (t−1)·bytes·F / (3·h·W), independent of b·s.")


def check_tp_f_backward(answer: str) -> Verdict:
    """What the operator f (in front of a column-parallel layer) does in the backward pass."""
    said = answer.strip().lower().replace("_", "-").replace(" ", "-")
    if said in ("all-reduce", "allreduce"):
        return Verdict(True, "each rank holds one term dY_r W_r of dX = Σ_r dY_r W_r; the "
                             "all-reduce sums them (and f is the identity forward).")
    if said in ("identity", "nothing"):
        return Verdict(False, "that is f's forward (and g's backward); the input gradient is a "
                              "sum of one term per rank.")
    return Verdict(False, f"{answer!r}: which collective sums one term per rank?")


# -- notebook 05: pipeline parallelism --------------------------------------------------------

def check_pp_bubble(answer: float) -> Verdict:
    """The bubble of GPipe or 1F1B with p = 8 stages and m = 24 micro-batches."""
    expected = 7 / 31
    if close_to(answer, expected):
        return Verdict(True, f"(p−1)/(m+p−1) = 7/31 = {expected:.3f}, for both schedules.")
    if close_to(answer, 7 / 24):
        return Verdict(False, "7/24 is the idle time relative to the useful work, (p−1)/m; the "
                              "bubble is a fraction of the whole schedule, (p−1)/(m+p−1).")
    return Verdict(False, f"{answer}: (p−1)/(m+p−1) with p = 8, m = 24.")


def check_pp_peak_live(answer: int) -> Verdict:
    """Most micro-batches whose activations stage 0 holds at once under 1F1B, p = 8, m = 32."""
    return _judge(answer, 8, "p = 8: stage 0 runs p − 1 = 7 warm-up forwards, then one more "
                             "forward before its first backward; m does not matter.",
                  {32: "that is GPipe (all m forwards before the first backward).",
                   7: "7 warm-up forwards, then the steady phase starts with a forward (8 live) "
                      "before the first backward frees one."},
                  "count stage 0's forwards before its first backward.")


def check_pp_interleaved_m(answer: int) -> Verdict:
    """Smallest valid m (a multiple of p) giving an interleaved bubble ≤ 0.1 at p = 4, v = 2."""
    plain = "that is what 1F1B without interleaving would need (3/(m+3) ≤ 0.1)."
    return _judge(answer, 16, "3/(2m+3) ≤ 0.1 needs m ≥ 13.5, and m must be a multiple of p = 4: "
                              "m = 16 (bubble 3/35 = 0.086).",
                  {14: "3/31 ≤ 0.1 holds, but the interleaved schedule needs m to be a multiple "
                       "of p = 4.", 24: plain, 28: plain},
                  "solve (p−1)/(v·m+p−1) ≤ 0.1, then round up to a multiple of p.")
