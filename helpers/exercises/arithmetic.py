"""Checked exercises: each `grade_*` takes a reader's answer and returns a `Verdict`, right or
not yet and why, so a reader can test an answer alone. In the order of the notebooks."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """A grader's answer: `right`, and `why` (the working when right, a hint when not). It reads
    the same printed or shown as a cell's value: "✓ right: …" or "✗ not yet: …"."""
    right: bool
    why: str

    def __str__(self) -> str:
        return ("✓ right: " if self.right else "✗ not yet: ") + self.why

    __repr__ = __str__


def close_to(answer: float, expected: float, rel: float = 0.02) -> bool:
    return abs(answer - expected) <= rel * abs(expected)


def judge(answer, expected, right: str, mistakes: tuple[tuple[float, str], ...],
          otherwise: str, *, exact: bool = False) -> Verdict:
    """Right if `answer` equals `expected` (`exact`) or is within 2 % of it; else the hint of the
    first known mistake it matches (a usual wrong value and what it means), else `otherwise`."""
    same = (lambda a, b: a == b) if exact else close_to
    if same(answer, expected):
        return Verdict(True, right)
    for value, hint in mistakes:
        if same(answer, value):
            return Verdict(False, hint)
    return Verdict(False, otherwise)



# --- notebook 00: the hardware hierarchy ---

# The A100 SXM 80 GB's HBM2e bandwidth (NVIDIA A100 Tensor Core GPU datasheet, 2021: 2,039 GB/s);
# the roofline table's A100 SXM is the 40 GB part (1.555 TB/s). Both peak at 312 TFLOP/s in bf16.
A100_80GB_MEMORY_BPS = 2.039e12


def grade_hardware_ridge(answer: float) -> Verdict:
    """Exercise: the A100 SXM 80 GB's ridge point, in FLOP per byte (dense bf16 peak over its
    2.039 TB/s of HBM2e; the table above shows the 40 GB part)."""
    from helpers.cost.roofline import Roofline, published
    a100 = published("A100 SXM")
    big = Roofline("A100 SXM 80GB", a100.peak_flops, A100_80GB_MEMORY_BPS)
    why = (f"{big.peak_flops / 1e12:.0f} TFLOP/s ÷ {big.memory_Bps / 1e12:.3f} TB/s = "
           f"{big.ridge:.0f} FLOP/byte")
    return judge(
        answer, big.ridge,
        why + ": faster memory lowers the ridge, so more kernels reach the arithmetic peak.",
        ((big.memory_Bps / big.peak_flops,
          "that is bytes per FLOP; the ridge is peak FLOP/s over bytes/s."),
         (a100.ridge, f"{a100.ridge:.0f} is the 40 GB A100 of the table (1.555 TB/s); the 80 GB "
                      "part has 2.039 TB/s.")),
        f"{answer:g} is not the ridge: divide the peak FLOP/s (the table's A100 row) by the "
        "80 GB part's 2.039 TB/s.")


def grade_hardware_compute_bound_n(answer: int) -> Verdict:
    """Exercise: the smallest n for which an n×n×n bf16 matmul is compute-bound on an H100."""
    from helpers.cost.roofline import bound, matmul_intensity, published
    h100 = published("H100 SXM")
    n = 1
    while bound(matmul_intensity(n, "bfloat16"), h100) != "compute-bound":
        n += 1
    why = (f"intensity n/3 must reach the ridge {h100.ridge:.1f} FLOP/byte, so n ≥ "
           f"3 × {h100.ridge:.1f} = {3 * h100.ridge:.1f}: n = {n}")
    if answer == n:
        return Verdict(True, why + ".")
    if answer == n - 1:
        return Verdict(False, f"n = {answer} is just below the ridge; round up, not down.")
    if abs(answer - round(6 * h100.ridge)) <= 1:
        return Verdict(False, "that is the fp32 answer (n/6); a bf16 element is 2 bytes, so "
                       "the intensity is n/3.")
    return Verdict(False, f"n = {answer} is {bound(matmul_intensity(max(answer, 1), 'bfloat16'), h100)}"
                   " but not the smallest such n: solve n/3 ≥ ridge.")


def grade_hardware_send_time(answer: float) -> Verdict:
    """Exercise: seconds to send 16 GB (8 billion bf16 parameters) from one H100 to a GPU in
    another node, one way, over its own InfiniBand NDR link."""
    from helpers.hierarchy import level
    ib, nvlink = level("H100 SXM", "InfiniBand"), level("H100 SXM", "NVLink")
    seconds = 16e9 / ib.bandwidth_Bps
    why = (f"16 GB ÷ {ib.bandwidth_Bps / 1e9:.0f} GB/s = {seconds:.2f} s (the 5 µs latency is "
           f"negligible); over NVLink inside the node it would be {16e9 / nvlink.bandwidth_Bps:.3f} s")
    return judge(
        answer, seconds, why + ".",
        ((seconds / 2, "that uses 100 GB/s, the link's two directions added; one way is half "
                       "of that."),),
        f"{answer:g} s is not it: divide the bytes by the per-direction InfiniBand bandwidth of "
        "hierarchy.table('H100 SXM').")


# --- notebook 01: collectives ---

def _as_list(answer) -> list[float]:
    if isinstance(answer, (int, float)):
        return [float(answer)]
    return [float(v) for v in (answer.tolist() if hasattr(answer, "tolist") else answer)]


