"""Plan a real training run: memory per GPU, step time and MFU of one layout, and every layout.

A job is a model, a GPU, a number of GPUs in nodes of 8, a sequence length and a global batch.
A layout splits it: t (tensor), p (pipeline, v chunks per rank when interleaved), d (data),
c (context), e (experts, carved out of d), the micro-batch b (so m = batch / (d·b)), a ZeRO
stage (3 = FSDP), sequence parallelism, recomputation, the pipeline's schedule, and whether the
linear layers' matmuls run in FP8.

Memory is notebook 08's ZeRO arithmetic (`zero_terms`) on each GPU's share of the weights plus
Korthikanti et al.'s activations (`activations.py`). The step is notebook 06's model
(docs/cost_model.md): its matmul times (`matmul_seconds`), its communication formulas
(`comm.py`), its bubble and overlap rules (`reference.step_seconds`), unchanged. What the
simulator does not price is added and named in `Step`'s parts: attention's projections and
scores, a gated MLP's third matrix, experts chosen top-k, the output head, the recomputed
forward, attention's tensor-parallel all-reduces, ZeRO-2/3's reduce-scatter per micro-batch,
FSDP's gathers, the context ring, the expert all-to-all, DualPipeV's bubble. 1-D tensor
parallelism (Megatron's) is the simulator's 2-D split with TP_model = 1.

Assumptions the numbers rest on, named where they are used: every stage holds ⌈L/p⌉ layers
and the last also runs the output head (the slowest stage sets a pipeline's pace); attention's
scores are priced over the whole s × s at the matmul rate (`Pricing.causal_skip` halves them);
tensor-parallel traffic hides under the matmuls (notebook 06's default; `Pricing.overlap_tp`);
the expert all-to-all hides only under DualPipeV, which was built to overlap it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache

from helpers.checks import check_choice, check_int
from helpers.hardware import GPU
from helpers.simulator import comm as sim_comm
from helpers.simulator.matmul import Chip, matmul_seconds
from helpers.simulator.reference import step_seconds

from .activations import RECOMPUTE, SCHEDULES, activation_bytes, stage_layers
from .memory import MIXED_PRECISION_ADAM_BYTES, STAGES, ZeroMemory, zero_terms
from .model_shapes import Transformer

NODE = 8                          # GPUs per node in every cluster here
PARAM_BYTES = 2                   # bf16 weights (the compute copy)
GRAD_BYTES = (2, 4)               # gradients reduced in bf16, or in fp32
GB = 1e9
HEAD = "output head (last stage)"
SCORES = "attention scores (whole s × s)"

# Notebook 06's communication formulas, unchanged; memoised because an enumeration asks each
# the same question for many layouts (all their arguments are numbers and tuples).
tp_comm, ppep_comm, dp_comm = (lru_cache(maxsize=1 << 14)(f) for f in
                               (sim_comm.tp_comm, sim_comm.ppep_comm, sim_comm.dp_comm))


@dataclass(frozen=True)
class Job:
    """What is trained on what: `batch` sequences of `seq` tokens per step on `gpus` GPUs."""
    model: Transformer
    gpu: GPU
    gpus: int
    seq: int
    batch: int

    def __post_init__(self):
        if not isinstance(self.model, Transformer):
            raise ValueError(f"model must be a helpers.cost.model_shapes.Transformer, got "
                             f"{type(self.model).__name__}")
        if not isinstance(self.gpu, GPU):
            raise ValueError(f"gpu must be a helpers.hardware.GPU record, got "
                             f"{type(self.gpu).__name__}")
        for name in ("gpus", "seq", "batch"):
            check_int(name, getattr(self, name))

    @property
    def tokens(self) -> int:
        return self.seq * self.batch


@dataclass(frozen=True)
class Layout:
    t: int = 1
    p: int = 1
    d: int = 1
    c: int = 1
    e: int = 1
    v: int = 1
    b: int = 1
    zero: int = 1
    sp: bool = True            # sequence parallelism (only means something with t > 1)
    recompute: str = "selective"
    schedule: str = "1f1b"
    grad_bytes: int = 2        # 2: gradients reduced in bf16; 4: in fp32 (Megatron's default)
    dropout: bool = False      # Korthikanti's GPT models keep dropout masks; Llama 3 has none
    fp8: bool = False          # the linear layers' matmuls in FP8, as DeepSeek-V3 trained

    def __post_init__(self):
        check_choice("recompute", self.recompute, RECOMPUTE)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("zero", self.zero, STAGES)
        check_choice("grad_bytes", self.grad_bytes, GRAD_BYTES)
        for name in ("t", "p", "d", "c", "e", "v", "b"):
            check_int(name, getattr(self, name))
        for name in ("sp", "dropout", "fp8"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def _trusted(cls, t, p, d, c, e, v, b, zero, sp, recompute, schedule, fp8=False) -> Layout:
        """A layout the enumeration builds from values it knows are valid: the checks above
        would cost more than pricing it."""
        lay = object.__new__(cls)
        lay.__dict__.update(_LAYOUT_DEFAULTS, t=t, p=p, d=d, c=c, e=e, v=v, b=b, zero=zero,
                            sp=sp, recompute=recompute, schedule=schedule, fp8=fp8)
        return lay

    def m(self, job: Job) -> int:
        return job.batch // (self.d * self.b)

    def label(self) -> str:
        parts = [f"t{self.t}", f"p{self.p}" + (f"·v{self.v}" if self.v > 1 else ""),
                 f"d{self.d}"]
        parts += [f"c{self.c}"] if self.c > 1 else []
        parts += [f"e{self.e}"] if self.e > 1 else []
        return " ".join(parts) + f" b{self.b} · ZeRO-{self.zero} · {self.recompute}" \
            + (f" · {self.schedule}" if self.p > 1 else "") + (" · FP8" if self.fp8 else "")


_LAYOUT_DEFAULTS = {f.name: f.default for f in fields(Layout)}


@dataclass(frozen=True)
class Pricing:
    """Two choices of the step's model, each on its default as notebook 06 has it."""
    overlap_tp: bool = True    # False: Megatron's layers wait for their TP all-reduces
    causal_skip: bool = False  # True: a causal kernel runs half of the s × s scores


