"""Notebook 10's planner: activations against Korthikanti et al., model states against DeepSpeed's
estimator, in-flight micro-batches against notebook 05's plans, the step against notebook 06's
equations, and the layouts' limits."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from helpers.cost.activations import activation_bytes, in_flight, layer_bytes
from helpers.cost.memory import zero_memory_per_rank
from helpers.cost.model_shapes import DEEPSEEK_V3, LLAMA3_405B, LLAMA3_8B, MODELS
from helpers.cost import planner
from helpers.cost.planner import (Job, Layout, Pricing, best, enumerate_layouts, limits, memory,
                                  split, step)
from helpers.cost.published_runs import (RUNS, gpt, megatron_model_flops, reality_check)
from helpers.cost.schedules import make_plan, peak_live
from helpers.hardware import A100_SXM_80GB, H100_SXM
from helpers.simulator.matmul import matmul_time

# Korthikanti et al. 2022, Table 3: (a, h, L, t, p, GPUs, global batch, micro-batch).
PAPER_MODELS = {"22B": (64, 6144, 48, 8, 1, 8, 4, 4), "175B": (96, 12288, 96, 8, 8, 64, 64, 1),
                "530B": (128, 20480, 105, 8, 35, 280, 280, 1),
                "1T": (160, 25600, 128, 8, 64, 512, 512, 1)}
S = 2048


@pytest.mark.parametrize("name", PAPER_MODELS)
def test_layer_bytes_are_the_papers_equations(name):
    a, h, L, t, *_ = PAPER_MODELS[name]
    model = gpt(name, L, h, a)
    sbh = S * h                                                  # b = 1
    assert layer_bytes(model, S, S) == pytest.approx(sbh * (34 + 5 * a * S / h))        # eq. 1
    assert layer_bytes(model, S, S, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * S / (h * t)))
    assert layer_bytes(model, S, S, t, sp=True) == pytest.approx(sbh / t * (34 + 5 * a * S / h))
    assert layer_bytes(model, S, S, t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert layer_bytes(model, S, S, t, True, "selective") == pytest.approx(sbh * 34 / t)
    assert layer_bytes(model, S, S, t, recompute="full") == pytest.approx(2 * sbh)


def test_the_papers_stated_savings():
    """§5: selective recomputation saves 70 % of the activations of GPT-3 175B and 65 % of
    MT-NLG 530B's; with sequence parallelism about 5x less than tensor parallelism alone."""
    for name, saving in (("175B", 0.70), ("530B", 0.65)):
        a, h, L, t, *_ = PAPER_MODELS[name]
        model = gpt(name, L, h, a)
        kept = layer_bytes(model, S, S, recompute="selective") / layer_bytes(model, S, S)
        assert 1 - kept == pytest.approx(saving, abs=0.005)
    for name, (a, h, L, t, *_rest) in PAPER_MODELS.items():
        model = gpt(name, L, h, a)
        ratio = layer_bytes(model, S, S, t) / layer_bytes(model, S, S, t, True, "selective")
        assert 4.5 < ratio < 6.5, (name, ratio)


def test_first_stage_holds_L_layers_of_one_micro_batch():
    """1F1B: p micro-batches of L/p layers, whatever p (the paper's §4.2.3), plus its sbhp/t."""
    a, h, L, t, p, *_ = PAPER_MODELS["1T"]
    model = gpt("1T", L, h, a)
    total = activation_bytes(model, S, 1, t, p, m=512, sp=True, recompute="selective",
                             dropout=True)
    assert total == pytest.approx(S * h * L * 34 / t + S * h * p / t)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                        ("interleaved", 3), ("zb-h2", 1), ("dualpipev", 1)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_in_flight_is_the_plans_peak(schedule, v, p, m):
    """The closed forms equal the most (chunk, micro-batch) pairs any rank of notebook 05's
    plans holds, in stages' worth (a chunk is 1/v of a stage; DualPipeV's is half)."""
    plans = [make_plan(schedule, p, m, r, v if schedule == "interleaved" else None)
             for r in range(p)]
    chunks = v if schedule == "interleaved" else 2 if schedule == "dualpipev" else 1
    assert in_flight(schedule, p, m, v) == max(peak_live(x) for x in plans) / chunks