def grade_collectives_reduce_scatter(answer) -> Verdict:
    """Exercise: 8 ranks, rank r holds arange(8) + r; what does rank 3 hold after a
    reduce-scatter (sum)?"""
    from helpers.labs.collectives import expected
    want = expected("reduce_scatter", 8, 8)[3].after.tolist()
    got = _as_list(answer)
    why = (f"element 3 summed over the 8 ranks is 8·3 + (0+1+…+7) = {want[0]:g}; "
           "rank 3 keeps chunk 3 of the sum, and with 8 elements on 8 ranks a chunk is one element")
    if got == want:
        return Verdict(True, why + ".")
    if got == expected("all_reduce", 8, 8)[3].after.tolist():
        return Verdict(False, "that is the all-reduce result; a reduce-scatter leaves each rank "
                       "only its own chunk of it.")
    return Verdict(False, f"{got} is not it: the table of section run_collective says what a "
                   "reduce-scatter leaves on each rank, and its printout shows it on 4 ranks.")


def grade_collectives_all_to_all(answer) -> Verdict:
    """Exercise: 6 ranks, rank r holds 10r + [0, 1, ..., 5]; what does rank 4 hold after an
    all-to-all? (The page's figure shows 4 ranks, so the answer is worked out, not read off.)"""
    from helpers.labs.collectives import expected
    want = expected("all_to_all", 6, 6)[4].after.tolist()
    got = _as_list(answer)
    why = f"rank 4 receives chunk 4 of every rank, in rank order: {[int(v) for v in want]}"
    if got == want:
        return Verdict(True, why + " (a transpose of the rank × chunk grid).")
    if sorted(got) == sorted(want):
        return Verdict(False, "right elements, wrong order: chunks arrive in the order of the "
                       "ranks that sent them.")
    if got == expected("all_to_all", 6, 6)[4].before.tolist():
        return Verdict(False, "that is what rank 4 holds before: after the all-to-all it keeps "
                       "only its own chunk 4 and receives chunk 4 of each other rank.")
    return Verdict(False, f"{got} is not it: the table of section run_collective says what an "
                   "all-to-all leaves on each rank, and its printout shows it on 4 ranks.")


def grade_collectives_ring_bytes(answer: float) -> Verdict:
    """Exercise: a ring all-reduce of a 1 GB buffer on 8 ranks; how many GB does each rank
    send?"""
    from helpers.cost.alpha_beta import COST_MODELS
    factor = COST_MODELS["all_reduce"].bus_factor(8)
    half = "that is one half (a reduce-scatter or an all-gather); the all-reduce is both."
    right = (f"reduce-scatter sends 7 chunks of 1/8 GB, then all-gather 7 more: 2·(n−1)/n = "
             f"{factor:g} GB per rank, nearly twice the buffer however many ranks there are.")
    hint = (f"{answer:g} GB is not it: count the chunks each rank sends in the reduce-scatter, "
            "then in the all-gather.")
    return judge(answer, factor, right, ((factor / 2, half),), hint)


# --- notebook 02: benchmarking collectives ---

def grade_bench_busbw(answer: float) -> Verdict:
    """Exercise: an all-reduce of 400 MiB (100·1024² fp32) on 4 ranks took 2.115 ms; its
    nccl-tests bus bandwidth in GB/s (1 GB = 10⁹ B)."""
    from helpers.cost.alpha_beta import algbw_GBps, busbw_GBps
    from helpers.units import GiB
    from helpers.hierarchy import level
    nvlink_GBps = level("H100 SXM", "NVLink").bandwidth_Bps / 1e9
    n, p, t = 100 * 1024**2 * 4, 4, 2.115e-3
    busbw, algbw = busbw_GBps("all_reduce", p, n, t), algbw_GBps(n, t)
    return judge(
        answer, busbw,
        f"algbw n/t = {algbw:.1f} GB/s, × 2(p−1)/p = 1.5 -> {busbw:.1f} GB/s, about "
        f"{busbw / nvlink_GBps:.0%} of NVLink 4's {nvlink_GBps:.0f} GB/s per direction.",
        ((algbw, "that is algbw (n / t); busbw multiplies it by the all-reduce's factor "
          "(section 2, busbw_factor)."),
         (busbw * 1e9 / GiB, "that is GiB/s (the lecture's 277): divide by 10⁹, not 1024³.")),
        f"{answer:g} GB/s is not it: section 2 turns a size and a time into bus bandwidth "
        "(busbw_factor); 1 GB is 10⁹ B.")


def grade_bench_predict(answer_ms: float) -> Verdict:
    """Exercise: with α = 400 µs and 1/β = 1 GB/s, the predicted time (ms) of a ring
    all-reduce of 64 MiB on p = 4 ranks."""
    from helpers.cost.alpha_beta import coefficients, predict
    n, alpha, beta = 64 * 2**20, 400e-6, 1e-9
    a, b = coefficients("all_reduce", 4)
    expected = predict("all_reduce", 4, n, alpha, beta) * 1e3
    return judge(
        answer_ms, expected,
        f"{a:g}·α + {b:g}·n·β = {a * alpha * 1e3:.1f} ms + {b * n * beta * 1e3:.1f} ms = "
        f"{expected:.1f} ms: at 64 MiB the bytes are nearly all of it.",
        (((alpha + n * beta) * 1e3, "that is α + n·β, a send/recv's time (one latency, the "
          "buffer once); a ring all-reduce pays each more than once (its row in section 4's "
          "table)."),
         ((a * alpha + n * beta) * 1e3, "the latency term is right; the byte term has its factor "
          "too (the ring all-reduce's row in section 4's table).")),
        f"{answer_ms:g} ms is not it: section 4's table prices a ring all-reduce from α, β and n "
        "(coefficients('all_reduce', p) holds its two factors).")


