"""The DDP wrappers against plain single-process training, on real gloo process groups.

Rank functions used here are defined at module level in this file: spawned ranks import
`tests.test_ddp` by name.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers.parallel import dp as ddp
from helpers.models import make_batch, make_mlp, mlp_loss
from helpers.ranks import LiveRanks

HIDDEN, LAYERS, BATCH = 64, 4, 16
# Each layer's gradient is 64*64*4 B = 16 KiB: this cap puts two layers in each bucket.
TWO_LAYERS_MB = 2 * HIDDEN * HIDDEN * 4 / 2**20


@pytest.fixture(scope="module")
def ranks():
    with LiveRanks(4, backend="gloo") as live:
        yield live


# --- equivalence with single-process training ----------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", ("lecture",) + ddp.VARIANTS)
def test_every_rank_matches_single_process_training(ranks, world_size, variant):
    common = dict(steps=3, hidden=HIDDEN, layers=LAYERS, batch=BATCH)
    reference = ddp.train_single_process(**common)
    ranks.resize(world_size)
    if variant == "lecture":
        results = ranks.run(ddp.lecture_train, **common)
    else:  # ranks initialise with different seeds: only the broadcast makes them agree
        results = ranks.run(ddp.ddp_train, variant, bucket_size_mb=TWO_LAYERS_MB, **common)
    moved = max((a - b).abs().max().item()
                for a, b in zip(reference["params"], make_mlp(HIDDEN, LAYERS).parameters()))
    assert moved > 1e-3  # the steps are large enough that a wrong average could not hide
    for r in results:
        torch.testing.assert_close(r["params"], reference["params"])
        for a, b in zip(r["params"], results[0]["params"]):
            assert torch.equal(a, b)  # and the copies are bit-identical across ranks
    # The per-rank losses are those of different slices of the batch.
    assert len({r["losses"][0] for r in results}) == world_size


def test_all_reduces_per_step(ranks):
    ranks.resize(2)
    counts = {v: ranks.run(ddp.ddp_train, v, steps=1, hidden=HIDDEN, layers=LAYERS, batch=BATCH,
                           bucket_size_mb=TWO_LAYERS_MB)[0]["all_reduces_per_step"]
              for v in ddp.VARIANTS}
    assert counts == {"naive": LAYERS, "flat": 1, "overlap": LAYERS, "bucketed": LAYERS // 2}


def test_buckets_follow_reverse_parameter_order_and_cap():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 40, 50)]
    buckets = ddp._split_into_buckets(params[::-1], cap_bytes=4 * 70)
    assert [[p.numel() for p in b.params] for b in buckets] == [[50], [40, 30], [20, 10]]
    # A parameter bigger than the cap still gets a bucket, alone.
    assert [len(b.params) for b in ddp._split_into_buckets(params, cap_bytes=4)] == [1] * 5


# --- what the wrappers must preserve ---------------------------------------------------------

def wrapper_api(rank, world_size, variant):
    model = make_mlp(HIDDEN, LAYERS, seed=rank)
    wrapped = ddp.wrap(variant, model, TWO_LAYERS_MB)
    x = make_batch(BATCH, HIDDEN)
    return {"module": wrapped.module is model,
            "params": [a is b for a, b in zip(wrapped.parameters(), model.parameters())]
            + [len(list(wrapped.parameters())) == len(list(model.parameters()))],
            "forward": torch.equal(wrapped(x), model(x))}


@pytest.mark.parametrize("variant", ddp.VARIANTS)
def test_wrapper_exposes_module_parameters_in_order_and_forwards(ranks, variant):
    ranks.resize(2)
    for r in ranks.run(wrapper_api, variant):
        assert r["module"] and all(r["params"]) and r["forward"]


def frozen_model(seed):
    model = make_mlp(HIDDEN, 2, seed=seed)
    model[0].weight.requires_grad_(False)
    model.register_buffer("counter", torch.full((3,), float(seed)))
    return model


def frozen_and_buffers(rank, world_size, variant):
    model = ddp.wrap(variant, frozen_model(seed=10 + rank), TWO_LAYERS_MB)
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


@pytest.mark.parametrize("variant", ddp.VARIANTS)
def test_frozen_parameters_and_buffers_are_broadcast_from_rank0(ranks, variant):
    ranks.resize(4)
    model = frozen_model(seed=10)
    expected = [t.detach() for t in list(model.parameters()) + list(model.buffers())]
    for r in ranks.run(frozen_and_buffers, variant):
        for a, b in zip(r, expected):
            assert torch.equal(a, b)


class TiedMLP(nn.Module):
    """first and last share one weight matrix (like tied input/output embeddings)."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.middle = nn.Linear(HIDDEN, HIDDEN)
        self.last = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.last.weight = self.first.weight

    def forward(self, x, use_extra=False):
        return self.last(torch.nn.functional.gelu(self.middle(torch.nn.functional.gelu(self.first(x)))))


