"""ZeRO stages 0-2 (helpers.parallel.zero.ZeroDP) against one process training with AdamW.

Rank functions used here are defined at module level: spawned ranks import `tests.test_zero2`.
"""
import pytest
import torch

from helpers.configs import SMALL
from helpers.labs import memory as mr
from helpers.parallel.groups import split_groups
from tests.test_memory_measured import check_measured_like_the_formulas

PAIRS = [[0, 1], [2, 3]]


@pytest.fixture(scope="module")
def ranks(start_ranks):
    return start_ranks(4, backend="gloo")


@pytest.fixture(scope="module")
def results(ranks):
    return {(r.stage, r.d): r for r in mr.run_stages(ranks, stages=(0, 1, 2), degrees=(1, 2, 4))}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_one_rank_is_bit_identical_to_plain_adamw(results, stage):
    # d = 1: no reduction to reorder, and AdamW is elementwise, so a flat shard steps every
    # element exactly as the plain optimizer steps it in its own tensor
    assert results[(stage, 1)].bit_identical


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_every_stage_trains_like_one_process(results, stage, d):
    res = results[(stage, d)]  # run_stages has assert_close'd every rank to the reference
    assert res.max_diff < 1e-5
    for run in res.ranks:  # and the ranks agree with each other bit for bit
        assert all(torch.equal(run.params[n], res.run.params[n]) for n in run.params)
    assert len(res.run.losses) == 3


def test_sgd_sees_the_gradient_scale(ranks):
    # AdamW would not notice a sum where a mean belongs; SGD moves by lr × gradient
    [res] = mr.run_stages(ranks, stages=(2,), degrees=(4,), optimizer="sgd")
    assert res.max_diff < 1e-5


def test_measured_state_comm_and_peak_match_the_formulas(results):
    assert len(results) == 9  # stages 0-2 at d = 1, 2, 4
    check_measured_like_the_formulas(results.values())


def test_stage2_keeps_a_shard_of_the_gradients(results):
    for d in (2, 4):
        zero1, zero2 = results[(1, d)].run.state, results[(2, d)].run.state
        assert zero1.params == zero2.params and zero1.optimizer == zero2.optimizer
        assert zero2.grads == pytest.approx(zero1.grads / d, rel=1e-3)


def test_stages_hand_reduce_scatter_and_all_gather_of_the_whole_bucket(results):
    psi4 = 4 * SMALL.parameters
    for d in (2, 4):
        assert results[(0, d)].run.comm.keys() == {"all_reduce"}
        for stage in (1, 2):
            comm = results[(stage, d)].run.comm
            assert comm.keys() == {"reduce_scatter", "all_gather"}
            # the padding of each bucket to a multiple of d adds fewer than d elements
            assert all(0 <= n - psi4 < 4 * d * 16 for n in comm.values())


def pair_stage(rank, world_size, stage):
    config = SMALL.with_(seed=10 * (rank // 2))
    return mr.train_stage(rank, world_size, stage, 3, config, group=split_groups(PAIRS))


def test_two_groups_of_two_each_train_their_own_model(ranks):
    runs = ranks.resize(4).run(pair_stage, 2)
    for members in PAIRS:
        reference = mr.train_reference(3, SMALL.with_(seed=10 * (members[0] // 2)))
        for r in members:
            torch.testing.assert_close(runs[r].params, reference)
    assert not torch.equal(runs[0].params["embed.tokens.weight"],
                           runs[2].params["embed.tokens.weight"])


class NoRanks:
    """Fails if anything tries to start a rank: checks come first."""
    world_size = 4

    def resize(self, n):
        raise AssertionError("a rank was started before the arguments were checked")

    run = resize


@pytest.mark.parametrize("kwargs,message", [
    ({"stages": (4,)}, "stage must be one of"),
    ({"degrees": (0,)}, "d \\(data-parallel ranks\\) must be >= 1"),
    ({"degrees": (3,)}, "batch must be a multiple of 3"),
    ({"steps": 0}, "steps must be >= 1"),
    ({"optimizer": "lion"}, "optimizer must be one of")])
def test_bad_input_is_one_clear_error_before_any_rank_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mr.run_stages(NoRanks(), **kwargs)