def grade_bench_crossover(answer_bytes: float) -> Verdict:
    """Exercise: with α = 400 µs and 1/β = 1 GB/s, the all-reduce size n (bytes) on p = 4
    at which the latency term equals the bandwidth term."""
    from helpers.cost.alpha_beta import coefficients
    alpha, beta = 400e-6, 1e-9
    a, b = coefficients("all_reduce", 4)
    expected = a * alpha / (b * beta)
    return judge(
        answer_bytes, expected,
        f"a·α = b·n·β gives n = a·α / (b·β) = {a:g}·400 µs / ({b:g} ns/B) = {expected:.3g} B "
        "(≈ 1.5 MiB): below it latency dominates, above it bandwidth.",
        ((alpha / beta, "α/β ignores the coefficients: a ring all-reduce does not pay its "
          "latency and its bytes the same number of times (its row in section 4's table)."),),
        f"{answer_bytes:g} B is not it: at that size the latency term of section 4's ring "
        f"all-reduce is {'larger' if a * alpha > b * answer_bytes * beta else 'smaller'} than its "
        "bandwidth term (coefficients('all_reduce', p) holds their factors).")


# --- notebook 03: data parallelism ---

def grade_dp_ring_bytes(answer: float) -> Verdict:
    """Bytes each of d = 4 ranks sends per step to all-reduce the lecture MLP's fp32 gradients
    (Ψ = 4·1024² parameters) with a ring."""
    from helpers.configs import LECTURE
    from helpers.cost.alpha_beta import COST_MODELS
    gradient = LECTURE.parameters * 4  # Ψ fp32 gradients = 16 MiB
    expected = COST_MODELS["all_reduce"].bus_factor(4) * gradient
    if close_to(answer, expected):
        return Verdict(True, f"2(d−1)/d × 16 MiB = {expected:,.0f} B (24 MiB): a reduce-scatter "
                             "and an all-gather, each (d−1)/d of the buffer.")
    if close_to(answer, gradient):
        return Verdict(False, "that is the gradient's size; a ring all-reduce sends it almost "
                              "twice: (d−1)/d in the reduce-scatter, as much in the all-gather.")
    return Verdict(False, f"{answer:,.0f} B is not 2(d−1)/d times the 16 MiB gradient.")


def grade_dp_buckets(answer: int) -> Verdict:
    """All-reduces per step of BucketedDDP(bucket_size_mb=12) on the lecture MLP (four 4 MiB
    weight matrices, buckets filled last layer first)."""
    return judge(answer, 2, "layers 3, 2, 1 fill the first bucket (12 MiB, not more than the "
                            "cap), layer 0 goes alone in the second: 2 all-reduces.",
                 ((3, "a bucket holds gradients while their total stays ≤ 12 MiB: three 4 MiB "
                      "layers fit exactly."),),
                 f"{answer} all-reduces: count how many 4 MiB layers fit in 12 MiB.", exact=True)


def grade_dp_zero1_gb(answer: float) -> Verdict:
    """ZeRO-1 memory per rank (GB, 1e9 bytes) for Ψ = 7.5e9, d = 64, mixed-precision Adam
    (2 + 2 bytes of bf16 weight and gradient, K = 12 bytes of optimizer state)."""
    from helpers.cost.memory import zero_memory_per_rank
    psi, d = 7.5e9, 64
    expected = zero_memory_per_rank(psi, d, stage=1).total / 1e9
    if close_to(answer, expected, rel=0.01):
        return Verdict(True, f"4Ψ + 12Ψ/d = 30 GB + {12 * psi / d / 1e9:.2f} GB = "
                             f"{expected:.2f} GB (the ZeRO paper's 31.4 GB).")
    if close_to(answer, zero_memory_per_rank(psi, d, stage=0).total / 1e9, rel=0.01):
        return Verdict(False, "that is plain data parallelism (16Ψ): ZeRO-1 divides only the "
                              "optimizer state by d.")
    if close_to(answer, zero_memory_per_rank(psi, d, stage=3).total / 1e9, rel=0.01):
        return Verdict(False, "that is ZeRO-3 (16Ψ/d): ZeRO-1 keeps weights and gradients whole.")
    return Verdict(False, f"{answer} GB: add weights and gradients (4Ψ) to the sharded 12Ψ/d.")


# --- notebook 04: tensor parallelism ---

