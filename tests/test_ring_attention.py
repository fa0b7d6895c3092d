"""Ring attention (notebook 09): forward and backward against full causal attention on one
process, naive and zig-zag splits, c = 1, 2, 4; bytes against the formula; two rings side by
side (global ranks); the context-parallel decoder; the online softmax alone; bad input."""
import pytest
import torch

from helpers.configs import TRANSFORMER, RingConfig
from helpers.cost.context import formula_bytes
from helpers.labs import ring_attention as ra_lab
from helpers.parallel import ring_attention as ra
from helpers.parallel.groups import split_groups
from helpers.parallel.trace import Span

SMALL = RingConfig(batch=1, heads=2, seq=32, head_dim=8)


@pytest.fixture(scope="module")
def ranks(start_ranks):
    return start_ranks(4, backend="gloo", timeout=60)


@pytest.fixture(scope="module")
def reference():
    return ra_lab.reference(SMALL)


def two_rings(rank, world_size, layout):
    """Rank function: ranks {0, 1} and {2, 3} each run their own ring."""
    group = split_groups([[0, 1], [2, 3]])
    return ra_lab.ring_step(rank, world_size, SMALL, layout, group=group)


def test_two_rings_side_by_side_use_global_ranks(ranks, reference):
    steps = ranks.resize(4).run(two_rings, "zigzag")
    for ring in (steps[:2], steps[2:]):
        assert ra_lab.compare(ring, reference, "zigzag") < 1e-5


# Ordered so that the live ranks change size as rarely as possible (starting one costs seconds).
@pytest.mark.parametrize("c, layout", [(4, "zigzag"), (4, "naive"), (2, "naive"), (2, "zigzag")])
def test_ring_matches_full_attention_forward_and_backward(ranks, reference, c, layout):
    steps = ra_lab.run_ring_step(ranks, c, SMALL, layout)
    assert ra_lab.compare(steps, reference, layout) < 1e-5
    for step in steps:
        assert step.sent_bytes == formula_bytes(c, SMALL)
    waits = [s for step in steps for s in step.spans if s.kind == "wait"]
    assert len(waits) == len(steps) * (0 if c == 1 else 3 * c - 2)   # (c−1) + (c−1) + c hops
    assert 0 <= ra_lab.idle_share(steps) < 1


@pytest.mark.parametrize("layout", ["zigzag", "naive"])
def test_context_parallel_decoder_matches_one_process(ranks, layout):
    config = TRANSFORMER.with_(layers=1, seq=16, batch=2, hidden=32, heads=2, vocab=64)
    results = ranks.resize(2).run(ra_lab.cp_transformer_step, config, layout)
    reference = ra_lab.reference_transformer_step(config)
    assert results[0].loss == pytest.approx(reference.loss, abs=1e-5)
    for name, grad in reference.grads.items():
        torch.testing.assert_close(results[0].grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_wait_mode_runs_the_schedule_without_arithmetic(ranks):
    """Wait mode sleeps instead of computing; the spans still make a timeline (its idle share
    is compared with the model in notebook 09 and the benchmark, never asserted: timing)."""
    steps = ranks.resize(2).run(ra_lab.timed_ring_steps, SMALL, "naive", 1, 1, 0.02)
    assert 0 <= ra_lab.summarize(steps).idle_share < 1
    assert ra_lab.check_ring(2, SMALL, "naive", 0.02) is None
    with pytest.raises(ValueError, match="pause_s"):
        ra_lab.check_ring(2, SMALL, "naive", 5.0)


def test_one_rank_is_full_attention(ranks, reference):
    steps = ra_lab.run_ring_step(ranks, 1, SMALL, "naive")
    assert ra_lab.compare(steps, reference, "naive") < 1e-5
    assert steps[0].sent_bytes == 0 and ra_lab.idle_share(steps) == 0


def test_local_and_assemble_are_inverse():
    x = torch.arange(16.0).view(1, 1, 16, 1)
    pieces = [ra.local(x, r, 4, "zigzag") for r in range(4)]
    assert pieces[0].flatten().tolist() == [0, 1, 14, 15]
    assert torch.equal(ra.assemble(pieces, "zigzag"), x)


def test_merge_of_two_key_blocks_is_the_softmax_over_both():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 5, 4, generator=g) for _ in range(3))
    s = q @ k.transpose(-1, -2)
    full = s.softmax(-1) @ v
    parts = [(s[..., i].softmax(-1) @ v[:, i], s[..., i].logsumexp(-1))
             for i in (slice(0, 2), slice(2, 5))]
    out, _ = ra.merge(*parts[0], *parts[1])
    torch.testing.assert_close(out, full)