def limits(job: Job, lay: Layout, check_memory: bool = True) -> list[str]:
    """Why a layout cannot run this job, each reason naming the limit; [] when it can.
    `check_memory=False` asks only whether the layout is well formed (it can be priced)."""
    out = _malformed(job, lay)
    if not out and check_memory:
        out += memory_limit(job, memory(job, lay))
    return out


def memory_limit(job: Job, mem: Memory) -> list[str]:
    """The memory limit a layout's `memory` breaks on this job's GPU, or []."""
    if mem.total > job.gpu.hbm_bytes:
        return [f"memory {mem.total / GB:.1f} GB > {job.gpu.hbm_bytes / GB:.0f} GB HBM"]
    return []


def _malformed(job: Job, lay: Layout) -> list[str]:
    mdl, out = job.model, []
    if lay.t * lay.p * lay.d * lay.c != job.gpus:
        out.append(f"t·p·d·c = {lay.t * lay.p * lay.d * lay.c} must equal the {job.gpus} GPUs")
    if (mdl.heads % lay.t or mdl.kv % lay.t or mdl.ffn % lay.t
            or (mdl.moe and mdl.expert_ffn % lay.t)):
        out.append(f"t = {lay.t} must divide the heads ({mdl.heads}), the key-value heads "
                   f"({mdl.kv}) and the MLP widths")
    if lay.t > NODE:
        out.append(f"t = {lay.t} exceeds a node of {NODE}: its all-reduces would leave NVLink")
    if job.batch % (lay.d * lay.b):
        out.append(f"the batch of {job.batch} sequences must split into d·b = {lay.d * lay.b}")
    if job.seq % (2 * lay.c) and lay.c > 1:
        out.append(f"the sequence ({job.seq}) must split into 2c = {2 * lay.c} chunks")
    if lay.c > 1 and lay.recompute == "none":
        out.append("context parallelism needs the scores not stored: recompute selective or "
                   "full (flash attention)")
    if lay.e > 1 and (not mdl.moe or lay.d % lay.e or mdl.experts % lay.e):
        out.append(f"e = {lay.e} must divide d ({lay.d}) and the experts ({mdl.experts})")
    chunks = lay.p * (2 if lay.schedule == "dualpipev" else lay.v)
    if chunks > mdl.layers:
        out.append(f"{chunks} pipeline chunks for {mdl.layers} layers")
    m = lay.m(job)
    if lay.p > 1 and not out:
        need = {"1f1b": lay.p, "gpipe": 1, "interleaved": lay.p, "zb-h2": 2 * lay.p - 1,
                "dualpipev": 2 * lay.p}[lay.schedule]
        if m < need:
            out.append(f"{lay.schedule} needs m ≥ {need} micro-batches, has {m}")
        if (lay.schedule == "interleaved") != (lay.v > 1):
            out.append("v > 1 is the interleaved schedule's, and it needs v > 1")
    if lay.p == 1 and (lay.v > 1 or lay.schedule not in ("1f1b", "gpipe")):
        out.append("without a pipeline (p = 1) there is no schedule to choose")
    return out


