"""The DDP wrappers against plain single-process training, on real gloo process groups.

Rank functions used here are defined at module level in this file: spawned ranks import
`tests.test_dp` by name.
"""
import pytest
import torch
import torch.distributed as dist
from matplotlib.figure import Figure
from torch import nn

from helpers.configs import MLPConfig
from helpers.labs import dp as dp_lab
from helpers.models import make_batch, make_mlp, mlp_loss
from helpers.parallel import dp
from helpers.parallel.groups import split_groups
from helpers.parallel.trace import Span
from helpers.ranks import LiveRanks
from helpers.views.dp import plot_timeline

SMALL = MLPConfig(batch=16, hidden=64, layers=4)
# Each layer's gradient is 64*64*4 B = 16 KiB: this cap puts two layers in each bucket.
TWO_LAYERS_MB = 2 * SMALL.hidden * SMALL.hidden * 4 / 2**20
PAIRS = [[0, 1], [2, 3]]


@pytest.fixture(scope="module")
def ranks(start_ranks):
    return start_ranks(4, backend="gloo")


def assert_bit_identical(results):
    for r in results:
        for a, b in zip(r.params, results[0].params):
            assert torch.equal(a, b)


# --- equivalence with single-process training ----------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", ("lecture",) + dp.VARIANTS)
def test_every_rank_matches_single_process_training(ranks, world_size, variant):
    reference = dp_lab.train_single_process(3, SMALL)
    ranks.resize(world_size)
    if variant == "lecture":
        results = ranks.run(dp_lab.lecture_train, 3, SMALL)
    else:  # ranks initialise with different seeds: only the broadcast makes them agree
        results = ranks.run(dp_lab.ddp_train, variant, 3, SMALL, bucket_size_mb=TWO_LAYERS_MB)
    moved = max((a - b).abs().max().item()
                for a, b in zip(reference.params, make_mlp(SMALL).parameters()))
    assert moved > 1e-3  # the steps are large enough that a wrong average could not hide
    for r in results:
        torch.testing.assert_close(r.params, reference.params)
    assert_bit_identical(results)  # and the copies are bit-identical across ranks
    # The per-rank losses are those of different slices of the batch.
    assert len({r.losses[0] for r in results}) == world_size


