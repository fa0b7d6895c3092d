"""Notebook 09's arithmetic: expert capacity, all-to-all bytes, ring bytes, causal work."""
import pytest

from helpers.cost import context, experts


def test_capacity_is_the_balanced_share_times_the_factor_rounded_up():
    assert experts.capacity(128, 4, 1, 1.0) == 32
    assert experts.capacity(128, 4, 2, 1.25) == 80
    assert experts.capacity(10, 4, 1, 1.0) == 3


def test_uniform_all_to_all_bytes_equal_the_rows_that_leave():
    e, rows, row = 4, 64, 256
    assert experts.sent_bytes([rows // e] * e, 1, row) == experts.all_to_all_bytes(e, rows, row)
    assert experts.moe_step_bytes(2, 128, 1, 64) == 4 * 64 * 256


def test_ring_bytes_formula():
    assert context.ring_bytes(1, 2, 2, 64, 8) == 0
    block = 2 * 1 * 2 * (32 // 4) * 8 * 4
    assert context.ring_bytes(4, 1, 2, 32, 8) == (3 + 3 + 4) * block


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_causal_work_naive_vs_zigzag(c):
    naive, zigzag = context.causal_work(c, "naive"), context.causal_work(c, "zigzag")
    assert sum(naive) == pytest.approx(0.5) and sum(zigzag) == pytest.approx(0.5)
    assert zigzag == pytest.approx([0.5 / c] * c)
    assert naive[-1] / naive[0] == pytest.approx(2 * c - 1)
    assert context.idle_share(naive) == pytest.approx(1 - c / (2 * c - 1))
    assert context.idle_share(zigzag) == pytest.approx(0)


def test_chunks_and_checks():
    assert context.chunks_of(1, 4, "zigzag") == [1, 6]
    assert context.check_split(64, 4, "zigzag") == 8
    with pytest.raises(ValueError, match="seq must be a multiple of 8"):
        context.check_split(60, 4, "zigzag")
    with pytest.raises(ValueError, match="experts must be a multiple of 3"):
        experts.check_expert_degree(3, 4)
    with pytest.raises(ValueError, match="top_k must be between 1 and 4"):
        experts.capacity(8, 4, 5, 1.0)


def test_ring_schedule_idle():
    # c = 2 naive, in forward-block units: forward rank 0 works ½ of 1.5, backward rank 0 works
    # 1 while rank 1 works 3 and starts 1 late: idle 1 + 4 of 11
    assert context.ring_schedule_idle(2, "naive") == pytest.approx(5 / 11)
    for c in (1, 2, 4, 8):
        assert context.ring_schedule_idle(c, "zigzag") == pytest.approx(0)
        assert context.ring_schedule_idle(c, "naive") >= context.idle_share(context.causal_work(c, "naive"))
    assert context.step_work(0, 0, 4, "zigzag") == 2.0 and context.step_work(3, 1, 4, "zigzag") == 2.0
    assert context.step_work(0, 1, 4, "naive") == 0.0


def test_exercises_accept_the_answer_and_explain_the_usual_mistakes():
    from helpers.exercises import grade_experts_capacity, grade_ring_bytes, grade_ring_idle
    assert grade_experts_capacity(1280).right
    assert not grade_experts_capacity(1024).right
    assert grade_ring_bytes(context.ring_bytes(4, 1, 8, 8192, 128) / 1e6).right
    assert "forward alone" in grade_ring_bytes(3 * 2 * 8 * 2048 * 128 * 4 / 1e6).why
    assert grade_ring_idle(1 - 8 / 15).right
    assert not grade_ring_idle(0.875).right


def test_hop_and_block_seconds_on_a_gpu():
    # 2 · 1 · 1 · 1000 · 100 numbers of 2 B over 1e9 B/s, plus 1 µs
    assert context.hop_seconds(1000, 1, 1, 100, 1e9, 1e-6) == pytest.approx(4e-4 + 1e-6)
    assert context.block_flops(10, 1, 1, 8) == 4 * 100 * 8
    assert context.block_seconds(10, 1, 1, 8, 1e6, 0.5) == pytest.approx(3200 / 5e5)


def test_hop_is_shorter_than_the_block_from_the_crossover_on():
    args = dict(batch=1, heads=32, head_dim=128)
    n = context.hop_shorter_from(450e9, 1e-6, 989e12, 0.5, **args)
    hop = lambda m: context.hop_seconds(m, link_Bps=450e9, latency_s=1e-6, **args)  # noqa: E731
    block = lambda m: context.block_seconds(m, peak_flops=989e12, efficiency=0.5, **args)  # noqa: E731
    assert hop(n) < block(n) and hop(n - 1) >= block(n - 1)
    # without latency the crossover is B · F' / (2 W), whatever the shapes
    assert context.hop_shorter_from(450e9, 0.0, 989e12, 0.5) == pytest.approx(2 * 989e12 * 0.5 / 900e9, abs=1)


def test_expert_flops_and_the_gpu_step():
    # h → 4h → h: 2 · 4h² multiply-adds a row forward, 2 FLOPs each, times 3 with the backward
    assert experts.expert_flops(10, 8) == 3 * 2 * 2 * 10 * 8 * 32
    step = experts.ep_step_seconds(4, 100, 2, 8, link_Bps=1e9, latency_s=1e-6, peak_flops=1e9,
                                   efficiency=0.5, bytes_per_element=2)
    one = 3 * 1e-6 + 3 / 4 * 200 * 8 * 2 / 1e9   # (e − 1) α + (e − 1)/e of the n·k rows
    assert step.all_to_all_s == pytest.approx(4 * one)
    assert step.experts_s == pytest.approx(experts.expert_flops(200, 8) / 0.5e9)
    assert step.all_to_all_share == pytest.approx(step.all_to_all_s / (step.all_to_all_s + step.experts_s))
    with pytest.raises(ValueError, match="efficiency"):
        experts.ep_step_seconds(4, 100, 2, 8, 1e9, 1e-6, 1e9, 1.5)
    with pytest.raises(ValueError, match="e must be"):
        experts.ep_step_seconds(1, 100, 2, 8, 1e9, 1e-6, 1e9, 0.5)
