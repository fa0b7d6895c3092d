"""ShardedOptimizer (ZeRO-1) against the unsharded optimizer, bit for bit, and the memory model.

Rank functions used here are defined at module level: spawned ranks import `tests.test_zero`.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers.parallel import dp as ddp
from helpers.parallel import zero
from helpers.models import make_batch, make_mlp, mlp_loss
from helpers.ranks import LiveRanks

HIDDEN, LAYERS, BATCH = 64, 4, 16


@pytest.fixture(scope="module")
def ranks():
    with LiveRanks(4, backend="gloo") as live:
        yield live


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_sharded_optimizer_is_bit_identical_to_the_plain_one(ranks, world_size, optimizer):
    ranks.resize(world_size)
    results = ranks.run(zero.sharded_vs_plain, optimizer, hidden=HIDDEN, layers=LAYERS, batch=BATCH)
    for r in results:
        assert r["equal"]  # torch.equal, parameter by parameter, after 3 steps
        for a, b in zip(r["params"], results[0]["params"]):
            assert torch.equal(a, b)
    # The state is split, not copied: it adds up to the plain optimizer's, and with 4 equal
    # layers on 2 or 4 ranks each rank holds exactly 1/N of it.
    plain = results[0]["plain_state_bytes"]
    assert sum(r["sharded_state_bytes"] for r in results) == plain
    assert sum(r["owned_elements"] for r in results) == LAYERS * HIDDEN * HIDDEN
    if LAYERS % world_size == 0:
        assert all(r["sharded_state_bytes"] == plain // world_size for r in results)


def groups_generator_scheduler(rank, world_size, use_sharded):
    """Param groups with their own lr, a parameter given as a generator, a group added later,
    an LR scheduler and zero_grad: everything a training loop does to an optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                          nn.Tanh(), nn.Linear(HIDDEN, 8))
    groups = [{"params": (p for p in model[0].parameters()), "lr": 3e-2},
              {"params": list(model[2].parameters()), "weight_decay": 0.0}]
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    opt = (zero.ShardedOptimizer(groups, torch.optim.AdamW, **kwargs) if use_sharded
           else torch.optim.AdamW(groups, **kwargs))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    x = make_batch(BATCH, HIDDEN)
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


def zero1_data_parallel(rank, world_size, steps=3):
    """The full ZeRO-1 recipe: a DDP wrapper averages gradients, ShardedOptimizer steps."""
    model = ddp.BucketedDDP(make_mlp(HIDDEN, LAYERS, seed=rank), bucket_size_mb=0.02)
    opt = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    x = ddp.shard(make_batch(BATCH, HIDDEN), rank, world_size)
    for _ in range(steps):
        mlp_loss(model(x)).backward()
        model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero1_with_ddp_matches_single_process_adamw(ranks, world_size):
    ranks.resize(world_size)
    reference = ddp.train_single_process(steps=3, hidden=HIDDEN, layers=LAYERS, batch=BATCH,
                                         optimizer="adamw", lr=1e-2)
    for params in ranks.run(zero1_data_parallel):
        torch.testing.assert_close(params, reference["params"])


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(TypeError, match="optimizer_cls"):
        zero.ShardedOptimizer([nn.Parameter(torch.zeros(2))], "adam")
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="rank function"):
        zero.ShardedOptimizer([nn.Parameter(torch.zeros(2))], torch.optim.SGD, lr=0.1)


# --- the memory model ---------------------------------------------------------------------

def test_zero_formulas_reproduce_the_zero_paper_example():
    # ZeRO paper, Figure 1: 7.5B parameters, 64 GPUs, K = 12: 120 / 31.4 / 16.6 / 1.9 GB.
    totals = [zero.zero_memory_per_rank(7.5e9, 64, s)["total"] / 1e9 for s in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("psi", [1e6, 1e12])
@pytest.mark.parametrize("n", [1, 1024])
@pytest.mark.parametrize("k", [0, 16])
def test_memory_widget_text_at_slider_extremes(psi, n, k):
    for stage in (0, 3):
        text = zero.zero_memory_table(psi, n, stage, optimizer_bytes=k)
        rows = text.splitlines()[2:]
        assert len(rows) == 4 and rows[stage].startswith(">")
        m = [zero.zero_memory_per_rank(psi, n, s, optimizer_bytes=k) for s in range(4)]
        assert m[0]["total"] == pytest.approx((4 + k) * psi)
        assert m[3]["total"] == pytest.approx((4 + k) * psi / n)
        assert m[0]["total"] >= m[1]["total"] >= m[2]["total"] >= m[3]["total"]


@pytest.mark.parametrize("kwargs,name", [({"psi": 0}, "psi"), ({"n": 0}, "n"),
                                         ({"stage": 4}, "stage"), ({"optimizer_bytes": -1}, "optimizer_bytes")])
def test_memory_model_rejects_bad_input(kwargs, name):
    args = {"psi": 1e9, "n": 8, "stage": 1, **kwargs}
    with pytest.raises(ValueError, match=name):
        zero.zero_memory_per_rank(**args)