def grade_tp_megatron_bytes(answer: float) -> Verdict:
    """Bytes each rank sends per training step, Megatron layout, lecture MLP (L = 4, b = 128,
    h = 1024, fp32), t = 8, ring all-reduces."""
    from helpers.configs import LECTURE
    from helpers.cost.tp import formula_bytes
    n = LECTURE.batch * LECTURE.hidden * 4
    expected = formula_bytes("megatron", 8, LECTURE)
    if close_to(answer, expected):
        return Verdict(True, f"2L(t−1)/t · n = 8 · 7/8 · {n:,} B = {expected:,.0f} B: L/2 "
                             "all-reduces forward and L/2 backward, each 2(t−1)/t · n.")
    if close_to(answer, formula_bytes("lecture", 8, LECTURE)):
        return Verdict(False, "that is the lecture layout (3L(t−1)/t · n); Megatron needs one "
                              "all-reduce per pair of layers in each pass.")
    if close_to(answer, formula_bytes("lecture", 4, LECTURE)):
        return Verdict(False, "that is the lecture layout at t = 4, read from section 4's table; "
                              "this asks the Megatron layout at t = 8.")
    if close_to(answer, formula_bytes("megatron", 4, LECTURE)):
        return Verdict(False, "that is t = 4, section 4's table; at t = 8 each all-reduce sends "
                              "a larger share of its buffer.")
    return Verdict(False, f"{answer:,.0f} B is not it: section 4 counts the Megatron layout's "
                          "collectives per step and what each sends under a ring.")


def grade_tp_comm_ratio(answer: float) -> Verdict:
    """Communication / compute per layer, α left aside, for t = 4, h = 8192, bf16 (2 bytes),
    F = 989 TFLOP/s (H100 dense bf16), W = 450 GB/s (NVLink 4). (Section 6 prints t = 8.)"""
    expected = (4 - 1) * 2 * 989e12 / (3 * 8192 * 450e9)
    at_8 = (8 - 1) * 2 * 989e12 / (3 * 8192 * 450e9)
    if close_to(answer, expected, rel=0.03):
        return Verdict(True, f"(t−1)·bytes·F/(3·h·W) = {expected:.2f}: at t = 4 the all-reduce "
                             f"costs about half the compute, against {at_8:.2f} at t = 8.")
    if close_to(answer, at_8, rel=0.03):
        return Verdict(False, "that is t = 8, section 6's run; this asks t = 4.")
    return Verdict(False, f"{answer:g} is not it: section 6 compares a layer's communication "
                          "with its compute (leave α aside); put in this question's t, h, bytes, "
                          "F and W.")


def grade_tp_f_backward(answer: str) -> Verdict:
    """What the operator f (in front of a column-parallel layer) does in the backward pass."""
    said = answer.strip().lower().replace("_", "-").replace(" ", "-")
    if said in ("all-reduce", "allreduce"):
        return Verdict(True, "each rank holds one term dY_r W_r of dX = Σ_r dY_r W_r; the "
                             "all-reduce sums them (and f is the identity forward).")
    if said in ("identity", "nothing"):
        return Verdict(False, "that is f's forward; in the backward the input gradient is a "
                              "sum of one term per rank.")
    return Verdict(False, f"{answer!r}: which collective sums one term per rank?")


# --- notebook 05: pipeline parallelism ---

def grade_pp_bubble(answer: float) -> Verdict:
    """The bubble of GPipe or 1F1B with p = 8 stages and m = 24 micro-batches."""
    expected = 7 / 31
    if close_to(answer, expected):
        return Verdict(True, f"(p−1)/(m+p−1) = 7/31 = {expected:.3f}, for both schedules.")
    if close_to(answer, 7 / 24):
        return Verdict(False, "7/24 is the idle time relative to the useful work, (p−1)/m; the "
                              "bubble is a fraction of the whole schedule, (p−1)/(m+p−1).")
    return Verdict(False, f"{answer:g} is not it: the section bubble_theory gives the idle "
                          "share of a schedule of p stages and m micro-batches.")


def grade_pp_peak_live(answer: int) -> Verdict:
    """Most micro-batches whose activations stage 5 holds at once under 1F1B, p = 8, m = 32."""
    from helpers.cost.schedules import make_plan, peak_live
    held = peak_live(make_plan("1f1b", 8, 32, 5))
    return judge(answer, held, f"{held} = p − 5: stage 5 runs p − 5 − 1 = {held - 1} warm-up "
                               "forwards, then one more forward before its first backward; m does "
                               "not matter.",
                 ((8, "8 is stage 0's count; a later stage meets its first backward sooner."),
                  (32, "that is GPipe (all m forwards before the first backward)."),
                  (held - 1, f"{held - 1} warm-up forwards, then the steady phase starts with a "
                             f"forward ({held} live) before the first backward frees one.")),
                 f"{answer}: count stage 5's forwards before its first backward.", exact=True)


def grade_pp_interleaved_m(answer: int) -> Verdict:
    """Smallest valid m (a multiple of p) giving an interleaved bubble ≤ 0.1 at p = 4, v = 2."""
    plain = "that is what 1F1B without interleaving would need (3/(m+3) ≤ 0.1)."
    return judge(answer, 16, "3/(2m+3) ≤ 0.1 needs m ≥ 13.5, and m must be a multiple of p = 4: "
                             "m = 16 (bubble 3/35 = 0.086).",
                 ((14, "3/31 ≤ 0.1 holds, but the interleaved schedule needs m to be a multiple "
                       "of p = 4."), (24, plain), (28, plain)),
                 f"{answer} is not it: the section interleaved_1f1b gives the interleaved "
                 "bubble (bubble_theory takes v) and which m the schedule accepts.",
                 exact=True)


# --- notebook 06: the cost simulator ---

def _gtx580_blog_point():
    """The grid model nearest Epoch's 1e26 FLOP and the GTX 580's 3-month numbers."""
    import math

    from helpers.hardware import GTX_580
    from helpers.simulator.scaling import grid
    from helpers.simulator.settings import Settings

    s = Settings()
    model = min(grid(s), key=lambda m: abs(math.log(m.C / 1e26)))
    return model, GTX_580, s.duration_s


