"""ZeRO-3 / FSDP from scratch (helpers.parallel.fsdp) against one process and PyTorch's FSDP2.

Rank functions used here are defined at module level: spawned ranks import `tests.test_fsdp`.
"""
import pytest
import torch

from helpers.configs import SMALL
from helpers.labs import memory as mr
from helpers.models import lm_loss, make_tokens, make_transformer
from helpers.parallel.fsdp import FSDP
from helpers.parallel.groups import split_groups
from tests.test_memory_measured import check_measured_like_the_formulas
from tests.test_zero2 import PAIRS, ranks  # noqa: F401  (the fixture: 4 live ranks per module)


@pytest.fixture(scope="module")
def reference():
    return mr.train_reference(3)


@pytest.fixture(scope="module")
def runs(ranks):
    return {prefetch: {r.d: r for r in mr.run_stages(ranks, stages=(3,), degrees=degrees,
                                                     prefetch=prefetch)}
            for prefetch, degrees in ((False, (1, 2, 4)), (True, (4,)))}


def test_measured_state_comm_and_peak_match_the_formulas(runs):
    check_measured_like_the_formulas(runs[False].values())


@pytest.mark.parametrize("prefetch,degrees", [(False, (1, 2, 4)), (True, (4,))])
def test_fsdp_trains_like_one_process(runs, prefetch, degrees):
    results = runs[prefetch]
    if 1 in results:
        assert results[1].bit_identical
    for d in set(degrees) - {1}:
        assert results[d].max_diff < 1e-5
        runs = results[d].ranks
        assert all(torch.equal(run.params[n], runs[0].params[n])
                   for run in runs for n in run.params)
        # three passes over Ψ: all-gather in forward and in backward, one reduce-scatter
        comm, psi4 = runs[0].comm, 4 * SMALL.parameters
        assert comm["all_gather"] == 2 * comm["reduce_scatter"]
        assert 0 <= comm["reduce_scatter"] - psi4 < 4 * d * 8


def test_fsdp_with_sgd_sees_the_gradient_scale(ranks):
    [res] = mr.run_stages(ranks, stages=(3,), degrees=(4,), optimizer="sgd")
    assert res.max_diff < 1e-5


def weights_after_each_phase(rank, world_size):
    """Bytes behind one block's weight and the shards, after forward and after the step."""
    config = SMALL
    model = FSDP(make_transformer(config), lr=1e-3)
    tokens = make_tokens(config)
    weight = lambda: model.module.blocks[0].attn.q.weight.untyped_storage().nbytes()  # noqa: E731
    loss = lm_loss(model(tokens.inputs[:2]), tokens.targets[:2])
    after_forward = weight()
    loss.backward()
    model.step()
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return after_forward, weight(), shard_bytes


def test_unit_weights_are_freed_after_use_and_only_shards_stay(ranks):
    for after_forward, after_step, shard_bytes in ranks.resize(2).run(weights_after_each_phase):
        assert after_forward == 0 and after_step == 0
        assert shard_bytes == pytest.approx(4 * SMALL.parameters / 2, rel=1e-3)


def test_pytorch_fsdp2_reaches_the_same_parameters(ranks, reference):
    ours = ranks.resize(2).run(mr.train_stage, 3, 3, SMALL)
    theirs = ranks.run(mr.train_torch_fsdp, 3, SMALL)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(b.params, reference)
        torch.testing.assert_close(a.params, b.params)


def pair_fsdp(rank, world_size):
    config = SMALL.with_(seed=10 * (rank // 2))
    return mr.train_stage(rank, world_size, 3, 3, config, prefetch=True,
                          group=split_groups(PAIRS))


def test_fsdp_on_two_groups_of_two(ranks):
    runs = ranks.resize(4).run(pair_fsdp)
    for members in PAIRS:
        reference = mr.train_reference(3, SMALL.with_(seed=10 * (members[0] // 2)))
        for r in members:
            torch.testing.assert_close(runs[r].params, reference)
            assert runs[r].d == 2


def test_units_must_cover_every_parameter_once(ranks):
    with pytest.raises(Exception, match="units must hold every parameter exactly once"):
        ranks.resize(1).run(only_blocks)


def only_blocks(rank, world_size):
    model = make_transformer(SMALL)
    FSDP(model, units=list(model.blocks))
