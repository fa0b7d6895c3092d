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


# --- notebook 06: the cost simulator ----------------------------------------------------

def _gtx580_blog_point():
    """The grid model nearest Epoch's 1e26 FLOP and the GTX 580's 3-month numbers."""
    import math

    from helpers.hardware import GTX_580
    from helpers.simulator.scaling import grid
    from helpers.simulator.settings import Settings

    s = Settings()
    model = min(grid(s), key=lambda m: abs(math.log(m.C / 1e26)))
    return model, GTX_580, s.duration_s


def check_simulator_latency_floor(answer: float, point) -> Verdict:
    """Seconds of one step that are the fixed latency of the matmuls, for `point` (a curve
    point with a plan): 6 matmuls × (L / PP) layers × (E / EP) experts × m micro-batches ×
    the GPU's latency per matmul."""
    q, m = point.plan, point.model
    expected = point.matmul_latency_s
    count = 6 * (m.L // q.pp) * (m.s // q.ep) * q.m
    if close_to(answer, expected):
        return Verdict(True, f"{count} matmuls in a row on one stage × "
                       f"{point.latency_per_matmul_s * 1e6:g} µs = {expected:.3g} s of a "
                       f"{q.time.step:.3g} s step.")
    return Verdict(False, f"count the matmuls one stage runs in sequence: 6 per layer and "
                   f"micro-batch, L/PP = {m.L // q.pp} layers, m = {q.m} micro-batches; each "
                   f"costs the fixed latency ({point.latency_per_matmul_s * 1e6:g} µs) "
                   f"(got {answer:.3g} s).")


def check_simulator_min_gpus(answer: int) -> Verdict:
    """The smallest cluster (a power of two) that could do the grid point nearest 1e26 FLOP
    on GTX 580s in 3 months if every GPU ran at its sustained FLOP/s."""
    import math

    model, gpu, T = _gtx580_blog_point()
    need = model.C / (T * gpu.sustained_flops)
    expected = 2 ** math.ceil(math.log2(need))
    if answer == expected:
        return Verdict(True, f"C / (3 months × {gpu.sustained_flops:.3g} FLOP/s) = {need:.3g} "
                       f"GPUs, so 2^{int(math.log2(expected))} = {expected:,}: the blog's "
                       f"'about 16 million'. The GPU count follows from compute and time alone.")
    return Verdict(False, f"divide C = {model.C:.3g} FLOP by the duration ({T:.4g} s) and one "
                   f"GPU's sustained rate, then round up to a power of two (got {answer}).")


def check_simulator_mfu_needed(answer: float) -> Verdict:
    """The MFU at which the run nearest 1e26 FLOP takes exactly 3 months on 2^24 GTX 580s."""
    model, gpu, T = _gtx580_blog_point()
    expected = model.C / (2**24 * gpu.peak_flops * T)
    bar = 0.8 * gpu.effective_utilization
    if close_to(answer, expected):
        return Verdict(True, f"C / (2^24 × peak {gpu.peak_flops:.4g} FLOP/s × {T:.4g} s) = "
                       f"{expected:.3f}: any MFU above it finishes in time, but the blog's "
                       f"'≥ 80 % of the maximum' asks for {bar:.2f}.")
    return Verdict(False, f"MFU = C / (GPUs × peak FLOP/s × time); solve for the MFU with the "
                   f"time set to 3 months (got {answer:.3g}).")