def grade_simulator_latency_floor(answer: float, point) -> Verdict:
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
    return Verdict(False, f"{answer:.3g} s is not it: count the matmuls one stage runs one "
                   "after another (section 3), reading this point's model and layout, and price "
                   "each at the GPU's fixed latency per matmul.")


def grade_simulator_min_gpus(answer: int) -> Verdict:
    """The smallest cluster (a power of two) that could do the grid point nearest 1e26 FLOP on
    GTX 580s in 6 months (twice section 7's 3) if every GPU ran at its sustained FLOP/s."""
    import math

    model, gpu, T = _gtx580_blog_point()
    need = model.C / (2 * T * gpu.sustained_flops)
    expected = 2 ** math.ceil(math.log2(need))
    if answer != expected and close_to(answer, need):
        return Verdict(False, "that is the count before rounding; the cluster is a power of two.")
    return judge(answer, expected,
                 f"C / (6 months × {gpu.sustained_flops:.3g} FLOP/s) = {need:.3g} GPUs, so "
                 f"2^{int(math.log2(expected))} = {expected:,}: half the blog's 'about 16 "
                 "million' for twice the time. The GPU count follows from compute and time alone.",
                 ((2 * expected, "that is section 7's cluster for 3 months; twice the time needs "
                                 "half the GPUs."),
                  (expected // 2, "too few: at that size the run would need more than 6 months "
                   "even at the sustained rate; round up, not down.")),
                 f"{answer} is not it: section 7 gives this run's compute and the GTX 580's "
                 "sustained FLOP/s; here the duration is twice the first cell's; the cluster is "
                 "a power of two.",
                 exact=True)


def grade_simulator_mfu_needed(answer: float) -> Verdict:
    """The MFU at which the run nearest 1e26 FLOP takes exactly 3 months on 2^24 GTX 580s."""
    model, gpu, T = _gtx580_blog_point()
    expected = model.C / (2**24 * gpu.peak_flops * T)
    bar = 0.8 * gpu.effective_utilization
    return judge(answer, expected,
                 f"C / (2^24 × peak {gpu.peak_flops:.4g} FLOP/s × {T:.4g} s) = {expected:.3f}: "
                 f"any MFU above it finishes in time, but the blog's '≥ 80 % of the maximum' "
                 f"asks for {bar:.2f}.",
                 ((bar, "that is the bar (τ × the ceiling); the question asks the MFU at which "
                   "the run takes exactly 3 months."),
                  (expected * gpu.peak_flops / gpu.sustained_flops, "that divides by the "
                   "sustained FLOP/s; MFU is a share of the peak.")),
                 f"{answer:.3g} is not it: MFU is model FLOP over peak FLOP (the notebook's "
                 "introduction); section 7 gives the run's compute and the GTX 580's peak.")


# --- notebook 07: 3-D parallelism ---

def grade_3d_rank(answer: int) -> Verdict:
    """Exercise: the global rank at dp = 1, tp = 0, pp = 1 of Layout(d=3, t=2, p=2), 12 ranks."""
    import itertools

    from helpers.layout import Layout
    layout, at = Layout(3, 2, 2), {"dp": 1, "tp": 0, "pp": 1}
    size = {"dp": layout.d, "tp": layout.t, "pp": layout.p}
    expected = layout.rank(**at)
    # The rank a reader gets with the mesh's axes in another order (slowest first).
    others = []
    for order in itertools.permutations(("pp", "dp", "tp")):
        rank = 0
        for axis in order:
            rank = rank * size[axis] + at[axis]
        if rank != expected:
            axes, fastest = " · ".join(order), order[-1].upper()
            others.append((rank, f"{rank} puts the axes in the order {axes} ({fastest} varying "
                           "fastest); the course's mesh varies TP fastest, then DP, then PP: "
                           "rank = (pp·d + dp)·t + tp."))
    return judge(answer, expected,
                 f"(pp·d + dp)·t + tp = (1·3 + 1)·2 + 0 = {expected}: each pipeline stage holds "
                 "d·t = 6 consecutive ranks, each DP replica inside it t = 2 of them.",
                 tuple(others),
                 f"{answer} is not it: rank = (pp·d + dp)·t + tp (sections 1 and 6).",
                 exact=True)


def _kinds(answer) -> set[str]:
    """{"dp", "pp"} from a set or list of names, or a string such as "dp, pp" or "DP and PP"."""
    import re
    words = re.findall(r"[a-z]+", answer.lower()) if isinstance(answer, str) else \
        [str(a).lower() for a in answer]
    return {w for w in words if w in ("dp", "tp", "pp")}


