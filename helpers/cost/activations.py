"""Activation memory of a transformer on one GPU: Korthikanti et al.'s count, per layer and in flight.

Korthikanti et al. 2022, *Reducing Activation Recomputation in Large Transformer Models*
(arXiv:2205.05198), §4: one layer keeps, for its backward, s·b·h·(34 + 5·a·s/h) bytes in 16-bit
training (2 bytes a value, 1 a dropout mask):

    layer norms' inputs 4 · QKV's input 2 · Q, K 4 · softmax out 2as, its dropout mask as and
    output 2as · V 2 · out-projection's input 2 · its dropout mask 1     (attention: 11 + 5as/h)
    MLP input 2 · GeLU input 8 · GeLU output 8 · dropout mask 1          (MLP: 19)

in units of s·b·h. Tensor parallelism (t) splits what lies between its two collectives, 24 of
the 34 and the scores: sbh(10 + 24/t + 5as/(ht)) (their eq. 2). Sequence parallelism splits
the other 10 along the sequence: sbh(34 + 5as/h)/t. Selective recomputation drops the scores
(recomputed in backward; flash attention never stores them), full recomputation keeps only
each layer's input, 2sbh (÷ t with sequence parallelism).

`layer_bytes` generalises the count to the shapes of notebook 10 (grouped keys and values, a
gated MLP, experts, no dropout) and reduces to the paper's numbers for a GPT layer. The
schedule sets how many micro-batches a stage holds at its peak (`in_flight`, checked against
the plans of notebook 05).
"""
from __future__ import annotations

import math
from functools import lru_cache

from helpers.checks import check_choice, check_int

from .model_shapes import Transformer

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h2", "dualpipev")


def layer_bytes(model: Transformer, seq: int, tokens: float, t: int = 1, sp: bool = False,
                recompute: str = "none", dropout: bool = True, moe: bool = False,
                value_bytes: float = 2) -> float:
    """Bytes one layer keeps for `tokens` tokens of sequences of length `seq` on one of t
    tensor-parallel GPUs, `value_bytes` per value (2 in 16-bit training; a dropout mask 1).
    `moe` prices an MoE layer's MLP (top_k experts plus the shared ones per token, and the
    top_k copies of the token dispatched to them). GPT-3 in the paper's setting gives
    s·b·h·(10 + 24/t + 5as/(ht))."""
    check_choice("recompute", recompute, RECOMPUTE)
    check_int("t (tensor degree)", t)
    h, w = model.hidden, value_bytes
    if recompute == "full":
        return w * h * tokens / (t if sp else 1)
    masks = 1 if dropout else 0
    # Outside tensor parallelism's two collectives: two norms' inputs, the inputs of QKV and
    # of the MLP (the norms' outputs), two dropout masks.
    outside = 4 * w * h + 2 * masks * h
    attention = w * (model.heads * model.d_qk + model.kv * model.d_qk + model.kv * model.d_v
                     + model.heads * model.d_v)               # Q, K, V, out-projection input
    per_mlp = (3 if model.gated else 2) * w                    # bytes per unit of width
    if moe:  # each of the top_k experts keeps its own copy of the token's input
        mlp = (per_mlp * model.expert_ffn * (model.top_k + model.shared_experts)
               + w * h * model.top_k)
    else:
        mlp = per_mlp * model.ffn
    scores = 0.0 if recompute == "selective" else (w + (w + 1) * masks) * model.heads * seq
    inside = attention + mlp + scores
    if sp:
        return tokens * (outside + inside) / t
    return tokens * (outside + inside / t)


