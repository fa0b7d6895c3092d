"""Wait mode for notebook 07's stage (helpers.parallel.wait_mode): each piece of compute waits
instead of computing, and a step still makes the same torch.distributed calls, with the same
bytes, to the same peers and groups, as the real model's step (on live ranks:
tests/test_parallel3d.py)."""
import math
import time

import torch

from helpers.parallel.wait_mode import BACKWARD_SHARE, attention_share, waiting



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