# ---------------------------------------------------------------------------------------
# Memory per GPU
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Memory:
    """Bytes on the busiest GPU, term by term."""
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float = 0.0       # FSDP's gathered layers

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def terms(self) -> dict[str, float]:
        return {"parameters": self.params, "gradients": self.grads,
                "optimizer state": self.optimizer, "activations": self.activations,
                "FSDP buffers": self.buffers}


def weights_per_gpu(job: Job, lay: Layout) -> tuple[float, float]:
    """(weights every expert rank keeps, routed experts' weights) on the busiest stage's GPU:
    its ⌈L/p⌉ layers' share, ÷ t (experts ÷ e·t too), plus one embedding matrix ÷ t (both
    when p = 1)."""
    return _weights(job.model, lay.t, lay.p, lay.e)


@lru_cache(maxsize=4096)
def _weights(mdl: Transformer, t: int, p: int, e: int) -> tuple[float, float]:
    share = stage_layers(mdl, p) / mdl.layers
    embed = mdl.embedding_params() if p == 1 else mdl.vocab * mdl.hidden
    return (mdl.dense_params() * share + embed) / t, mdl.routed_params() * share / (e * t)


def memory(job: Job, lay: Layout) -> Memory:
    """Parameters, gradients and optimizer state (2 + grad_bytes + 12 per weight, ZeRO over
    d·c, the experts' over d·c/e), activations, and FSDP's two gathered layers."""
    return _memory(job.model, lay, weights_per_gpu(job, lay), _activations(job, lay))


def _activations(job: Job, lay: Layout) -> float:
    return activation_bytes(job.model, job.seq, lay.b, lay.t, lay.p, lay.m(job), lay.v, lay.c,
                            lay.sp and lay.t > 1, lay.recompute, lay.schedule, lay.dropout)