def test_idle_share_from_spans():
    def step(*spans):
        return ra_lab.RingStep(None, (), 0, tuple(Span(kind, a, b, phase=phase)
                                                  for kind, phase, a, b in spans))
    busy = step(("compute", "forward", 0.0, 4.0), ("compute", "backward", 10.0, 12.0))
    waiting = step(("compute", "forward", 0.0, 1.0), ("wait", "forward", 1.0, 3.0),  # done at 3 of 4
                   ("compute", "backward", 10.0, 12.0))
    # idle: 2 s waiting + 1 s done early; busy 4 + 1 forward, 2 + 2 backward; the gap 4-10 s is neither
    assert ra_lab.idle_share([busy, waiting]) == pytest.approx(3 / (3 + 9))


class Refuse:
    def resize(self, n):
        raise AssertionError("a process was started")


@pytest.mark.parametrize("c, config, layout, word", [
    (3, SMALL, "zigzag", "seq must be a multiple of 6"),
    (4, RingConfig(seq=36), "zigzag", "seq must be a multiple of 8"),
    (0, SMALL, "naive", "c must be"),
    (2, SMALL, "striped", "layout must be one of"),
])
def test_bad_input_is_refused_before_any_process_starts(c, config, layout, word):
    with pytest.raises(ValueError, match=word):
        ra_lab.run_ring_step(Refuse(), c, config, layout)


def test_figures_draw(ranks):
    import matplotlib
    matplotlib.use("Agg")
    from helpers.views.ring_attention import (ScalingPoint, plot_causal_split, plot_ring_scaling,
                                              plot_ring_timeline)
    steps = ranks.resize(2).run(ra_lab.ring_step, SMALL, "naive")
    zigzag = ranks.resize(2).run(ra_lab.ring_step, SMALL, "zigzag")
    fig = plot_ring_timeline({"naive": steps, "zigzag": zigzag})
    top, bottom = fig.axes[:2]
    assert top.get_shared_x_axes().joined(top, bottom)   # one time axis for both splits
    assert top.get_xlim() == bottom.get_xlim()
    assert plot_causal_split(2).axes
    points = [ScalingPoint(c, s, 0.01 * c, formula_bytes(c, SMALL), formula_bytes(c, SMALL))
              for c in (1, 2) for s in (32, 64)]
    assert plot_ring_scaling(points).axes


@pytest.mark.parametrize("pause_s", [None, 0.002])
def test_ring_step_parts_times_four_parts_in_turn(ranks, pause_s):
    """Timing is never asserted; what is: every part was timed, and the derived numbers are
    the formulas their docstrings state."""
    parts = ra_lab.run_ring_step_parts(ranks, SMALL, 3, pause_s)
    assert parts.rounds == 3
    assert min(parts.comm_s, parts.compute_s, parts.both_s, parts.post_s) > 0
    assert parts.error_s >= 0
    if pause_s:   # a sleeping block lasts at least its sleep
        assert parts.compute_s >= pause_s and parts.both_s >= pause_s
    assert ra_lab.replay_s(parts, parts) == max(parts.comm_s, parts.compute_s) + parts.post_s


def test_overlap_arithmetic():
    parts = ra_lab.Overlap(comm_s=1.0, compute_s=4.0, both_s=4.5, post_s=0.2, exposed_s=0.25,
                           error_s=0.1, rounds=5)
    assert parts.hidden_share == pytest.approx(0.75)
    assert parts.overhead_s == pytest.approx(-0.75)   # both − (hop + block), round by round
    free = ra_lab.Overlap(0.5, 5.0, 5.1, 0.1, 0.1, 0.0, 5)
    assert ra_lab.replay_s(parts, free) == pytest.approx(4.0 + 0.1)   # the block, free posting
    assert ra_lab.replay_s(free, parts) == pytest.approx(5.0 + 0.2)
    slower = ra_lab.Overlap(1.0, 4.0, 6.0, 0.2, 2.0, 0.1, 5)
    assert slower.hidden_share == pytest.approx(-1.0) and slower.overhead_s == pytest.approx(1.0)


def test_median_error_ignores_a_few_outliers():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    # median 3, absolute deviations 2 1 0 1 2: their median 1
    assert ra_lab.median_error(x) == pytest.approx(1.2533 * 1.4826 / 5 ** 0.5)
    assert ra_lab.median_error(torch.tensor([1.0, 2.0, 3.0, 4.0, 500.0])) == ra_lab.median_error(x.float())


@pytest.mark.parametrize("config, repeat, pause_s, word", [
    (SMALL, 2, None, "repeat must be between 3"),
    (SMALL, 5, 2.0, "pause_s must be"),
    (SMALL, 5, 0.0, "pause_s must be"),
    (RingConfig(seq=33), 5, None, "seq must be a multiple of 2"),
])
def test_ring_step_parts_refuses_bad_input_before_any_process_starts(config, repeat, pause_s, word):
    with pytest.raises(ValueError, match=word):
        ra_lab.run_ring_step_parts(Refuse(), config, repeat, pause_s)