def test_model_shapes_published_sizes():
    assert LLAMA3_405B.params() / 1e9 == pytest.approx(405, rel=0.01)
    assert LLAMA3_8B.params() / 1e9 == pytest.approx(8.0, rel=0.01)
    assert DEEPSEEK_V3.params() / 1e9 == pytest.approx(671, rel=0.01)
    assert DEEPSEEK_V3.active_params() / 1e9 == pytest.approx(37, rel=0.02)
    gpt3 = MODELS["GPT-3 175B"]
    assert gpt3.params() / 1e9 == pytest.approx(175, rel=0.01)


def test_our_flops_are_megatrons_for_a_gpt():
    """Korthikanti's appendix A model FLOPs and the course's convention agree on a GPT."""
    model = gpt("175B", 96, 12288, 96)
    assert model.model_flops_per_token(S) == pytest.approx(megatron_model_flops(model, S),
                                                           rel=1e-12)


# --- DeepSpeed's memory estimator, the examples of its documentation (t5-3b, 8 GPUs) --------
GiB = 2 ** 30
P, LARGEST, N = 2851e6, 32e6, 8


def test_deepspeed_zero3_examples():
    """estimate_zero3_model_states_mem_needs_all_cold: 6.09 GB per GPU without offload
    (2 + 4 + 12 bytes per weight sharded: bf16 weight, fp32 gradient, fp32 master and moments,
    plus the largest layer gathered with its gradient, 4 bytes a weight); 0.78 GB with the
    optimizer offloaded (the bf16 shard and that layer)."""
    ours = zero_memory_per_rank(P, N, 3, 2, 4, 12).total + 4 * LARGEST
    assert round(ours / GiB, 2) == 6.09
    shard = zero_memory_per_rank(P, N, 3, 2, 4, 12).params + 4 * LARGEST
    assert round(shard / GiB, 2) == 0.78


def test_deepspeed_zero2_examples():
    """The documentation's 15.93 GB is its older formula 4Ψ + 16Ψ/N: ZeRO-1's arithmetic with
    a full bf16 gradient and K = 16 (fp32 master, gradient, moments) sharded. Its source now
    says 2Ψ + 18Ψ/N: ZeRO-2 with both gradients (bf16 and fp32, 6 bytes) sharded."""
    assert round(zero_memory_per_rank(P, N, 1, 2, 2, 16).total / GiB, 2) == 15.93
    assert zero_memory_per_rank(P, N, 2, 2, 6, 12).total == pytest.approx(2 * P + 18 * P / N)


# --- the planner ----------------------------------------------------------------------------
JOB = Job(LLAMA3_405B, H100_SXM, 16384, 8192, 2048)
META = Layout(t=8, p=16, d=128, b=1, zero=2, recompute="selective", schedule="interleaved",
              v=2, grad_bytes=4)