def pair_train(rank, world_size, variant):
    """Two independent data-parallel pairs side by side, each on its own model and data."""
    group = split_groups(PAIRS)
    config = SMALL.with_(seed=10 * (rank // 2))
    if variant == "lecture":
        return dp_lab.lecture_train(rank, world_size, 3, config, group=group)
    return dp_lab.ddp_train(rank, world_size, variant, 3, config, bucket_size_mb=TWO_LAYERS_MB,
                        group=group)


@pytest.mark.parametrize("variant", ("lecture",) + dp.VARIANTS)
def test_two_groups_of_two_each_match_their_own_single_process_training(ranks, variant):
    ranks.resize(4)
    results = ranks.run(pair_train, variant)
    for pair, members in enumerate(PAIRS):
        reference = dp_lab.train_single_process(3, SMALL.with_(seed=10 * pair))
        mine = [results[r] for r in members]
        for r in mine:
            torch.testing.assert_close(r.params, reference.params)
        assert_bit_identical(mine)
        # Each rank's slice is of its own group's batch: one half of it (d = 2, not 4).
        config = SMALL.with_(seed=10 * pair)
        halves = [mlp_loss(make_mlp(config)(dp.shard(make_batch(config), i, 2))).item()
                  for i in range(2)]
        assert [r.losses[0] for r in mine] == pytest.approx(halves)
    assert not torch.equal(results[0].params[0], results[2].params[0])  # the pairs stayed apart


def test_all_reduces_per_step(ranks):
    ranks.resize(2)
    counts = {v: ranks.run(dp_lab.ddp_train, v, 1, SMALL,
                           bucket_size_mb=TWO_LAYERS_MB)[0].all_reduces_per_step
              for v in dp.VARIANTS}
    assert counts == {"naive": SMALL.layers, "flat": 1, "overlap": SMALL.layers,
                      "bucketed": SMALL.layers // 2}


def test_buckets_follow_reverse_parameter_order_and_cap():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 40, 50)]
    buckets = dp.split_into_buckets(params[::-1], cap_bytes=4 * 70)
    assert [[p.numel() for p in b.params] for b in buckets] == [[50], [40, 30], [20, 10]]
    # A parameter bigger than the cap still gets a bucket, alone.
    assert [len(b.params) for b in dp.split_into_buckets(params, cap_bytes=4)] == [1] * 5


# --- what the wrappers must preserve ---------------------------------------------------------

def wrapper_api(rank, world_size, variant):
    model = make_mlp(SMALL.with_(seed=rank))
    wrapped = dp.wrap(variant, model, TWO_LAYERS_MB)
    x = make_batch(SMALL)
    return {"module": wrapped.module is model,
            "params": [a is b for a, b in zip(wrapped.parameters(), model.parameters())]
            + [len(list(wrapped.parameters())) == len(list(model.parameters()))],
            "forward": torch.equal(wrapped(x), model(x)),
            "buckets": (wrapped.num_buckets, wrapped.bucket_sizes)}


@pytest.mark.parametrize("variant", dp.VARIANTS)
def test_wrapper_exposes_module_parameters_in_order_and_forwards(ranks, variant):
    ranks.resize(2)
    for r in ranks.run(wrapper_api, variant):
        assert r["module"] and all(r["params"]) and r["forward"]
        layers = SMALL.layers
        assert r["buckets"] == {"naive": (layers, [1] * layers), "flat": (1, [layers]),
                                "overlap": (layers, [1] * layers),
                                "bucketed": (layers // 2, [2] * (layers // 2))}[variant]


def frozen_model(seed):
    model = make_mlp(SMALL.with_(layers=2, seed=seed))
    model[0].weight.requires_grad_(False)
    model.register_buffer("counter", torch.full((3,), float(seed)))
    return model


def frozen_and_buffers(rank, world_size, variant, blocks=None):
    group = split_groups(blocks) if blocks else None
    model = dp.wrap(variant, frozen_model(seed=10 + rank), TWO_LAYERS_MB, group=group)
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


@pytest.mark.parametrize("variant", dp.VARIANTS)
def test_frozen_parameters_and_buffers_are_broadcast_from_rank0(ranks, variant):
    ranks.resize(4)
    model = frozen_model(seed=10)
    expected = [t.detach() for t in list(model.parameters()) + list(model.buffers())]
    for r in ranks.run(frozen_and_buffers, variant):
        for a, b in zip(r, expected):
            assert torch.equal(a, b)


def test_in_a_group_the_first_member_broadcasts_by_its_global_rank(ranks):
    ranks.resize(4)
    results = ranks.run(frozen_and_buffers, "naive", blocks=[[1, 3], [0, 2]])
    for rank, first in ((0, 0), (1, 1), (2, 0), (3, 1)):
        model = frozen_model(seed=10 + first)
        expected = list(model.parameters()) + list(model.buffers())
        assert all(torch.equal(a, b.detach()) for a, b in zip(results[rank], expected))


class TiedMLP(nn.Module):
    """first and last share one weight matrix (like tied input/output embeddings)."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        h = SMALL.hidden
        self.first = nn.Linear(h, h, bias=False)
        self.middle = nn.Linear(h, h)
        self.last = nn.Linear(h, h, bias=False)
        self.last.weight = self.first.weight

    def forward(self, x, use_extra=False):
        return self.last(torch.nn.functional.gelu(self.middle(torch.nn.functional.gelu(self.first(x)))))


class PartlyUsedMLP(nn.Module):
    """`never` gets no gradient anywhere; `sometimes` only where forward is told to use it."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        h = SMALL.hidden
        self.body = nn.Linear(h, h)
        self.sometimes = nn.Linear(h, h)
        self.never = nn.Linear(h, h)

    def forward(self, x, use_extra=False):
        x = torch.tanh(self.body(x))
        return self.sometimes(x) if use_extra else x


MODELS = {"tied": TiedMLP, "partly_used": PartlyUsedMLP}


def train_model(rank, world_size, name, variant, steps=3):
    """AdamW with weight decay: it would move a parameter whose gradient is wrongly zero."""
    model = dp.wrap(variant, MODELS[name](seed=100 + rank), TWO_LAYERS_MB / 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    x = dp.shard(make_batch(SMALL), rank, world_size)
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
    x = make_batch(SMALL)
    for _ in range(steps):
        loss = sum(mlp_loss(model(dp.shard(x, r, world_size), use_extra=(r == 0)))
                   for r in range(world_size)) / world_size
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("variant", dp.VARIANTS)
def test_tied_weights_are_reduced_once(ranks, variant):
    ranks.resize(2)
    expected = train_model_single_process("tied", 2)
    for r in ranks.run(train_model, "tied", variant):
        assert r["unique_params"] == 3  # first.weight (= last.weight), middle.weight, middle.bias
        torch.testing.assert_close(r["params"], expected)


@pytest.mark.parametrize("variant", dp.VARIANTS)
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
    model = dp.wrap(variant, make_mlp(SMALL.with_(layers=2)), TWO_LAYERS_MB)
    x = make_batch(SMALL)
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


def accumulate(rank, world_size, variant, micro_batches):
    """One step over `micro_batches` micro-batches of this rank's slice: every backward but the
    last inside no_sync(), then one synchronisation. Returns the gradients, how many
    all-reduces the step issued, and the error finishing inside no_sync() raises."""
    model = dp.wrap(variant, make_mlp(SMALL.with_(seed=rank)), TWO_LAYERS_MB)
    x = dp.shard(make_batch(SMALL), rank, world_size)
    pieces = x.chunk(micro_batches)
    calls, real = [], dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counted
    try:
        for piece in pieces[:-1]:
            with model.no_sync():
                mlp_loss(model(piece), numel=x.numel()).backward()
        mlp_loss(model(pieces[-1]), numel=x.numel()).backward()
        inside = None
        with model.no_sync():
            try:
                model.finish_gradient_synchronization()
            except RuntimeError as error:
                inside = str(error)
        model.finish_gradient_synchronization()
    finally:
        dist.all_reduce = real
    return {"grads": [p.grad.clone() for p in model.parameters()], "launches": len(calls),
            "inside": inside}


@pytest.mark.parametrize("variant", dp.VARIANTS)
def test_no_sync_accumulates_micro_batches_and_synchronises_once(ranks, variant):
    ranks.resize(2)
    model = make_mlp(SMALL)
    mlp_loss(model(make_batch(SMALL))).backward()  # the whole batch in one process
    expected = [p.grad for p in model.parameters()]
    for r in ranks.run(accumulate, variant, 4):
        torch.testing.assert_close(r["grads"], expected)
        # one all-reduce per bucket per step, not per micro-batch
        assert r["launches"] == {"naive": SMALL.layers, "flat": 1, "overlap": SMALL.layers,
                                 "bucketed": SMALL.layers // 2}[variant]
        assert r["inside"] and "no_sync" in r["inside"]


# --- overlap, from timestamps ------------------------------------------------------------------

def pair_timeline(rank, world_size, variant):
    return dp_lab.timeline(rank, world_size, variant, SMALL, bucket_size_mb=TWO_LAYERS_MB, warmup=1,
                       traced=3, group=split_groups(PAIRS))


@pytest.mark.parametrize("variant,overlaps", [("naive", False), ("flat", False),
                                              ("overlap", True), ("bucketed", True)])
@pytest.mark.parametrize("pairs", [False, True])
def test_timeline_shows_all_reduces_launched_during_backward_only_with_hooks(ranks, variant,
                                                                             overlaps, pairs):
    if pairs:
        per_rank = ranks.resize(4).run(pair_timeline, variant)
    else:
        per_rank = ranks.resize(2).run(dp_lab.timeline, variant, SMALL,
                                       bucket_size_mb=TWO_LAYERS_MB, warmup=1)
    for events in per_rank:
        assert all(isinstance(e, Span) for e in events)
        backward, = [e for e in events if e.kind == "backward"]
        launches = [e.start for e in events if e.kind == "all_reduce"]
        assert len(launches) == {"naive": SMALL.layers, "flat": 1, "overlap": SMALL.layers,
                                 "bucketed": 2}[variant]
        assert any(s < backward.end for s in launches) == overlaps
        assert (dp_lab.overlap_seconds(events) > 0) == overlaps
    if not pairs:
        fig = plot_timeline({variant: per_rank})
        assert isinstance(fig, Figure) and len(fig.axes[0].get_yticks()) == 2


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, True, "25"])
def test_bad_bucket_size_is_one_clear_error(bad):
    with pytest.raises((TypeError, ValueError), match="bucket_size_mb"):
        dp.BucketedDDP(nn.Linear(2, 2), bad)


def test_wrapper_outside_a_process_group_says_where_to_build_it():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="rank function"):
        dp.NaiveDDP(nn.Linear(2, 2))


def test_bad_arguments_fail_in_the_parent_before_any_rank_starts():
    idle = LiveRanks(2, backend="gloo")
    with pytest.raises(ValueError, match="variant"):
        dp_lab.compare_with_single_process(idle, variants=("fast",))
    with pytest.raises(ValueError, match="bucket_size_mb"):
        dp_lab.compare_with_single_process(idle, bucket_size_mb=0)
    with pytest.raises(ValueError, match="batch"):
        dp_lab.compare_with_single_process(idle, config=SMALL.with_(batch=127))
    with pytest.raises(ValueError, match="variant"):
        dp_lab.compare_step_times(idle, variants=("compute", "fastest"))
    with pytest.raises(ValueError, match="batch"):
        dp_lab.compare_step_times(idle, config=SMALL.with_(batch=3))
    with pytest.raises(ValueError, match="optimizer"):
        dp_lab.train_single_process(1, SMALL, optimizer="lion")
    assert idle.pids == []
    idle.close()


def test_interleaved_timing_gives_every_variant_its_steps(ranks):
    ranks.resize(2)
    setups = [("compute", 1.0), ("naive", 1.0), ("bucketed", TWO_LAYERS_MB), ("torch", 1.0)]
    per_rank = ranks.run(dp_lab.time_interleaved, setups, SMALL, repeat=3, warmup=1)
    for times in per_rank:
        assert len(times) == len(setups)
        assert all(len(ts) == 3 and all(t > 0 for t in ts) for ts in times)


def test_core_waits_counts_each_variants_steps_from_the_kernel(ranks):
    ranks.resize(2)
    per_rank = dp_lab.measure_core_waits(ranks, ("naive", "flat"), TWO_LAYERS_MB, SMALL, repeat=3)
    for waits in per_rank:
        assert set(waits) == {"naive", "flat"}
        assert all(w >= 0 for w in waits.values())  # seconds runnable without a core, never negative
    with pytest.raises(ValueError, match="variant"):
        dp_lab.measure_core_waits(ranks, ("naive", "ddp"), TWO_LAYERS_MB, SMALL)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL path needs 2 GPUs (one per rank); the gloo path is tested above")
@pytest.mark.parametrize("variant", dp.VARIANTS)
def test_nccl_ranks_match_single_process_training(variant):
    from helpers.ranks import spawn

    reference = dp_lab.train_single_process(3, SMALL)
    for r in spawn(dp_lab.ddp_train, 2, variant, 3, SMALL, backend="nccl",
                   bucket_size_mb=TWO_LAYERS_MB):
        torch.testing.assert_close(r.params, reference.params)


def test_wait_mode_mlp_keeps_the_parameters_and_waits():
    """Wait mode: the same parameter names and shapes (the wrappers' buckets are the real ones),
    zero gradients, and a forward + backward that lasts the layers' waits."""
    import time

    real, waiting = make_mlp(SMALL), dp_lab.wait_mode_mlp(SMALL, 0.02)
    assert [(n, p.shape) for n, p in real.named_parameters()] == \
        [(n, p.shape) for n, p in waiting.named_parameters()]
    start = time.perf_counter()
    mlp_loss(waiting(make_batch(SMALL))).backward()
    assert time.perf_counter() - start >= SMALL.layers * 0.02
    assert all(p.grad is not None and not p.grad.any() for p in waiting.parameters())