def _memory(mdl: Transformer, lay: Layout, weights: tuple[float, float], acts: float) -> Memory:
    dense, routed = weights
    shard = lay.d * lay.c
    a = zero_terms(dense, shard, lay.zero, PARAM_BYTES, lay.grad_bytes, MIXED_PRECISION_ADAM_BYTES)
    if routed:   # (a malformed e that does not divide d·c still gets a count: one shard)
        b = zero_terms(routed, max(1, shard // lay.e), lay.zero, PARAM_BYTES, lay.grad_bytes,
                       MIXED_PRECISION_ADAM_BYTES)
        a = ZeroMemory(a.params + b.params, a.grads + b.grads, a.optimizer + b.optimizer)
    buffers = 2 * PARAM_BYTES * _layer_weights(mdl, lay.t, lay.e) if lay.zero == 3 else 0.0
    return Memory(a.params, a.grads, a.optimizer, acts, buffers)


@lru_cache(maxsize=1024)
def _layer_weights(mdl: Transformer, t: int, e: int) -> float:
    """One layer's weights on a GPU: what FSDP gathers for it."""
    return (mdl.dense_params() + mdl.routed_params() / e) / mdl.layers / t


# ---------------------------------------------------------------------------------------
# Step time
# ---------------------------------------------------------------------------------------

def split(degrees: dict[str, int], node: int = NODE) -> dict[str, tuple[int, int]]:
    """(inside a node, across nodes) for each degree, filling a node innermost-first in the
    order t, c, e, d, p (Megatron's and Llama 3's order; e is carved out of d)."""
    room, out = node, {}
    for name in ("t", "c", "e", "d", "p"):
        deg = degrees[name]
        inner = math.gcd(deg, room) if name != "d" else math.gcd(deg // degrees["e"], room)
        if name == "d":  # d's inner part counts e's already placed
            inner_total = out["e"][0] * inner
            out["d"] = (inner_total, deg // inner_total)
        else:
            out[name] = (inner, deg // inner)
        room //= inner
    return out


@lru_cache(maxsize=8192)
def _matrix(chip: Chip, out: int, inp: int, n: int) -> float:
    """Forward, input gradient and weight gradient of one `out × inp` weight on n tokens:
    the three matmul times notebook 06 gives each feed-forward matrix."""
    return (matmul_seconds(chip, out, inp, n) + matmul_seconds(chip, inp, out, n)
            + matmul_seconds(chip, out, inp, n, True))


@lru_cache(maxsize=8192)
def _forward(chip: Chip, out: int, inp: int, n: int) -> float:
    return matmul_seconds(chip, out, inp, n)


def fp8_record(gpu: GPU) -> GPU:
    """The GPU with its matmuls in FP8: 8-bit words, twice the FLOP per clock (the dense FP8
    peak of an H100 or H800 is twice its bf16 one, NVIDIA's H100 datasheet)."""
    fpct = dict(gpu.flop_per_clock_per_thread)
    fpct[8] = 2 * fpct[gpu.bitwidth]
    return replace(gpu, name=f"{gpu.name}, FP8 matmuls", bitwidth=8,
                   flop_per_clock_per_thread=fpct)


@dataclass(frozen=True)
class Step:
    """One step's time, its named parts (s), the bubble, and MFU."""
    seconds: float
    bubble: float
    mfu: float
    compute: dict[str, float] = field(default_factory=dict)   # per step, busiest stage
    hidden: dict[str, float] = field(default_factory=dict)    # overlapped with compute
    exposed: dict[str, float] = field(default_factory=dict)   # added to the step
    latency: float = 0.0


def _layer_compute(job: Job, lay: Layout, n: int,
                   pricing: Pricing) -> dict[str, tuple[float, float]]:
    """Per layer and micro-batch: (forward+backward, forward alone) seconds of each part; the
    output head's once per micro-batch. The linear layers run in FP8 with `lay.fp8`; the
    scores and the head stay in bf16 (as DeepSeek-V3 kept them, its report's §3.3)."""
    mdl, t = job.model, lay.t
    chip = Chip.of(job.gpu)
    lin = Chip.of(fp8_record(job.gpu)) if lay.fp8 else chip
    h = mdl.hidden
    ff = mdl.ffn // t
    two = _matrix(lin, ff, h, n) + _matrix(lin, h, ff, n)     # the simulator's six
    two_f = _forward(lin, ff, h, n) + _forward(lin, h, ff, n)
    gate = (_matrix(lin, ff, h, n), _forward(lin, ff, h, n)) if mdl.gated else (0.0, 0.0)
    share_moe = mdl.moe_layers / mdl.layers
    parts = {"MLP matmuls (notebook 06)": ((1 - share_moe) * two, (1 - share_moe) * two_f),
             "gated MLP's third matrix": tuple((1 - share_moe) * x for x in gate)}
    if mdl.moe:
        ef = mdl.expert_ffn // t
        per_expert = max(1, round(n * mdl.top_k * lay.e / mdl.experts))
        local = mdl.experts // lay.e
        shapes = ((ef, h), (h, ef)) + (((ef, h),) if mdl.gated else ())
        full = local * sum(_matrix(lin, a, b_, per_expert) for a, b_ in shapes)
        fwd = local * sum(_forward(lin, a, b_, per_expert) for a, b_ in shapes)
        shared = mdl.shared_experts * mdl.matrices
        parts["experts (top-k, shared)"] = (
            share_moe * (full + shared * _matrix(lin, ef, h, n)),
            share_moe * (fwd + shared * _forward(lin, ef, h, n)))
    q, kv = mdl.heads * mdl.d_qk // t, max(1, mdl.kv * (mdl.d_qk + mdl.d_v) // t)
    o = mdl.heads * mdl.d_v // t
    parts["attention projections"] = (
        _matrix(lin, q, h, n) + _matrix(lin, kv, h, n) + _matrix(lin, h, o, n),
        _forward(lin, q, h, n) + _forward(lin, kv, h, n) + _forward(lin, h, o, n))
    # QKᵀ and (scores)V over the whole sequence: 2·n·s·(d_qk + d_v) FLOP per head forward,
    # at the matmul's sustained rate; a causal kernel skips half of them.
    score_f = 2 * n * job.seq * (mdl.heads // t) * (mdl.d_qk + mdl.d_v) / job.gpu.sustained_flops
    score_f *= 0.5 if pricing.causal_skip else 1.0
    parts[SCORES] = (3 * score_f, score_f)
    parts[HEAD] = (_matrix(chip, math.ceil(mdl.vocab / t), h, n), 0.0)
    return parts


def step(job: Job, lay: Layout, pricing: Pricing = Pricing()) -> Step:
    """Seconds of one training step of `job` in layout `lay`, its parts, and MFU (priced
    whether or not it fits in memory: `limits` says that)."""
    problems = limits(job, lay, check_memory=False)
    if problems:
        raise ValueError(f"layout {lay.label()}: " + "; ".join(problems))
    per_layer = _layer_compute(job, lay, lay.b * job.seq // lay.c, pricing)
    return _step(job, lay, per_layer, _comm(job, lay), pricing)


def dualpipev_bubble(p: int, m: int) -> float:
    """DualPipeV's idle share of a step, from DeepSeek-V3's Table 2 (§3.2.1): a rank idles
    (p − 1)(T_F&B + T_B̄ − 3T_W) (helpers.cost.bubble.closed_form_idle) while it works
    2m·(T_F + T_B + T_W), its two chunks' m micro-batches. With T_F = T_B = T_W (each of the
    three passes is one matmul per weight) that is 2(p − 1) against 6m: (p − 1)/(3m + p − 1),
    a third of 1F1B's (p − 1)/(m + p − 1) when m ≫ p."""
    return (p - 1) / (3 * m + p - 1)


def _compute(per_layer: dict[str, tuple[float, float]], lay: Layout, m: int,
             layers: int) -> dict[str, float]:
    """Seconds of compute on the busiest stage per step: m micro-batches of its layers, the
    head once per micro-batch, and the forward that recomputation runs again."""
    compute = {name: m * (1 if name == HEAD else layers) * both
               for name, (both, _) in per_layer.items()}
    if lay.recompute == "full":
        compute["recomputed forward"] = m * layers * sum(f for _, f in per_layer.values())
    elif lay.recompute == "selective":
        compute["recomputed forward"] = m * layers * per_layer[SCORES][1]
    return compute


@lru_cache(maxsize=256)
def _model_flops(mdl: Transformer, seq: int) -> float:
    return mdl.model_flops_per_token(seq)


def _step(job: Job, lay: Layout, per_layer: dict[str, tuple[float, float]],
          comm: tuple, pricing: Pricing, compute: dict[str, float] | None = None) -> Step:
    mdl, gpu = job.model, job.gpu
    m = lay.m(job)
    if compute is None:
        compute = _compute(per_layer, lay, m, stage_layers(mdl, lay.p))
    hidden, exposed, tp_lat, pp_lat, dp_lat = comm
    tp = sum(x for name, x in hidden.items() if name.startswith("TP"))
    others = sum(hidden.values()) - tp
    work = sum(compute.values())
    v = lay.v if lay.schedule == "interleaved" else 1
    if lay.schedule == "dualpipev":   # no bubble in notebook 06's rules; its own, added
        pipe, _ = step_seconds(work, tp, tp_lat, others, pp_lat, 0.0, 0.0,
                               lay.p, m, v, True, pricing.overlap_tp, True, False)
        bubble = dualpipev_bubble(lay.p, m)
        seconds = pipe / (1 - bubble) + sum(exposed.values()) + dp_lat
    else:
        seconds, bubble = step_seconds(work, tp, tp_lat, others, pp_lat,
                                       sum(exposed.values()), dp_lat, lay.p, m, v,
                                       lay.schedule == "zb-h2", pricing.overlap_tp, True, False)
    mfu = _model_flops(mdl, job.seq) * job.tokens / (job.gpus * gpu.peak_flops * seconds)
    return Step(seconds, bubble, mfu, compute, hidden, exposed, tp_lat + pp_lat + dp_lat)


def _comm(job: Job, lay: Layout) -> tuple[dict, dict, float, float, float]:
    """(overlapped parts, exposed parts, TP, PP and DP latency) of one step, in seconds:
    notebook 06's formulas where they apply, each addition named."""
    return _with_micro_batches(_traffic(job, lay), lay, lay.m(job))


def _traffic(job: Job, lay: Layout) -> tuple:
    """What a step moves that does not depend on how the batch is cut into micro-batches
    (everything but ZeRO-2/3's per-micro-batch collectives; m·n, the tokens a GPU sees per
    step, is the same for every b)."""
    mdl, gpu, N = job.model, job.gpu, job.gpus
    m, n, layers = lay.m(job), lay.b * job.seq // lay.c, stage_layers(mdl, lay.p)
    levels, by = gpu.network_levels, gpu.bytes_per_word
    deg = split({"t": lay.t, "c": lay.c, "e": lay.e, "d": lay.d, "p": lay.p})
    ones = (1,) * len(levels)
    L_eff, B = layers * lay.p, job.tokens
    # 1-D TP is the 2-D split with TP_model = 1: h words all-reduced per token, twice a layer
    tp_bw, tp_lat = tp_comm(mdl.hidden, mdl.ffn, L_eff, B, ones, deg["t"], levels, N, by)
    hidden = {"TP all-reduces, MLP (notebook 06)": tp_bw,
              "TP all-reduces, attention": tp_bw}          # as many again, for attention
    pp_bw, pp_lat = ppep_comm(mdl.hidden, L_eff, B, lay.v if lay.schedule == "interleaved"
                              else 1, deg["p"], ones, levels, N, by) if lay.p > 1 else (0.0, 0.0)
    hidden["pipeline hops (notebook 06)"] = pp_bw
    dense, routed = weights_per_gpu(job, lay)
    DPc = tuple(x * y for x, y in zip(deg["d"], deg["c"]))
    DPe = (max(1, DPc[0] // deg["e"][0]), max(1, DPc[1] // deg["e"][1]))

    def reduce(word_bytes: float) -> tuple[float, float]:
        """The gradient all-reduce of notebook 06 over the dense weights' d·c copies and the
        experts' d·c/e, in `word_bytes` a value."""
        bw, lat = dp_comm(dense * lay.t * lay.p, DPc, levels, N, word_bytes)
        if routed:
            e_bw, e_lat = dp_comm(routed * lay.t * lay.p * lay.e, DPe, levels, N, word_bytes)
            bw, lat = bw + e_bw, lat + e_lat
        return bw, lat

    dp_bw, dp_lat = reduce(lay.grad_bytes)
    gather = reduce(PARAM_BYTES)[0] / 2 if lay.zero == 3 else 0.0
    exposed = {}
    if lay.c > 1:       # K and V pass c − 1 hops forward, and again with dK, dV backward
        kv = n * mdl.kv * (mdl.d_qk + mdl.d_v) / lay.t * by
        lvl = levels[1 if deg["c"][1] > 1 else 0]
        hidden["context ring"] = m * layers * 3 * (lay.c - 1) * kv / (lvl.bandwidth_Bps / 2)
    if mdl.moe and lay.e > 1:
        # Notebook 06 sends h words per token to one expert; here top_k copies of this GPU's
        # 1/t of the tokens go out (dispatch) and come back (combine), forward and backward,
        # the share that leaves the node at the outer level's bandwidth. Only DualPipeV,
        # built to overlap it (DeepSeek-V3, §3.2.1), hides it under compute.
        moved = 4 * n / lay.t * mdl.top_k * mdl.hidden * by * (lay.e - 1) / lay.e
        far = (lay.e - deg["e"][0]) / max(1, lay.e - 1)
        per = ((1 - far) / (levels[0].bandwidth_Bps / 2) + far / (levels[1].bandwidth_Bps / 2))
        a2a = m * layers * mdl.moe_layers / mdl.layers * moved * per
        (hidden if lay.schedule == "dualpipev" else exposed)["expert all-to-all"] = a2a
    return hidden, exposed, 2 * tp_lat, pp_lat, dp_lat, dp_bw, gather


def _with_micro_batches(traffic: tuple, lay: Layout, m: int) -> tuple:
    """The step's traffic once the batch is cut into m micro-batches. ZeRO-0/1 all-reduce the
    gradients once, after the last micro-batch (notebook 06: exposed). ZeRO-2/3 keep only
    their shard of the gradients, so each micro-batch's are reduce-scattered (half an
    all-reduce's bytes) while the backward runs, the last one exposed; ZeRO-2 then all-gathers
    the updated weights (exposed); FSDP keeps them sharded and gathers each unit forward and
    backward, every micro-batch (2m all-gathers, hidden)."""
    hidden, exposed, tp_lat, pp_lat, dp_lat, dp_bw, gather = traffic
    hidden, exposed = dict(hidden), dict(exposed)
    if lay.zero <= 1:
        dp = dp_bw
    else:
        hidden["ZeRO gradient reduce-scatters, per micro-batch"] = (m - 1) * dp_bw / 2
        dp = dp_bw if lay.zero == 2 else dp_bw / 2
    if lay.zero == 3:
        hidden["FSDP gathers"] = 2 * m * gather
    exposed = {"DP gradient reduction (notebook 06)": dp, **exposed}
    return hidden, exposed, tp_lat, pp_lat, dp_lat


# ---------------------------------------------------------------------------------------
# Every layout
# ---------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _structures(job: Job, bs=(1, 2, 4)):
    """(t, c, p, d, e, b, schedule, v) of every layout: t ≤ 8, c, p ≤ L, e, b, and for a
    pipeline 1F1B, interleaved (v = 2, 4, 8 while p·v ≤ L), ZB-H2 and DualPipeV."""
    mdl, N = job.model, job.gpus
    for t in (x for x in (1, 2, 4, 8) if N % x == 0):
        for c in (x for x in (1, 2, 4, 8, 16) if (N // t) % x == 0):
            for p in (x for x in _divisors(N // (t * c)) if x <= mdl.layers):
                d = N // (t * c * p)
                es = [x for x in _divisors(d) if mdl.experts % x == 0] if mdl.moe else [1]
                scheds = [("1f1b", 1)] if p == 1 else (
                    [("1f1b", 1)] + [("interleaved", v) for v in (2, 4, 8) if p * v <= mdl.layers]
                    + [("zb-h2", 1), ("dualpipev", 1)])
                for e in es:
                    for b in bs:
                        for sched, v in scheds:
                            yield t, c, p, d, e, b, sched, v


def candidates(job: Job, recompute=RECOMPUTE, zero=(1, 2, 3), bs=(1, 2, 4), fp8=False):
    """Every layout the enumeration tries, sequence parallelism on whenever t > 1."""
    for t, c, p, d, e, b, sched, v in _structures(job, bs):
        for r in recompute:
            for z in zero:
                yield Layout(t, p, d, c, e, v, b, z, t > 1, r, sched, fp8=fp8)


@dataclass(frozen=True)
class Verdict:
    layout: Layout
    memory: Memory | None
    step: Step | None
    limits: tuple[str, ...]


def enumerate_layouts(job: Job, pricing: Pricing = Pricing(), recompute=RECOMPUTE,
                      zero=(1, 2, 3), bs=(1, 2, 4), fp8: bool = False) -> list[Verdict]:
    """Every candidate (`candidates`, in its order) with its memory (None if malformed), step
    and MFU (None if it cannot run), and the limits it breaks. What does not depend on a knob
    is priced once for all its values: a structure's limits, weights and traffic; a layer's
    compute on (t, e, tokens); the activations on everything but ZeRO."""
    out, layer_cache, traffic_cache = [], {}, {}
    mdl = job.model
    for t, c, p, d, e, b, sched, v in _structures(job, bs):
        first = Layout._trusted(t, p, d, c, e, v, b, zero[0], t > 1, "selective", sched, fp8)
        base = _malformed(job, first)
        weights = weights_per_gpu(job, first)
        steps, computes = {}, {}
        for r in recompute:
            lays = [Layout._trusted(t, p, d, c, e, v, b, z, t > 1, r, sched, fp8) for z in zero]
            why = _malformed(job, lays[0]) if c > 1 and r == "none" else base
            if why:
                out += [Verdict(lay, None, None, tuple(why)) for lay in lays]
                continue
            acts = _activations(job, lays[0])
            for lay in lays:
                mem = _memory(mdl, lay, weights, acts)
                big = memory_limit(job, mem)
                if big:
                    out.append(Verdict(lay, mem, None, tuple(big)))
                    continue
                kind = max(lay.zero, 1)             # ZeRO-0 and 1 move the same bytes
                if (r, kind) not in steps:
                    tkey = (t, c, p, d, e, sched, v, kind == 3)
                    if tkey not in traffic_cache:
                        traffic_cache[tkey] = _traffic(job, lay)
                    key = (t, e, b * job.seq // c)       # (fp8 is the same for the whole run)
                    if key not in layer_cache:
                        layer_cache[key] = _layer_compute(job, lay, key[2], pricing)
                    m = lay.m(job)
                    if r not in computes:
                        computes[r] = _compute(layer_cache[key], lay, m, stage_layers(mdl, p))
                    comm = _with_micro_batches(traffic_cache[tkey], lay, m)
                    steps[r, kind] = _step(job, lay, layer_cache[key], comm, pricing,
                                           computes[r])
                out.append(Verdict(lay, mem, steps[r, kind], ()))
    return out


def best(verdicts: list[Verdict]) -> Verdict | None:
    """The fastest feasible layout (highest MFU); on a tie, the one that holds less memory.
    None when nothing fits."""
    ok = [v for v in verdicts if v.step is not None]
    return min(ok, key=lambda v: (v.step.seconds, v.memory.total), default=None)


# ---------------------------------------------------------------------------------------
# The worked example: the rules a person follows, in order
# ---------------------------------------------------------------------------------------

def step_by_step(job: Job, zero: int = 2, recompute: str = "selective",
                 schedule: str = "1f1b", b: int = 1) -> tuple[list[str], Layout | None]:
    """Memory first, then TP inside the node, then PP, then DP: each step's reason printed,
    and the layout they lead to (None if no p makes it fit)."""
    mdl, N, hbm = job.model, job.gpus, job.gpu.hbm_bytes
    said = [f"1. memory: 16 B × {mdl.params() / 1e9:.0f} G weights = "
            f"{16 * mdl.params() / 1e12:.1f} TB of model state, the HBM of "
            f"{math.ceil(16 * mdl.params() / hbm):,} GPUs before a single activation"]
    t = max(x for x in (1, 2, 4, 8) if not (mdl.heads % x or mdl.ffn % x or N % x))
    said.append(f"2. t = {t}: tensor parallelism as wide as a node's NVLink allows; sequence "
                f"parallelism with it" if t > 1 else "2. t = 1: the model's shape or the GPUs "
                "allow no tensor parallelism")
    for p in (x for x in _divisors(N // t) if x <= mdl.layers):
        lay = Layout(t=t, p=p, d=N // (t * p), b=b, zero=zero, recompute=recompute,
                     schedule=schedule if p > 1 else "1f1b")
        if _malformed(job, lay):
            continue
        mem = memory(job, lay)
        said.append(f"3. p = {p:>3}: weights per GPU {weights_per_gpu(job, lay)[0] / 1e9:5.2f} G,"
                    f" state {(mem.total - mem.activations) / 1e9:5.1f} GB + activations "
                    f"{mem.activations / 1e9:5.1f} GB = {mem.total / 1e9:5.1f} GB"
                    + (" fits" if mem.total <= hbm else ""))
        if mem.total <= hbm:
            said.append(f"4. d = {N:,} / ({t}·{p}) = {lay.d}: the rest of the GPUs copy the "
                        f"model; m = {lay.m(job)} micro-batches of {b}")
            return said, lay
    said.append("no p fits: longer pipelines do not shrink 1F1B's activations (the first stage "
                "holds L layers' worth); recompute more, or add context parallelism")
    return said, None