def in_flight(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Micro-batches' worth of a stage's layers that its busiest rank holds at once: GPipe
    all m; 1F1B and ZB-H1 min(p, m) (the first rank); interleaved 1F1B (v chunks of L/(pv)
    layers) min(mv, vp + p − 1)/v, the paper's 1 + (p − 1)/(pv) times p; ZB-H2 min(2p − 1, m);
    DualPipeV 2p + 1 chunks of half a stage. `tests/test_planner.py` checks each against
    `helpers.cost.schedules.peak_live` of the plans notebook 05 runs."""
    check_choice("schedule", schedule, SCHEDULES)
    for name, value in (("p (pipeline stages)", p), ("m (micro-batches)", m), ("v", v)):
        check_int(name, value)
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p, m)
    if schedule == "interleaved":
        return min(m * v, v * p + p - 1) / v
    if schedule == "zb-h2":
        return min(2 * p - 1, m)
    return (2 * p + 1) / 2


def stage_layers(model: Transformer, p: int) -> int:
    """Layers on the busiest stage: ⌈L/p⌉ (Llama 3 405B's 126 layers on 16 stages: 8)."""
    return math.ceil(model.layers / p)


def extra_bytes(model: Transformer, tokens: float, t: int, held: float) -> tuple[float, float]:
    """(first stage, last stage): beyond the layers, the paper's §4.3 terms. The first stage
    keeps the embedding's dropout mask, s·b·h/t per micro-batch held; the last keeps the final
    norm's and the output projection's inputs and the fp32 logits, 4·s·b·h·(1 + V/h)/t,
    once (its micro-batch leaves before the next arrives). The first stage is the busiest
    under 1F1B and its kin; `activation_bytes` counts it, adding the last's only when p = 1."""
    first = tokens * model.hidden * held / t
    last = 4 * tokens * (model.hidden + model.vocab) / t
    return first, last


@lru_cache(maxsize=1 << 16)  # pure; notebook 10 enumerates thousands of layouts
def activation_bytes(model: Transformer, seq: int, b: int, t: int = 1, p: int = 1, m: int = 1,
                     v: int = 1, c: int = 1, sp: bool = False, recompute: str = "none",
                     schedule: str = "1f1b", dropout: bool = True) -> float:
    """Peak activation bytes on the busiest GPU: its stage's layers (an MoE model's mix of
    dense and MoE layers in proportion) times the micro-batches in flight, plus the first
    stage's embedding term, or with p = 1 the head's too. Context parallelism (c) gives each
    GPU s/c of every sequence's tokens; it requires the scores not to be stored."""
    for name, value in (("seq", seq), ("b (micro-batch)", b), ("t", t), ("c", c)):
        check_int(name, value)
    tokens = b * seq / c
    held = in_flight(schedule, p, m, v)
    layers = stage_layers(model, p)
    share_moe = model.moe_layers / model.layers
    per_layer = ((1 - share_moe) * layer_bytes(model, seq, tokens, t, sp, recompute, dropout)
                 + share_moe * layer_bytes(model, seq, tokens, t, sp, recompute, dropout,
                                           moe=True))
    first, last = extra_bytes(model, tokens, t, held)
    return per_layer * layers * held + first + (last if p == 1 else 0.0)


# DeepSeek-V3's multi-head latent attention keeps, per token, a query latent of 1,536 values
# and a key-value latent of 512 plus a 64-value rotary key (arXiv:2412.19437, §2.1.1, §4.2).
MLA_LATENT = 1536 + 512 + 64


def deepseek_v3_savings(model: Transformer, tokens: float) -> dict[str, float]:
    """Bytes one MoE layer of DeepSeek-V3 no longer keeps for `tokens` tokens at t = 1, by the
    report's three measures (arXiv:2412.19437): recomputing the RMSNorms' outputs and MLA's
    up-projections in the backward (§3.2.3: the latents are kept instead of Q, K and V), and
    caching the experts' inputs and SwiGLU's inputs in FP8, SwiGLU's output recomputed (§3.3.4).
    Each is a term of `layer_bytes(..., moe=True)` taken out or halved."""
    h, k, f = model.hidden, model.top_k, model.expert_ffn
    qkv = 2 * (model.heads * model.d_qk + model.kv * (model.d_qk + model.d_v))
    return {"RMSNorm outputs recomputed": 4 * h * tokens,
            "MLA up-projections recomputed (latents kept)": (qkv - 2 * MLA_LATENT) * tokens,
            "experts' inputs in FP8": h * k * tokens,
            "SwiGLU inputs in FP8, output recomputed": 4 * f * (k + model.shared_experts) * tokens}
