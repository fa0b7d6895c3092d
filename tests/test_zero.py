"""ShardedOptimizer (ZeRO-1) against the unsharded optimizer, bit for bit.

Rank functions used here are defined at module level: spawned ranks import `tests.test_zero`.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers.configs import MLPConfig
from helpers.labs import dp as dp_lab
from helpers.models import make_batch, make_mlp, mlp_loss
from helpers.parallel import dp, zero
from helpers.parallel.groups import split_groups
from helpers.ranks import LiveRanks

SMALL = MLPConfig(batch=16, hidden=64, layers=4)
PAIRS = [[0, 1], [2, 3]]


@pytest.fixture(scope="module")
def ranks(start_ranks):
    return start_ranks(4, backend="gloo")


def check_sharded_like_plain(results, d):
    for r in results:
        assert r.equal  # torch.equal, parameter by parameter, after 3 steps
        for a, b in zip(r.params, results[0].params):
            assert torch.equal(a, b)
    # The state is split, not copied: it adds up to the plain optimizer's, and with 4 equal
    # layers on 2 or 4 ranks each rank holds exactly 1/d of it.
    plain = results[0].plain_state_bytes
    assert sum(r.sharded_state_bytes for r in results) == plain
    assert sum(r.owned_elements for r in results) == SMALL.parameters
    if SMALL.layers % d == 0:
        assert all(r.sharded_state_bytes == plain // d for r in results)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_sharded_optimizer_is_bit_identical_to_the_plain_one(ranks, world_size, optimizer):
    ranks.resize(world_size)
    check_sharded_like_plain(ranks.run(dp_lab.sharded_vs_plain, optimizer, 3, SMALL), world_size)


def pair_sharded_vs_plain(rank, world_size, optimizer):
    return dp_lab.sharded_vs_plain(rank, world_size, optimizer, 3,
                                 SMALL.with_(seed=10 * (rank // 2)), group=split_groups(PAIRS))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_two_groups_of_two_shard_each_their_own_state(ranks, optimizer):
    results = ranks.resize(4).run(pair_sharded_vs_plain, optimizer)
    for members in PAIRS:
        check_sharded_like_plain([results[r] for r in members], 2)
    assert not torch.equal(results[0].params[0], results[2].params[0])  # two different models


def groups_generator_scheduler(rank, world_size, use_sharded):
    """Param groups with their own lr, a parameter given as a generator, a group added later,
    an LR scheduler and zero_grad: everything a training loop does to an optimizer."""
    torch.manual_seed(0)
    h = SMALL.hidden
    model = nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 8))
    groups = [{"params": (p for p in model[0].parameters()), "lr": 3e-2},
              {"params": list(model[2].parameters()), "weight_decay": 0.0}]
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    opt = (zero.ShardedOptimizer(groups, torch.optim.AdamW, **kwargs) if use_sharded
           else torch.optim.AdamW(groups, **kwargs))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    x = make_batch(SMALL)
    for step in range(4):
        if step == 2:  # fine-tuning style: unfreeze the head
            opt.add_param_group({"params": model[4].parameters(), "lr": 5e-2})
        model(x).square().mean().backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
    grads_cleared = all(p.grad is None for p in model.parameters())
    return {"params": [p.detach().clone() for p in model.parameters()],
            "lrs": [g["lr"] for g in opt.param_groups], "grads_cleared": grads_cleared,
            "is_optimizer": isinstance(opt, torch.optim.Optimizer)}


def test_param_groups_generators_add_param_group_and_schedulers(ranks):
    ranks.resize(2)
    plain = groups_generator_scheduler(0, 1, use_sharded=False)
    for r in ranks.run(groups_generator_scheduler, True):
        assert r["is_optimizer"] and r["grads_cleared"]
        assert r["lrs"] == plain["lrs"]
        for a, b in zip(r["params"], plain["params"]):
            assert torch.equal(a, b)


def zero1_data_parallel(rank, world_size, blocks=None, steps=3):
    """The full ZeRO-1 recipe: a DDP wrapper averages gradients, ShardedOptimizer steps; with
    `blocks`, each block of ranks is its own data-parallel group (block i: seed 10 i)."""
    group = split_groups(blocks) if blocks else None
    block = next((i for i, b in enumerate(blocks) if rank in b), 0) if blocks else 0
    config = SMALL.with_(seed=10 * block)
    r = rank if group is None else dist.get_rank(group)
    model = dp.BucketedDDP(make_mlp(config.with_(seed=config.seed + r)), bucket_size_mb=0.02,
                           group=group)
    opt = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, group=group)
    x = dp.shard(make_batch(config), r, dist.get_world_size(group))
    for _ in range(steps):
        mlp_loss(model(x)).backward()
        model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero1_with_ddp_matches_single_process_adamw(ranks, world_size):
    ranks.resize(world_size)
    reference = dp_lab.train_single_process(3, SMALL, optimizer="adamw", lr=1e-2)
    for params in ranks.run(zero1_data_parallel):
        torch.testing.assert_close(params, reference.params)


def test_zero1_in_two_groups_of_two_matches_each_groups_single_process_adamw(ranks):
    results = ranks.resize(4).run(zero1_data_parallel, PAIRS)
    for pair, members in enumerate(PAIRS):
        reference = dp_lab.train_single_process(3, SMALL.with_(seed=10 * pair), optimizer="adamw")
        for rank in members:
            torch.testing.assert_close(results[rank], reference.params)


def test_measured_state_bytes_shrink_by_d(ranks):
    rows = dp_lab.measure_state_bytes(ranks, degrees=(1, 2), config=SMALL, steps=1)
    assert [row.d for row in rows] == [1, 2] and all(row.equal for row in rows)
    lines = dp_lab.state_bytes_table(rows, SMALL.parameters).splitlines()
    assert lines[0].split()[0] == "d" and len(lines) == 3
    assert f"{8 * SMALL.parameters // 2:,}" in lines[2]


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(TypeError, match="optimizer_cls"):
        zero.ShardedOptimizer([nn.Parameter(torch.zeros(2))], "adam")
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="rank function"):
        zero.ShardedOptimizer([nn.Parameter(torch.zeros(2))], torch.optim.SGD, lr=0.1)
    idle = LiveRanks(2, backend="gloo")
    with pytest.raises(ValueError, match="d "):
        dp_lab.measure_state_bytes(idle, degrees=(1, 0))
    assert idle.pids == []
    idle.close()