def test_one_d_tp_mlp_is_notebook_06s_six_matmuls():
    """The MLP's matmul time is the simulator's `six` with TP_model = 1, TP_ff = t, bit for bit
    (Llama's gate is an addition, so a GPT is used)."""
    job = Job(gpt("GPT 175B", 96, 12288, 96), A100_SXM_80GB, 64, 2048, 64)
    lay = Layout(t=8, p=8, d=1, b=1)
    st = step(job, lay)
    gpu, f, h, n = job.gpu, job.model.ffn // 8, job.model.hidden, 2048
    six = (matmul_time(gpu, f, h, n) + matmul_time(gpu, h, f, n) + matmul_time(gpu, f, h, n, True)
           + matmul_time(gpu, h, f, n) + matmul_time(gpu, f, h, n) + matmul_time(gpu, h, f, n, True))
    assert st.compute["MLP matmuls (notebook 06)"] == pytest.approx((96 // 8) * 64 * six,
                                                                    rel=1e-12)


def test_memory_terms_follow_zero_and_tp():
    mem = memory(JOB, META)
    dense_weights = (LLAMA3_405B.dense_params() * 8 / 126 + LLAMA3_405B.vocab
                     * LLAMA3_405B.hidden) / 8
    assert mem.params == pytest.approx(2 * dense_weights)
    assert mem.grads == pytest.approx(4 * dense_weights / 128)          # ZeRO-2, fp32
    assert mem.optimizer == pytest.approx(12 * dense_weights / 128)
    fsdp = memory(JOB, replace(META, zero=3))
    assert fsdp.params == pytest.approx(mem.params / 128) and fsdp.buffers > 0


def test_split_fills_the_node_tp_first():
    assert split({"t": 8, "c": 1, "e": 1, "d": 128, "p": 16}) == {
        "t": (8, 1), "c": (1, 1), "e": (1, 1), "d": (1, 128), "p": (1, 16)}
    assert split({"t": 2, "c": 2, "e": 1, "d": 4, "p": 2}) == {
        "t": (2, 1), "c": (2, 1), "e": (1, 1), "d": (2, 2), "p": (1, 2)}


def test_limits_name_what_breaks():
    assert limits(JOB, META) == []
    assert any("t·p·d·c" in x for x in limits(JOB, replace(META, d=64)))
    assert any("m ≥" in x for x in limits(JOB, replace(META, p=32, d=64, b=2, v=1,
                                                         schedule="1f1b")))
    assert any("HBM" in x for x in limits(JOB, replace(META, recompute="none")))
    with pytest.raises(ValueError, match="recompute"):
        limits(JOB, replace(META, recompute="some"))


def test_step_parts_and_mfu():
    st = step(JOB, META)
    assert 0 < st.mfu < H100_SXM.effective_utilization
    assert st.bubble == pytest.approx(15 / (15 + 2 * 16))
    flops = LLAMA3_405B.model_flops_per_token(8192) * JOB.tokens
    assert st.mfu == pytest.approx(flops / (16384 * H100_SXM.peak_flops * st.seconds))
    for name in (planner.SCORES, "attention projections", "recomputed forward"):
        assert st.compute[name] > 0


def test_enumeration_names_the_best_and_every_limit():
    verdicts = enumerate_layouts(Job(LLAMA3_8B, H100_SXM, 64, 8192, 512))
    top = best(verdicts)
    assert top is not None and not top.limits
    assert top.memory.total <= H100_SXM.hbm_bytes
    assert all(v.step is None and v.limits for v in verdicts if v.step is None)
    assert all(top.step.seconds <= v.step.seconds for v in verdicts if v.step is not None)


def test_reality_check_rows():
    rows = reality_check()
    assert len([r for r in rows if r.predicted is not None]) >= 6
    for row in rows:
        if row.run.job is None:
            assert "not modelled" in row.run.convention
            continue
        assert 0 < row.published < 1 and 0 < row.predicted < 1
    megatron = rows[0]
    assert megatron.published == pytest.approx(
        0.514 * 312e12 / A100_SXM_80GB.peak_flops, rel=1e-9)   # same convention, our peak


def test_free_knobs_pick_the_fastest_that_fits():
    run = next(r for r in RUNS if r.name == "Llama 3 405B, 16K GPUs")
    chosen = run.planned()
    options = [replace(run.layout, v=v) for v in run.free["v"]]
    fitting = [x for x in options if not limits(run.job, x)]
    assert chosen in fitting
    assert step(run.job, chosen).seconds == min(step(run.job, x).seconds for x in fitting)
    assert math.isclose(chosen.t * chosen.p * chosen.d * chosen.c, 16384)


def test_enumeration_prices_each_layout_as_step_and_memory_do():
    """The enumeration shares work between layouts; each verdict must still be what the public
    functions say of that layout alone."""
    job = Job(DEEPSEEK_V3, H100_SXM, 256, 4096, 512)
    verdicts = enumerate_layouts(job)
    assert [v.layout for v in verdicts] == list(planner.candidates(job))
    priced = [v for v in verdicts if v.step is not None]
    for v in priced[::97] + [x for x in verdicts if x.step is None][::211]:
        assert limits(job, v.layout) == list(v.limits)
        if v.memory is not None:
            assert memory(job, v.layout).total == pytest.approx(v.memory.total, rel=1e-12)
        if v.step is not None:
            assert step(job, v.layout).seconds == pytest.approx(v.step.seconds, rel=1e-12)


def test_bad_input_is_one_clear_error():
    for bad in (dict(t=0), dict(b=-1), dict(zero=4), dict(recompute="some"), dict(grad_bytes=3),
                dict(sp="no"), dict(schedule="gpipe2")):
        with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
            Layout(**bad)
    with pytest.raises(ValueError, match="model"):
        Job("llama", H100_SXM, 8, 1024, 8)
    with pytest.raises(ValueError, match="gpu"):
        Job(LLAMA3_8B, None, 8, 1024, 8)
    with pytest.raises(ValueError, match="seq"):
        Job(LLAMA3_8B, H100_SXM, 8, 0, 8)
    with pytest.raises(ValueError, match="t·p·d·c"):
        step(JOB, replace(META, d=64))


def test_zero2_reduces_every_micro_batch_and_fsdp_gathers():
    one, two, three = (step(JOB, replace(META, zero=z)) for z in (1, 2, 3))
    name = "ZeRO gradient reduce-scatters, per micro-batch"
    assert name not in one.hidden
    dp = one.exposed["DP gradient reduction (notebook 06)"]
    assert two.hidden[name] == pytest.approx((16 - 1) * dp / 2)
    assert two.exposed["DP gradient reduction (notebook 06)"] == dp
    assert three.exposed["DP gradient reduction (notebook 06)"] == dp / 2
    assert three.hidden["FSDP gathers"] > 0


def test_dualpipev_pays_its_papers_bubble():
    lay = replace(META, schedule="dualpipev", v=1, d=64, c=2)          # m = 32 ≥ 2p
    st = step(JOB, lay)
    assert st.bubble == pytest.approx(planner.dualpipev_bubble(16, 32)) == 15 / (96 + 15)
    assert step(JOB, replace(lay, schedule="zb-h2")).bubble == 0


def test_pricing_choices_move_the_step_the_right_way():
    base = step(JOB, META)
    assert step(JOB, META, Pricing(overlap_tp=False)).seconds > base.seconds
    causal = step(JOB, META, Pricing(causal_skip=True))
    assert causal.compute[planner.SCORES] == pytest.approx(base.compute[planner.SCORES] / 2)
    fp8 = step(JOB, replace(META, fp8=True))
    assert fp8.compute["attention projections"] < base.compute["attention projections"]
    assert fp8.compute[planner.SCORES] == base.compute[planner.SCORES]   # kept in bf16


def test_shapes_and_schedules_refuse_what_cannot_be():
    from helpers.cost.model_shapes import Transformer
    with pytest.raises(ValueError, match="kv_heads"):
        Transformer("x", 2, 64, 8, 256, 100, kv_heads=3)
    with pytest.raises(ValueError, match="top_k"):
        Transformer("x", 2, 64, 8, 256, 100, experts=4, top_k=0, expert_ffn=32)
    with pytest.raises(ValueError, match="p"):
        in_flight("1f1b", 0, 4)
    with pytest.raises(ValueError, match="seq"):
        activation_bytes(LLAMA3_8B, 0, 1)
