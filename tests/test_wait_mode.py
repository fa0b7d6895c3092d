"""Wait mode for notebook 07's stage (helpers.parallel.wait_mode): each piece of compute waits
instead of computing, and a step still makes the same torch.distributed calls, with the same
bytes, to the same peers and groups, as the real model's step."""
import math
import time

import pytest
import torch

from helpers.configs import TRANSFORMER
from helpers.cost.parallel3d import Shape, shapes_used
from helpers.layout import Layout
from helpers.parallel.wait_mode import BACKWARD_SHARE, attention_share, waiting

TINY = TRANSFORMER.with_(vocab=64, hidden=32, heads=4, layers=2, seq=8, batch=8)
BLOCK_S, HEAD_S = 0.01, 0.004


def test_a_piece_waits_its_forward_and_backward_and_passes_the_gradient_on():
    x = torch.randn(2, 3, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(4, 4))
    start = time.perf_counter()
    y = waiting(x, 0.06, [weight])
    forward = time.perf_counter() - start
    assert torch.equal(y, x) and y is not x
    start = time.perf_counter()
    (3 * y).sum().backward()
    backward = time.perf_counter() - start
    assert forward >= (1 - BACKWARD_SHARE) * 0.06 and backward >= BACKWARD_SHARE * 0.06
    assert torch.equal(x.grad, torch.full((2, 3), 3.0))
    assert torch.equal(weight.grad, torch.zeros(4, 4))


def test_a_piece_that_changes_shape_gives_zeros_and_a_zero_input_gradient():
    x = torch.randn(2, 3, requires_grad=True)
    y = waiting(x, 0.0, [], shape=(2, 5))
    assert torch.equal(y, torch.zeros(2, 5))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros(2, 3))


def test_the_attention_share_is_its_part_of_the_block_flops():
    from helpers.cost.parallel3d import forward_flops
    f = forward_flops(tokens=100, hidden=32, seq=8, vocab=64, layers=1)
    attention = 8 * 100 * 32 * 32 + f.block_attention
    assert math.isclose(attention_share(32, 8), attention / f.block)


def _calls_of_a_step(rank, world_size, layout, config, waits):
    """One rank's torch.distributed calls in its second step (the first builds DDP's buckets),
    its compute spans' total and its loss."""
    from helpers.exercises.calls import recorded_calls
    from helpers.labs.parallel3d import Trainer3D
    trainer = Trainer3D(rank, world_size, layout.d, layout.t, layout.p, layout.m, config,
                        waits=waits)
    try:
        trainer.step()
        with recorded_calls() as calls:
            result = trainer.step(timeline=True)
        compute = sum(s.end - s.start for s in result.spans if s.kind == "compute")
        return [(c.op, c.nbytes, c.shape, c.peer, c.group) for c in calls], compute, result.loss
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def four(start_ranks):
    return start_ranks(4, backend="gloo", timeout=60)


@pytest.mark.parametrize("layout", [Layout(1, 2, 2, 2), Layout(2, 2, 1, 1)])
def test_a_wait_mode_step_makes_the_real_steps_calls_and_waits_its_pieces(four, layout):
    real = four.run(_calls_of_a_step, layout, TINY, None)
    waited = four.run(_calls_of_a_step, layout, TINY, (BLOCK_S, HEAD_S))
    for rank, ((calls, _, _), (wait_calls, compute, loss)) in enumerate(zip(real, waited)):
        assert any(op == "all_reduce" for op, *_ in calls)
        # the same calls; DDP's bucket may go a little earlier or later among the TP calls (a
        # waiting piece hands over all its parameters' gradients at once)
        assert sorted(wait_calls, key=repr) == sorted(calls, key=repr), f"rank {rank}"
        stage = layout.coords(rank).pp
        pieces = TINY.layers // layout.p * BLOCK_S + (HEAD_S if stage == layout.p - 1 else 0)
        assert compute >= layout.m * pieces
        if stage == layout.p - 1:  # zero logits: the loss of a uniform guess
            assert math.isclose(loss, math.log(TINY.vocab), rel_tol=1e-6)


def test_wait_mode_seconds_time_each_unsharded_piece_and_cut_a_block_t_ways(four):
    from helpers.labs.layouts import wait_mode_seconds
    layouts = (Layout(1, 4, 1), Layout(2, 2, 1), Layout(1, 1, 4, 4))
    waits = dict(wait_mode_seconds(four, layouts, TINY, repeat=2))
    assert sorted(waits) == shapes_used(layouts, TINY)
    for shape, seconds in waits.items():
        assert seconds > 0
        if shape.t > 1:
            alone = waits.get(Shape(shape.part, shape.tokens, 1))
            if alone is not None:
                assert math.isclose(seconds * shape.t, alone)