def grade_3d_crossing(answer) -> Verdict:
    """Exercise: Layout(d=2, t=4, p=2), 16 ranks on 4 nodes of 4 GPUs in the launcher's
    placement (ranks 0–3 on node 0, 4–7 on node 1, …): which kinds of group cross nodes?"""
    from helpers.layout import Layout, splits
    layout = Layout(2, 4, 2)
    placement = tuple(r // 4 for r in range(layout.world))
    where = splits(layout, placement)
    expected = {kind for kind in ("dp", "tp", "pp") if getattr(where, kind).crosses}
    said = _kinds(answer)
    groups = dict(zip(("dp", "tp", "pp"), (blocks[0] for blocks in layout.groups())))
    why = (f"rank 0's TP group {groups['tp']} is one node; its DP group {groups['dp']} and its "
           f"PP group {groups['pp']} reach other nodes: DP and PP cross, TP stays inside, as "
           "the mesh order intends.")
    if said == expected:
        return Verdict(True, why)
    if said == {"pp"}:
        return Verdict(False, "that is nodes of 8 GPUs (one pipeline stage per node); with 4 "
                       "GPUs a node holds one TP group only, so the DP group (t = 4 ranks "
                       "apart) crosses too.")
    if "tp" in said:
        return Verdict(False, "TP varies fastest: a TP group is t = 4 consecutive ranks, and "
                       "the launcher puts 4 consecutive ranks on each node.")
    return Verdict(False, f"{sorted(said) or answer!r} is not it: write out rank 0's DP, TP "
                   "and PP groups (rank = (pp·d + dp)·t + tp) and the node of each member "
                   "(rank // 4).")


def grade_3d_bubble(answer: float) -> Verdict:
    """Exercise: the bubble bubble_theory promises for Layout(1, 1, 4, 8) (p = 4, m = 8)."""
    from helpers.cost.bubble import bubble_theory
    expected = bubble_theory(4, 8)
    return judge(
        answer, expected,
        f"(p−1)/(m+p−1) = 3/11 = {expected:.3f} of the step idle, against "
        f"{bubble_theory(4, 4):.3f} at the m = 4 of the layouts above: twice the micro-batches, "
        "about two thirds of the bubble.",
        ((bubble_theory(4, 4), "that is m = 4, the pipeline layouts of the sections above; "
          "this one has m = 8."),
         (3 / 8, "3/8 is the idle time over the useful work, (p−1)/m; the bubble is a share of "
          "the whole step, (p−1)/(m+p−1)."),
         (1 - expected, "that is the busy share; the bubble is the idle one.")),
        f"{answer:g} is not it: bubble_theory(p, m) = (p−1)/(m+p−1).")


def grade_3d_quiet_tp(answer_ms: float, calibration, config) -> Verdict:
    """Exercise: the step (ms) the model would predict for Layout(1, 4, 1) with its TP
    all-reduces priced by the quiet fits (`calibration.all_reduce`) instead of the ones timed
    inside the step (`tp_all_reduce`), from section 5's printed numbers. Depends on the
    reader's calibration and config (the expected value is `predict` with the quiet fits)."""
    import dataclasses

    from helpers.cost.parallel3d import activation_bytes, predict
    from helpers.layout import Layout
    layout = Layout(1, 4, 1)
    quiet = dataclasses.replace(calibration, tp_all_reduce=calibration.all_reduce)
    expected = predict(layout, config, quiet).step_s * 1e3
    in_step = predict(layout, config, calibration).step_s * 1e3
    act = activation_bytes(layout, config)
    one_in_step, one_quiet = (1e3 * c.tp_s(4, act) for c in (calibration, quiet))
    saved, count = one_in_step - one_quiet, 4 * config.layers
    return judge(
        answer_ms, expected,
        f"{count} TP all-reduces (4 per block, {config.layers} blocks, one micro-batch, one "
        f"stage) on the critical path, each {one_in_step:.2f} ms in the step and "
        f"{one_quiet:.2f} ms quiet: {in_step:.1f} − {count} × {saved:.2f} = {expected:.1f} ms. "
        "The difference is what a TP all-reduce waits, inside the step, for partners the "
        "shared cores have not run yet; compare both with the measured step.",
        ((in_step, "that is the prediction with the in-step fits (the table's); swap each TP "
          "all-reduce's in-step cost for its quiet one."),
         (in_step - count / 2 * saved, "that counts 2 all-reduces per block, the forward's; "
          "the backward has 2 more."),
         (in_step - config.layers * saved, "that counts one all-reduce per block; a block "
          "makes 2 forward and 2 backward."),
         (in_step - saved, "that swaps one all-reduce; the step makes 4 per block."),
         (expected / 1e3, "that is in seconds; the answer is in ms.")),
        f"{answer_ms:g} ms is not it: start from the table's prediction for 1·4·1 and swap the "
        "cost of each of its TP all-reduces (how many: section 4) from in-step to quiet.")


# --- notebook 08: memory ---

def grade_memory_zero2_bytes(answer: float) -> Verdict:
    """Exercise: bytes per rank of parameters + gradients + optimizer state under ZeRO-2 for
    notebook 08's model (Ψ = 464,128) on d = 8 ranks, fp32 AdamW (4 + 4 + 8 bytes). The
    notebook prints and measures d = 1, 2 and 4 only: its table is the tool, not the answer."""
    from helpers.cost.memory import FP32_RUN, MIXED_RUN, zero_memory_for
    psi, d = 464_128, 8
    expected = zero_memory_for(psi, d, 2, FP32_RUN).total
    return judge(
        answer, expected,
        f"4Ψ + (4 + 8)Ψ/d = {4 * psi:,} + {12 * psi // d:,} = {expected:,.0f} B: the weights "
        "stay whole, gradients and AdamW's two moments are split eight ways.",
        ((zero_memory_for(psi, 4, 2, FP32_RUN).total, "that is d = 4, the table's row; at "
          "d = 8 the weights stay 4Ψ and only the 12Ψ of gradients and moments halve again."),
         (zero_memory_for(psi, d, 2, MIXED_RUN).total, "that is the mixed-precision formula "
          "2Ψ + 14Ψ/d; this run keeps fp32 weights and gradients and no master copy."),
         (zero_memory_for(psi, d, 0, FP32_RUN).total, "that is plain data parallelism, 16Ψ: "
          "ZeRO-2 splits the gradients and the moments over the d ranks."),
         (zero_memory_for(psi, d, 1, FP32_RUN).total, "that is ZeRO-1 (gradients whole)."),
         (zero_memory_for(psi, d, 3, FP32_RUN).total, "that is ZeRO-3: ZeRO-2 keeps every weight.")),
        f"{answer:g} B is not it: add section 1's three terms (bytes per parameter × Ψ), "
        "dividing by d only the ones ZeRO-2 shards.")


def grade_memory_fsdp_wire_bytes(answer: float) -> Verdict:
    """Exercise: bytes one rank sends per step under ZeRO-3 for Ψ = 1e9 bf16 parameters (and
    bf16 gradients) on d = 8 ranks, ring collectives."""
    from helpers.cost.memory import comm_volume
    psi, d = 1e9, 8
    expected = comm_volume(3, d, psi, bytes_per_value=2)
    return judge(
        answer, expected,
        f"two all-gathers and a reduce-scatter of 2Ψ bytes, each sending (d−1)/d of it: "
        f"3 × 2 GB × 7/8 = {expected / 1e9:.2f} GB per step.",
        ((3 * psi * 2, "that is 3Ψ·2 bytes handed to the collectives; a ring sends (d−1)/d of it."),
         (comm_volume(2, d, psi, 2), "that is stages 0-2 (2Ψ): ZeRO-3 gathers the weights twice."),
         (3 * psi * (d - 1) / d, "count 2 bytes per bf16 value.")),
        f"{answer:g} B is not it: count the buffers ZeRO-3 hands the collectives per step "
        "(section 6), their bytes in bf16, and the share of each a ring rank sends.")


def grade_memory_block_activation_mb(answer_mb: float) -> Verdict:
    """Exercise: MB (10⁶ B) one block of notebook 07's decoder keeps for its backward, without
    checkpointing, for b = 1 sequence of s = 4096 tokens, h = 4096, 32 heads, in bf16. The
    notebook prints the count for its own small model only (and the ratio, ≈ 16 at any h)."""
    from helpers.cost.memory import ActivationShape, block_activation_bytes
    shape = ActivationShape(1, 4096, 4096, 32, 1, 32000)
    expected = block_activation_bytes(shape, 2) / 1e6
    return judge(
        answer_mb, expected,
        f"(16h + 4 + heads) values per token × s × 2 bytes = (16·4096 + 36) · 4096 · 2 = "
        f"{expected:.0f} MB: 16 tensors the size of the block's input, and a few per-token "
        "statistics; checkpointed, it would keep only its input, 1/16 of that.",
        ((block_activation_bytes(shape, 4) / 1e6, "that is fp32: bf16 activations take 2 bytes."),
         (block_activation_bytes(shape, 2, True) / 1e6, "that is with checkpointing (the "
          "block's input alone); without it the block keeps 16 tensors of that size."),
         (34 * 4096 * 4096 / 1e6, "that is Korthikanti et al.'s 34·sbh bytes (fp16, counting "
          "dropout masks, which this block has not): count this block's values.")),
        f"{answer_mb:g} MB is not it: count what the block keeps per token (section 8), then "
        "multiply by the tokens and the bytes of a bf16 value.")


# --- notebook 09: experts and long context ---

def grade_experts_capacity(answer: int) -> Verdict:
    """Exercise: slots per expert for 4096 tokens, E = 8 experts, top-2, capacity factor 1.25."""
    from helpers.cost.experts import capacity
    expected = capacity(4096, 8, 2, 1.25)
    balanced = 4096 * 2 // 8
    why = f"⌈1.25 · 4096 · 2 / 8⌉ = ⌈1.25 · {balanced}⌉ = {expected}"
    if answer == expected:
        return Verdict(True, why + ": 25 % head-room over a balanced expert's 1024 slots.")
    if answer == capacity(4096, 8, 1, 1.25):
        return Verdict(False, "that is top-1: with k = 2 every token takes two slots.")
    if answer == balanced:
        return Verdict(False, "that is the balanced share; the capacity factor multiplies it.")
    return Verdict(False, f"{answer} is not it: capacity = ⌈cf · tokens · k / E⌉ "
                          "(helpers.cost.experts.capacity).")


def grade_ring_bytes(answer_mb: float) -> Verdict:
    """Exercise: MB (10⁶ B) one rank sends in a forward + backward of ring attention, c = 4,
    b = 1, 8 heads, s = 8192, head_dim 128, fp32."""
    from helpers.cost.context import ring_bytes
    expected = ring_bytes(4, 1, 8, 8192, 128) / 1e6
    block = 2 * 1 * 8 * (8192 // 4) * 128 * 4 / 1e6
    return judge(
        answer_mb, expected,
        f"a K/V block is 2·b·heads·(s/c)·d·4 B = {block:.1f} MB; 3 hops forward, 3 of K/V and 4 "
        f"of dK/dV backward: 10 blocks = {expected:.0f} MB.",
        ((3 * block, "that is the forward alone; the backward sends K/V again and their gradients."),
         (4 * block, "that is c blocks; the forward skips the last hop and the backward adds 2c − 1."),
         (block * 10 / 2, "K and V are both in the block: 2 · b · heads · (s/c) · d numbers.")),
        f"{answer_mb:g} MB is not it: count the hops of a 2·b·heads·(s/c)·d block "
        "(helpers.cost.context.ring_bytes).")


def grade_ring_idle(answer: float) -> Verdict:
    """Exercise: the share of time c = 8 ranks idle in causal ring attention with the naive
    split, if every step runs at the slowest rank's pace."""
    from helpers.cost.context import causal_work, idle_share
    expected = idle_share(causal_work(8, "naive"))
    return judge(
        answer, expected,
        f"rank r works r + ½ blocks, the slowest 7.5, the mean 4: 1 − 4/7.5 = {expected:.3f} "
        "(1 − c/(2c − 1)); the zig-zag split makes it 0.",
        ((1 - 1 / 8, "that compares the first rank with the last; the mean rank works 4 blocks."),
         (0.5, "close, but the diagonal block is half a block: 1 − 4/7.5.")),
        f"{answer:g} is not it: 1 − mean/max of causal_work(8, 'naive').")


# --- notebook 10: planning a real run ---

def grade_planner_state_gb(answer_gb: float) -> Verdict:
    """Exercise: GB (10⁹ B) of weights, gradients and optimizer state on one GPU for Llama 3 70B
    at t = 8, p = 4, d = 16, ZeRO-1, bf16 weights and gradients, fp32 master and moments
    (2 + 2 + 12); the busiest stage holds 20 layers and one embedding matrix."""
    from helpers.cost.model_shapes import LLAMA3_70B
    from helpers.cost.planner import Job, Layout, memory
    from helpers.hardware import H100_SXM
    job, lay = Job(LLAMA3_70B, H100_SXM, 512, 8192, 512), Layout(t=8, p=4, d=16, zero=1)
    mem = memory(job, lay)
    expected = (mem.params + mem.grads + mem.optimizer) / 1e9
    w = mem.params / 2 / 1e9
    return judge(
        answer_gb, expected,
        f"the GPU keeps {w:.2f} G weights (20 layers and an embedding, ÷ t): 2 + 2 bytes each "
        f"whole and 12 ÷ d = 16: {expected:.1f} GB.",
        ((16 * w, "that is 16 bytes a weight with nothing sharded: ZeRO-1 divides the 12 bytes "
                  "of optimizer state by d."),
         (16 * LLAMA3_70B.params() / 512 / 1e9, "that shards everything over all 512 GPUs "
                                                "(ZeRO-3 over every rank)."),
         (4 * w + 12 * LLAMA3_70B.params() / 512 / 1e9, "the optimizer state is divided by d "
                                                         "among a stage's copies, not by all GPUs.")),
        f"{answer_gb:g} GB is not it: count one GPU's weights first (its stage's layers and one "
        "embedding, split t ways), then the bytes each keeps whole and the ones ZeRO-1 splits.")


def grade_planner_activation_gb(answer_gb: float) -> Verdict:
    """Exercise: GB of activations on the first pipeline stage of GPT-3 175B (Korthikanti et
    al.'s 175B: s = 2048, b = 1, h = 12288, 96 layers, t = 8, p = 8, 1F1B) with sequence
    parallelism and selective recomputation, counting the layers only."""
    s, b, h, L, t = 2048, 1, 12288, 96, 8
    expected = 34 * s * b * h * L / t / 1e9
    return judge(
        answer_gb, expected,
        f"34·s·b·h/t per layer, and 1F1B's first stage holds p micro-batches of L/p layers: "
        f"L layers' worth, {expected:.1f} GB.",
        ((expected / 8, "that is one micro-batch of the stage's 12 layers: 1F1B's first stage "
                        "holds p = 8 of them."),
         (expected * 8, "the first stage holds p micro-batches of L/p layers, not of L."),
         ((10 + 24 / t) * s * b * h * L / 1e9, "that is without sequence parallelism: it "
                                                 "splits the remaining 10·sbh too.")),
        f"{answer_gb:g} GB is not it: take the paper's bytes per layer with both techniques, "
        "then ask how many layers' worth the first stage holds at its peak.")


def grade_planner_fits(layout) -> Verdict:
    """Exercise: a layout of Llama 3 70B on 16 H100s (2 nodes), 64 sequences of 8K per step,
    that fits in 80 GB and reaches at least 30 % MFU in the planner."""
    from helpers.cost.model_shapes import LLAMA3_70B
    from helpers.cost.planner import Job, Layout, limits, step
    from helpers.hardware import H100_SXM
    job = Job(LLAMA3_70B, H100_SXM, 16, 8192, 64)
    if not isinstance(layout, Layout):
        return Verdict(False, "pass a helpers.cost.planner.Layout(t=…, p=…, d=…, …)")
    why = limits(job, layout)
    if why:
        return Verdict(False, "it breaks: " + "; ".join(why))
    mfu = step(job, layout).mfu
    if mfu < 0.30:
        return Verdict(False, f"it fits, at {mfu:.0%} MFU: look at the step's parts for what "
                              "dominates (tensor parallelism across nodes? a large bubble?)")
    return Verdict(True, f"it fits and the planner gives {mfu:.0%} MFU.")
