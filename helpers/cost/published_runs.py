"""Training runs that someone published, each as the planner's job and layout, and what they reported.

Each run reports its efficiency its own way: MFU or TFLOP/s per GPU, attention counted or not,
recomputation counted or not, against one peak or another. `published_mfu` converts each to
the course's convention (`Transformer.model_flops_per_token`: 6 FLOP per active matmul weight
plus attention over the whole sequence, no recomputation, against the dense bf16 peak of the
GPU record):

    MFU = reported FLOP/s per GPU × (our FLOPs per token / theirs) / our peak

Where a knob of the layout was not published (the interleaving v, the micro-batch b), the row
lets the planner choose it (`free`): the fastest choice that fits, so the prediction stays an
upper bound. Stated before looking: the model is optimistic, so its MFU should be at least the
published one and within 1.6× of it (notebook 10 checks every row and names the cause of any
miss).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from helpers.hardware import A100_SXM_80GB, H100_SXM, H800_SXM

from .model_shapes import DEEPSEEK_V3, LLAMA3_405B, Transformer
from .planner import Job, Layout, limits, memory, step

OPTIMISTIC_WITHIN = 1.6   # predicted MFU ∈ [published, 1.6 × published]


def gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200,
        tied: bool = True) -> Transformer:
    """A GPT-3-style model as Megatron-LM trains it: MLP 4h, vocabulary padded to 51,200, the
    output head tied to the embedding."""
    return Transformer(name, layers, hidden, heads, 4 * hidden, vocab, tied_embeddings=tied)


def megatron_model_flops(model: Transformer, seq: int) -> float:
    """Korthikanti et al. 2022, appendix A, per token: 72·L·h²·(1 + s/(6h) + V/(12hL))."""
    L, h, V = model.layers, model.hidden, model.vocab
    return 72 * L * h * h * (1 + seq / (6 * h) + V / (12 * h * L))


def megatron_2021_flops(model: Transformer, seq: int) -> float:
    """Narayanan et al. 2021, eq. 3, per token: 96·L·h²·(1 + s/(6h) + V/(16Lh)), which counts
    the forward recomputed by full activation checkpointing (96 = 4/3 · 72)."""
    L, h, V = model.layers, model.hidden, model.vocab
    return 96 * L * h * h * (1 + seq / (6 * h) + V / (16 * L * h))


def palm_flops(model: Transformer, seq: int) -> float:
    """Chowdhery et al. 2022, appendix B, per token: 6N + 12·L·H·Q·T, N the non-embedding
    weights (Llama 3 cites it for its MFU)."""
    non_embedding = model.params() - model.embedding_params()
    return 6 * non_embedding + 12 * model.layers * model.heads * model.d_qk * seq


def eight_n_flops(model: Transformer, seq: int) -> float:
    """BigScience's estimate, 8 FLOP per weight per token (6 plus 2 for the recomputed
    forward), attention left out."""
    return 8 * model.params()


@dataclass(frozen=True)
class PublishedRun:
    name: str
    citation: str
    job: Job | None                 # None: hardware the GPU model does not describe
    layout: Layout | None
    reported: float                 # the number as published
    unit: str                       # "MFU", "TFLOP/s per GPU" or "GPU-hours"
    convention: str                 # their counting, in words
    their_flops: object = None      # (model, seq) -> FLOPs per token as they count them
    their_peak: float = 0.0         # FLOP/s they divide by, when they report MFU
    free: dict = None               # unpublished knobs: name -> values the planner may try
    note: str = ""

    def published_mfu(self) -> float | None:
        """The reported efficiency in the course's convention (see the module's docstring)."""
        if self.job is None:
            return None
        model, seq, peak = self.job.model, self.job.seq, self.job.gpu.peak_flops
        ours = model.model_flops_per_token(seq)
        if self.unit == "MFU":
            flops_per_gpu = self.reported * self.their_peak
            return flops_per_gpu * ours / self.their_flops(model, seq) / peak
        if self.unit == "TFLOP/s per GPU":
            return self.reported * 1e12 * ours / self.their_flops(model, seq) / peak
        tokens, gpu_hours = self.reported                 # GPU-hours: (tokens, hours)
        return tokens / (gpu_hours * 3600) * ours / peak

    def planned(self) -> Layout:
        """The published layout with each unpublished knob set to the planner's fastest
        choice that fits (or, if none fits, its fastest)."""
        if not self.free:
            return self.layout
        options = [self.layout]
        for name, values in self.free.items():
            options = [replace(lay, **{name: x}) for lay in options for x in values]
        options = [lay for lay in options if not limits(self.job, lay, check_memory=False)]
        fits = [lay for lay in options if not limits(self.job, lay)]
        return min(fits or options, key=lambda lay: step(self.job, lay).seconds)


A100_PEAK, H100_PEAK = 312e12, 989e12    # the datasheets' dense 16-bit peaks the papers use


def _llama3(name: str, gpus: int, seq: int, batch: int, split: Layout, mfu: float,
            note: str) -> PublishedRun:
    """A row of Llama 3's Table 4: 405B on H100s, FSDP without resharding (ZeRO-2's memory),
    fp32 gradient reduction, flash attention, an interleaved schedule whose v the planner picks."""
    layout = replace(split, b=1, zero=2, recompute="selective", schedule="interleaved", v=2,
                     grad_bytes=4)
    return PublishedRun(name, "Dubey et al. 2024, 'The Llama 3 Herd of Models' "
                        "(arXiv:2407.21783), Table 4", Job(LLAMA3_405B, H100_SXM, gpus, seq, batch),
                        layout, mfu, "MFU", "BF16 MFU in PaLM's convention, attention counted, "
                        "against 989 TFLOP/s", palm_flops, H100_PEAK, {"v": (2, 4, 8)}, note=note)

KORTHIKANTI = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large "
               "Transformer Models' (arXiv:2205.05198), Tables 3 and 5; MFU as in NVIDIA's "
               "Megatron-LM README")
_K = dict(recompute="selective", dropout=True, grad_bytes=4, zero=0)

RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("Megatron 175B (Korthikanti)", KORTHIKANTI,
                 Job(gpt("GPT 175B", 96, 12288, 96), A100_SXM_80GB, 64, 2048, 64),
                 Layout(t=8, p=8, d=1, b=1, **_K), 0.514, "MFU",
                 "MFU, attention counted, recomputation not, against 312 TFLOP/s",
                 megatron_model_flops, A100_PEAK),
    PublishedRun("Megatron 530B (Korthikanti)", KORTHIKANTI,
                 Job(gpt("GPT 530B", 105, 20480, 128), A100_SXM_80GB, 280, 2048, 280),
                 Layout(t=8, p=35, d=1, b=1, **_K), 0.560, "MFU",
                 "MFU, attention counted, recomputation not, against 312 TFLOP/s",
                 megatron_model_flops, A100_PEAK),
    PublishedRun("Megatron 1T (Korthikanti)", KORTHIKANTI,
                 Job(gpt("GPT 1T", 128, 25600, 160), A100_SXM_80GB, 512, 2048, 512),
                 Layout(t=8, p=64, d=1, b=1, **_K), 0.563, "MFU",
                 "MFU, attention counted, recomputation not, against 312 TFLOP/s",
                 megatron_model_flops, A100_PEAK),
    PublishedRun("Megatron-LM 1T (Narayanan)",
                 "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU "
                 "Clusters Using Megatron-LM' (arXiv:2104.04473), Table 1, last row",
                 Job(gpt("GPT 1T", 128, 25600, 160), A100_SXM_80GB, 3072, 2048, 3072),
                 Layout(t=8, p=64, d=6, b=1, recompute="full", sp=False, dropout=True,
                        grad_bytes=4, zero=0), 163, "TFLOP/s per GPU",
                 "TFLOP/s per GPU by eq. 3: attention and the recomputed forward counted",
                 megatron_2021_flops, A100_PEAK),
    PublishedRun("MegaScale 175B",
                 "Jiang et al. 2024, 'MegaScale: Scaling Large Language Model Training to More "
                 "Than 10,000 GPUs' (arXiv:2402.15627), Tables 1 and 2 (12,288 GPUs)",
                 Job(gpt("MegaScale 175B", 96, 12288, 128), A100_SXM_80GB, 12288, 2048, 6144),
                 Layout(t=8, p=8, d=192, b=1, zero=2, recompute="selective"), 0.552, "MFU",
                 "MFU; taken as Megatron-LM's model FLOPs (the run builds on it), 312 TFLOP/s",
                 megatron_model_flops, A100_PEAK,
                 {"v": (1, 2, 3, 4), "schedule": ("1f1b", "interleaved"), "b": (1, 2)},
                 note="the A100's memory size is not stated; 80 GB assumed"),
    PublishedRun("BLOOM 176B",
                 "BigScience 2022, training chronicles of tr11-176B-ml (384 A100 80 GB, PP 12, "
                 "DP 8, micro-batch 2, batch 2,048, 149-150 TFLOP/s per GPU)",
                 Job(Transformer("BLOOM 176B", 70, 14336, 112, 4 * 14336, 250880,
                                 tied_embeddings=True), A100_SXM_80GB, 384, 2048, 2048),
                 Layout(t=4, p=12, d=8, b=2, zero=1, recompute="full", sp=False,
                        dropout=True, grad_bytes=4), 150, "TFLOP/s per GPU",
                 "TFLOP/s per GPU by 8·N·D: the recomputed forward counted, attention not",
                 eight_n_flops, A100_PEAK,
                 note="TP 4 (= 384 / (12·8)) and ZeRO-1 from the BLOOM paper as others quote it"),
    _llama3("Llama 3 405B, 8K GPUs", 8192, 8192, 2048, Layout(t=8, p=16, d=64), 0.43,
            "flash attention, no activation checkpointing; v not published"),
    _llama3("Llama 3 405B, 16K GPUs", 16384, 8192, 2048, Layout(t=8, p=16, d=128), 0.41,
            "flash attention, no activation checkpointing; v not published"),
    _llama3("Llama 3 405B, 128K context", 16384, 131072, 128, Layout(t=8, c=16, p=16, d=8),
            0.38, "context parallelism 16; v not published"),
    PublishedRun("DeepSeek-V3",
                 "DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report' (arXiv:2412.19437), §3.1-3.2 "
                 "(PP 16, EP 64 over 8 nodes, ZeRO-1, no TP, DualPipe), §4.2 (4K sequence, "
                 "batch 15,360), Table 1 (2,664K H800 GPU-hours for 14.8T tokens)",
                 Job(DEEPSEEK_V3, H800_SXM, 2048, 4096, 15360),
                 Layout(t=1, p=16, d=128, e=64, b=1, zero=1, recompute="selective",
                        schedule="dualpipev", sp=False, grad_bytes=4, fp8=True),
                 (14.8e12, 2.664e6),
                 "GPU-hours", "no MFU reported: tokens per GPU-hour, every stall and restart "
                 "included; its matmuls ran in FP8, whose peak is twice bf16's"),
    PublishedRun("PaLM 540B",
                 "Chowdhery et al. 2022, 'PaLM: Scaling Language Modeling with Pathways' "
                 "(arXiv:2204.02311), §4: 6,144 TPU v4, 12-way model × 256-way data × 2 pods",
                 None, None, 0.462, "MFU",
                 "MFU 46.2 % (HFU 57.8 %) on TPU v4: not modelled, the GPU record does not "
                 "describe a TPU"),
)


@dataclass(frozen=True)
class Check:
    run: PublishedRun
    layout: Layout | None
    memory_gb: float | None
    fits: bool | None
    predicted: float | None
    published: float | None

    @property
    def ratio(self) -> float | None:
        if self.predicted is None or not self.published:
            return None
        return self.predicted / self.published

    @property
    def holds(self) -> bool | None:
        """The stated expectation: published ≤ predicted ≤ 1.6 × published."""
        r = self.ratio
        return None if r is None else 1 <= r <= OPTIMISTIC_WITHIN


def reality_check(runs=RUNS) -> list[Check]:
    out = []
    for run in runs:
        if run.job is None:
            out.append(Check(run, None, None, None, None, None))
            continue
        lay = run.planned()
        mem = memory(run.job, lay).total
        out.append(Check(run, lay, mem / 1e9, mem <= run.job.gpu.hbm_bytes,
                         step(run.job, lay).mfu, run.published_mfu()))
    return out