class PartlyUsedMLP(nn.Module):
    """`never` gets no gradient anywhere; `sometimes` only where forward is told to use it."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.sometimes = nn.Linear(HIDDEN, HIDDEN)
        self.never = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, use_extra=False):
        x = torch.tanh(self.body(x))
        return self.sometimes(x) if use_extra else x


MODELS = {"tied": TiedMLP, "partly_used": PartlyUsedMLP}


def train_model(rank, world_size, name, variant, steps=3):
    """AdamW with weight decay: it would move a parameter whose gradient is wrongly zero."""
    model = ddp.wrap(variant, MODELS[name](seed=100 + rank), TWO_LAYERS_MB / 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    x = ddp.shard(make_batch(BATCH, HIDDEN), rank, world_size)
    for _ in range(steps):
        mlp_loss(model(x, use_extra=(rank == 0))).backward()  # only rank 0 uses `sometimes`
        model.finish_gradient_synchronization()
        no_grad = [n for n, p in model.module.named_parameters() if p.grad is None]
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in model.parameters()], "no_grad": no_grad,
            "unique_params": len(list(model.parameters()))}


def train_model_single_process(name, world_size, steps=3):
    """The same training in one process: the loss is the mean over the ranks' slices."""
    model = MODELS[name](seed=100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    x = make_batch(BATCH, HIDDEN)
    for _ in range(steps):
        loss = sum(mlp_loss(model(ddp.shard(x, r, world_size), use_extra=(r == 0)))
                   for r in range(world_size)) / world_size
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("variant", ddp.VARIANTS)
def test_tied_weights_are_reduced_once(ranks, variant):
    ranks.resize(2)
    expected = train_model_single_process("tied", 2)
    for r in ranks.run(train_model, "tied", variant):
        assert r["unique_params"] == 3  # first.weight (= last.weight), middle.weight, middle.bias
        torch.testing.assert_close(r["params"], expected)


@pytest.mark.parametrize("variant", ddp.VARIANTS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_parameters_without_gradient_neither_hang_nor_change(ranks, variant, world_size):
    ranks.resize(world_size)
    expected = train_model_single_process("partly_used", world_size)
    never = PartlyUsedMLP(seed=100).never
    for r in ranks.run(train_model, "partly_used", variant):
        # Used on rank 0 only: every rank gets the averaged gradient. Used nowhere: stays None,
        # so AdamW's weight decay leaves it alone exactly as in single-process training.
        assert r["no_grad"] == ["never.weight", "never.bias"]
        torch.testing.assert_close(r["params"], expected)
        assert torch.equal(r["params"][-2], never.weight.detach())


def double_backward(rank, world_size, variant):
    model = ddp.wrap(variant, make_mlp(HIDDEN, 2), TWO_LAYERS_MB)
    x = make_batch(BATCH, HIDDEN)
    mlp_loss(model(x)).backward()
    try:
        mlp_loss(model(x)).backward()
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("variant", ["overlap", "bucketed"])
def test_second_backward_without_finish_is_refused(ranks, variant):
    ranks.resize(2)
    for message in ranks.run(double_backward, variant):
        assert message and "finish_gradient_synchronization" in message


# --- overlap, from timestamps ------------------------------------------------------------------

@pytest.mark.parametrize("variant,overlaps", [("naive", False), ("flat", False),
                                              ("overlap", True), ("bucketed", True)])
def test_timeline_shows_all_reduces_launched_during_backward_only_with_hooks(ranks, variant, overlaps):
    ranks.resize(2)
    for events in ranks.run(ddp.timeline, variant, hidden=HIDDEN, layers=LAYERS, batch=BATCH,
                            bucket_size_mb=TWO_LAYERS_MB, warmup=1):
        (_, _, _, backward_end), = [e for e in events if e[0] == "backward"]
        launches = [s for kind, _, s, _ in events if kind == "all_reduce"]
        assert len(launches) == {"naive": LAYERS, "flat": 1, "overlap": LAYERS, "bucketed": 2}[variant]
        assert any(s < backward_end for s in launches) == overlaps
        assert (ddp.overlap_seconds(events) > 0) == overlaps


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, True, "25"])
def test_bad_bucket_size_is_one_clear_error(bad):
    with pytest.raises(ValueError, match="bucket_size_mb"):
        ddp.BucketedDDP(nn.Linear(2, 2), bad)


def test_wrapper_outside_a_process_group_says_where_to_build_it():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="rank function"):
        ddp.NaiveDDP(nn.Linear(2, 2))


def test_bad_arguments_fail_in_the_parent_before_any_rank_starts():
    idle = LiveRanks(2, backend="gloo")
    with pytest.raises(ValueError, match="variant"):
        ddp.compare_with_single_process(idle, variants=("fast",))
    with pytest.raises(ValueError, match="bucket_size_mb"):
        ddp.compare_with_single_process(idle, bucket_size_mb=0)
    with pytest.raises(ValueError, match="batch"):
        ddp.compare_with_single_process(idle, batch=127)
    with pytest.raises(ValueError, match="variant"):
        ddp.compare_step_times(idle, variants=("compute", "fastest"))
    with pytest.raises(ValueError, match="batch"):
        ddp.compare_step_times(idle, batch=3)
    assert idle.pids == []
    idle.close()


def test_interleaved_timing_gives_every_variant_its_steps(ranks):
    ranks.resize(2)
    configs = [("compute", 1.0), ("naive", 1.0), ("bucketed", TWO_LAYERS_MB), ("torch", 1.0)]
    per_rank = ranks.run(ddp.time_interleaved, configs, hidden=HIDDEN, layers=LAYERS, batch=BATCH,
                         repeat=3, warmup=1)
    for times in per_rank:
        assert len(times) == len(configs)
        assert all(len(ts) == 3 and all(t > 0 for t in ts) for ts in times)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL path needs 2 GPUs (one per rank); the gloo path is tested above")
@pytest.mark.parametrize("variant", ddp.VARIANTS)
def test_nccl_ranks_match_single_process_training(variant):
    from helpers.ranks import spawn

    common = dict(steps=3, hidden=HIDDEN, layers=LAYERS, batch=BATCH)
    reference = ddp.train_single_process(**common)
    for r in spawn(ddp.ddp_train, 2, variant, backend="nccl", bucket_size_mb=TWO_LAYERS_MB, **common):
        torch.testing.assert_close(r["params"], reference["params"])
