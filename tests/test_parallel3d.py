"""3-D parallelism (helpers.parallel.parallel3d, tp_transformer) against single-process training
of the same decoder, on real gloo ranks: every factorization of 4 ranks and 2·2·2 on 8, and the
same model through PyTorch's DeviceMesh / parallelize_module / fully_shard / pipelining."""
import math

import pytest
import torch
import torch.distributed as dist

from helpers.configs import TRANSFORMER
from helpers.labs import parallel3d as lab3d
from helpers.layout import Layout, factorizations
from helpers.models import lm_loss, make_tokens, make_transformer
from helpers.parallel import parallel3d as p3
from helpers.parallel.groups import split_groups
from helpers.parallel.tp_transformer import SHARDED_DIMS, shard_block, shard_dim
from helpers.ranks import LiveRanks, RankError

# heads divisible by every t (up to 4), layers by every p, batch by every d·m (m = 2).
SMALL = TRANSFORMER.with_(vocab=128, hidden=64, heads=4, layers=4, seq=16, batch=8)
M = 2
# AdamW's step divides each element by its own gradient's magnitude: an element whose gradient
# is ~0 moves by up to lr on float rounding alone (1 in 4096 elements at lr = 1e-2 lands 3e-5
# off). At lr = 1e-3 that stays inside assert_close's float32 atol (1e-5), while every
# parameter still moves by about lr, 100× the tolerance.
LR = 1e-3
FOUR = [(m.d, m.t, m.p) for m in factorizations(4)]
PAIRS = [[0, 1], [2, 3]]


@pytest.fixture(scope="module")
def four(start_ranks):
    return start_ranks(4, backend="gloo", timeout=60)


@pytest.fixture(scope="module")
def eight(start_ranks):
    return start_ranks(8, backend="gloo", timeout=120)


@pytest.fixture(scope="module")
def one_step():
    return lab3d.reference_3d(SMALL, steps=1)


@pytest.fixture(scope="module")
def two_steps():
    return lab3d.reference_3d(SMALL, steps=2, lr=LR)


def assert_matches(whole: lab3d.Whole, reference: lab3d.Whole, params: bool = False):
    """Loss, every gradient (and parameter) within assert_close's float32 tolerances."""
    torch.testing.assert_close(torch.tensor(whole.losses), torch.tensor(reference.losses))
    assert list(whole.grads) == list(reference.grads)  # every parameter, in the model's order
    for name, grad in reference.grads.items():
        torch.testing.assert_close(whole.grads[name], grad, msg=lambda m, n=name: f"{n}: {m}")
    if params:
        assert list(whole.params) == list(reference.params)
        for name, param in reference.params.items():
            torch.testing.assert_close(whole.params[name], param,
                                       msg=lambda m, n=name: f"{n}: {m}")


# --- ours: every factorization ------------------------------------------------------------

def test_the_four_rank_factorizations_are_the_six_of_the_issue():
    assert sorted(FOUR) == sorted([(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2),
                                   (1, 2, 2)])


@pytest.mark.parametrize("d,t,p", FOUR)
def test_loss_and_every_gradient_match_single_process(four, one_step, d, t, p):
    results = lab3d.run_3d(four, d, t, p, M, SMALL)
    assert_matches(lab3d.assemble(results), one_step)
    assert lab3d.replicas_agree(results)
    # the loss lives on the last stage only
    assert [r.loss is not None for r in results] == [r.coords.pp == p - 1 for r in results]


@pytest.mark.parametrize("d,t,p", FOUR)
def test_parameters_after_two_adamw_steps_match(four, two_steps, d, t, p):
    results = lab3d.run_3d(four, d, t, p, M, SMALL, steps=2, optimizer="adamw", lr=LR)
    assert_matches(lab3d.assemble(results), two_steps, params=True)
    moved = max((two_steps.params[n] - q).abs().max().item()
                for n, q in make_transformer(SMALL).named_parameters())
    assert moved > LR / 2  # far outside the tolerance: a wrong update could not hide


def test_2x2x2_on_eight_ranks_matches_loss_gradients_and_parameters(eight, two_steps):
    results = lab3d.run_3d(eight, 2, 2, 2, M, SMALL, steps=2, lr=LR)
    assert_matches(lab3d.assemble(results), two_steps, params=True)
    assert lab3d.replicas_agree(results)


def test_shards_are_named_after_the_parameter_they_slice(four, one_step):
    results = lab3d.run_3d(four, 1, 2, 2, M, SMALL)
    for r in results:
        for name, grad in r.grads.items():
            shard = r.shards[name]
            assert shard.dim == shard_dim(name)
            assert shard.index == (r.coords.tp if shard.dim is not None else 0)
            assert shard.of(one_step.grads[name]).shape == grad.shape
    stage0 = {n for r in results if r.coords.pp == 0 for n in r.grads}
    last = {n for r in results if r.coords.pp == 1 for n in r.grads}
    assert "embed.tokens.weight" in stage0 and "head.out.weight" in last
    assert {n for n in stage0 if n.startswith("blocks.")} == {
        n for n in one_step.grads if n.startswith(("blocks.0.", "blocks.1."))}


# --- tensor parallelism alone -------------------------------------------------------------

def test_replicated_parameters_get_identical_gradients_on_the_tp_group(four):
    results = lab3d.run_3d(four, 1, 4, 1, M, SMALL)
    replicated = [n for n in results[0].grads if shard_dim(n) is None]
    assert {"embed.tokens.weight", "blocks.0.attn_norm.weight", "blocks.3.mlp_norm.bias",
            "head.norm.weight", "head.out.weight"} <= set(replicated)
    for name in replicated:  # bit for bit, with no collective of their own
        assert results[0].grads[name].abs().max() > 0, name
        for r in results[1:]:
            assert torch.equal(r.grads[name], results[0].grads[name]), name
    # and every sharded weight is cut: each of the 4 ranks holds a quarter of it
    whole = dict(make_transformer(SMALL).named_parameters())
    sharded = [n for n in results[0].grads if shard_dim(n) is not None]
    assert len(sharded) == len(SHARDED_DIMS) * SMALL.layers
    for name in sharded:
        assert 4 * results[0].grads[name].shape[shard_dim(name)] == \
            whole[name].shape[shard_dim(name)]


def pair_block(rank, world_size):
    """Two independent TP groups of 2 side by side, each sharding its own seed's block."""
    group = split_groups(PAIRS)
    config = SMALL.with_(seed=rank // 2)
    block = shard_block(make_transformer(config).blocks[0], group)
    x = make_transformer(config).embed(make_tokens(config).inputs).detach().requires_grad_()
    out = block(x)
    out.square().mean().backward()
    return {"out": out.detach(), "x_grad": x.grad,
            "grads": {n: q.grad for n, q in block.named_parameters()}}


def test_two_tp_groups_of_two_each_match_their_own_block(four):
    results = four.resize(4).run(pair_block)
    for pair, members in enumerate(PAIRS):
        config = SMALL.with_(seed=pair)
        block = make_transformer(config).blocks[0]
        x = make_transformer(config).embed(make_tokens(config).inputs).detach().requires_grad_()
        out = block(x)
        out.square().mean().backward()
        for r in (results[i] for i in members):
            torch.testing.assert_close(r["out"], out.detach())
            torch.testing.assert_close(r["x_grad"], x.grad)
        for name, q in block.named_parameters():
            dim = shard_dim(name)
            pieces = [results[i]["grads"][name] for i in members]
            whole = pieces[0] if dim is None else torch.cat(pieces, dim=dim)
            torch.testing.assert_close(whole, q.grad, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(results[0]["out"], results[2]["out"])  # the pairs stayed apart


# --- the timeline -------------------------------------------------------------------------

def test_timeline_has_every_kind_of_span_in_order(eight):
    d, t, p = 2, 2, 2
    results = lab3d.run_3d(eight, d, t, p, M, SMALL, steps=2, timeline=True)
    blocks = SMALL.layers // p
    for r in results:
        spans = r.timeline
        assert all(isinstance(s, p3.Span) and s.kind in p3.SPAN_KINDS for s in spans)
        assert {s.kind for s in spans} == set(p3.SPAN_KINDS)
        assert all(s.start >= 0 and s.end >= s.start for s in spans)
        ordered = sorted(spans, key=lambda s: s.start)
        for a, b in zip(ordered, ordered[1:]):  # one thing at a time on a rank
            assert b.start >= a.end - 1e-9, (a, b)
        # Megatron: 2 all-reduces per block forward (g) and 2 backward (f), per micro-batch
        assert sum(s.kind == "tp_comm" for s in spans) == 4 * blocks * M
        assert sum(s.kind == "dp_comm" for s in spans) == 1  # DDP waits once per step
        labels = {s.label for s in spans if s.kind == "compute"}
        assert labels == {f"{k} {mb}" for k in "FB" for mb in range(M)}
    assert all(r.timeline is None for r in lab3d.run_3d(eight, d, t, p, M, SMALL))


# --- the measurement path: layouts kept built on the ranks --------------------------------

def test_a_cached_layout_starts_from_the_single_process_step_and_is_built_once(four, one_step):
    from helpers.layout import Layout
    from helpers.labs import layouts
    four.resize(4).run(layouts.forget_layouts)
    lay = Layout(1, 2, 2, M)
    results = layouts.first_steps(four, lay, SMALL)
    assert_matches(lab3d.assemble(results), one_step)
    run = layouts.run_layout(four, lay, SMALL, steps=3)
    assert len(run.steps_s) == 3 and run.step_s == sorted(run.steps_s)[1]
    for spans in run.timelines:  # the optimizer step closes every rank's step
        assert max(spans, key=lambda s: s.end).kind == "optimizer"
    layouts.run_layout(four, lay, SMALL, steps=1)
    assert four.run(layouts.forget_layouts) == [1] * 4  # one build, kept between the calls
    assert four.run(layouts.forget_layouts) == [0] * 4


def test_the_widget_shows_text_and_both_figures_in_one_update(four, one_step):
    """A click on run replaces the output with the sentence, the breakdown and the Gantt chart,
    set as one list of outputs after the run (none left to matplotlib's display hook). The
    sentence gives the fresh model's first loss, the same on every click, and the loss now,
    which falls as the layout trains on."""
    import re

    from helpers.cost.alpha_beta import Fit
    from helpers.cost.parallel3d import Calibration, shapes_used, stages_used
    from helpers.layout import Layout
    from helpers.views.parallel3d import widget_parallel3d
    lay = Layout(1, 2, 2, M)
    calibration = Calibration(   # prices this one layout: 1 ms a piece, 10 µs a message
        world=4, compute_s=dict.fromkeys(shapes_used([lay], SMALL), 1e-3), cores=4.0,
        tp_all_reduce={2: Fit("all_reduce", 1e-5, 0.0)}, all_reduce={},
        send_recv=Fit("send_recv", 1e-5, 0.0), optimizer_s=dict.fromkeys(stages_used([lay], SMALL), 0.0),
        lateness={})
    widget = widget_parallel3d(four.resize(4), calibration, SMALL, steps=1)
    (mesh_box, m_box, button), out = widget.children[0].children, widget.children[1]
    assert [(v.d, v.t, v.p) for _, v in mesh_box.options] == [(1, 2, 2)]  # the only one priced
    assert m_box.options == (M,)
    assert button.description == f"run 1·2·2 m={M}"   # what a click will run
    sentence = (r"1·2·2 m=2: 1 step \d+ ms, predicted \d+ ms \([+-]\d+%\)\n"
                r"loss: its first step's loss ([\d.]+) \(the fresh model's: the same on every "
                r"layout\), ([\d.]+) at this run's first step \(it trains on from run to run\)\n")
    losses = []
    for _ in range(2):
        button.click()
        kinds = [o["output_type"] for o in out.outputs]
        assert kinds == ["stream", "display_data", "display_data"], out.outputs
        found = re.fullmatch(sentence, out.outputs[0]["text"])
        assert found, out.outputs[0]["text"]
        losses.append(tuple(map(float, found.groups())))
        assert all(o["data"]["image/png"] for o in out.outputs[1:])
    (first, now), (first_again, later) = losses
    assert first == first_again == pytest.approx(one_step.loss, abs=1e-4)
    assert later < now


# --- wait mode (helpers.parallel.wait_mode): the same calls, compute replaced by waits ------
# (before torch's pieces: the ranks are warm here, and some of those tests restart them)

BLOCK_S, HEAD_S = 0.01, 0.004


def _calls_of_a_wait_mode_step(rank, world_size, layout, config, waits):
    """One rank's torch.distributed calls in its second step (the first builds DDP's buckets),
    its compute spans' total and its loss."""
    from helpers.exercises.calls import recorded_calls
    trainer = lab3d.Trainer3D(rank, world_size, layout.d, layout.t, layout.p, layout.m, config,
                        waits=waits)
    try:
        trainer.step()
        with recorded_calls() as calls:
            result = trainer.step(timeline=True)
        compute = sum(s.end - s.start for s in result.spans if s.kind == "compute")
        return [(c.op, c.nbytes, c.shape, c.peer, c.group) for c in calls], compute, result.loss
    finally:
        trainer.close()


@pytest.mark.parametrize("layout", [Layout(1, 2, 2, 2), Layout(2, 2, 1, 1)])
def test_a_wait_mode_step_makes_the_real_steps_calls_and_waits_its_pieces(four, layout):
    real = four.run(_calls_of_a_wait_mode_step, layout, SMALL, None)
    waited = four.run(_calls_of_a_wait_mode_step, layout, SMALL, (BLOCK_S, HEAD_S))
    for rank, ((calls, _, _), (wait_calls, compute, loss)) in enumerate(zip(real, waited)):
        assert any(op == "all_reduce" for op, *_ in calls)
        # the same calls; DDP's bucket may go a little earlier or later among the TP calls (a
        # waiting piece hands over all its parameters' gradients at once)
        assert sorted(wait_calls, key=repr) == sorted(calls, key=repr), f"rank {rank}"
        stage = layout.coords(rank).pp
        pieces = SMALL.layers // layout.p * BLOCK_S + (HEAD_S if stage == layout.p - 1 else 0)
        assert compute >= layout.m * pieces
        if stage == layout.p - 1:  # zero logits: the loss of a uniform guess
            assert math.isclose(loss, math.log(SMALL.vocab), rel_tol=1e-6)


def test_wait_mode_seconds_time_each_unsharded_piece_and_cut_a_block_t_ways(four):
    from helpers.cost.parallel3d import Shape, shapes_used
    from helpers.labs.layouts import wait_mode_seconds
    layouts = (Layout(1, 4, 1), Layout(2, 2, 1), Layout(1, 1, 4, 4))
    waits = dict(wait_mode_seconds(four, layouts, SMALL, repeat=2))
    assert sorted(waits) == shapes_used(layouts, SMALL)
    for shape, seconds in waits.items():
        assert seconds > 0
        if shape.t > 1:
            alone = waits.get(Shape(shape.part, shape.tokens, 1))
            if alone is not None:
                assert math.isclose(seconds * shape.t, alone)


# --- PyTorch's own pieces -----------------------------------------------------------------

def test_torch_device_mesh_tp_fsdp2_and_pipelining_together_on_8_ranks(eight, one_step):
    """All three of PyTorch's pieces run on gloo in torch 2.13: same loss and gradients."""
    results = lab3d.run_torch_3d(eight, 2, 2, 2, M, SMALL, data_parallel="fsdp")
    assert_matches(lab3d.assemble(results), one_step)


@pytest.mark.parametrize("d,t,p", [(2, 2, 1), (2, 1, 2), (1, 2, 2)])
def test_torch_pieces_two_at_a_time_on_4_ranks(four, two_steps, d, t, p):
    results = lab3d.run_torch_3d(four, d, t, p, M, SMALL, steps=2, lr=LR, data_parallel="fsdp")
    assert_matches(lab3d.assemble(results), two_steps, params=True)


def test_torch_ddp_with_pipelining_runs_one_step_only(four, one_step):
    results = lab3d.run_torch_3d(four, 2, 1, 2, M, SMALL, data_parallel="ddp")
    assert_matches(lab3d.assemble(results), one_step)
    with pytest.raises(RankError, match=lab3d.DDP_WITH_PP_ERROR):
        lab3d.run_torch_3d(four, 2, 1, 2, M, SMALL, steps=2, data_parallel="ddp")


def test_torch_ddp_around_tensor_parallel_dtensors_fails_on_gloo(four):
    """DDP × TP does not run: DDP's broadcast of the starting weights concatenates plain
    tensors with TP's DTensors (torch 2.13, gloo)."""
    with pytest.raises(RankError) as error:
        lab3d.run_torch_3d(four, 2, 2, 1, M, SMALL, data_parallel="ddp")
    assert lab3d.DDP_WITH_TP_ERROR in str(error.value)


# --- bad input ----------------------------------------------------------------------------

def test_bad_arguments_fail_in_the_parent_before_any_rank_starts():
    idle = LiveRanks(4, backend="gloo")
    with pytest.raises(ValueError, match="heads"):
        lab3d.run_3d(idle, 1, 3, 1, M, SMALL.with_(heads=2, hidden=64))
    with pytest.raises(ValueError, match="layers"):
        lab3d.run_3d(idle, 1, 1, 3, M, SMALL)
    with pytest.raises(ValueError, match="batch"):
        lab3d.run_3d(idle, 2, 1, 2, 3, SMALL)
    with pytest.raises(ValueError, match="optimizer"):
        lab3d.run_3d(idle, 1, 1, 4, M, SMALL, optimizer="lion")
    with pytest.raises(ValueError, match="steps"):
        lab3d.run_3d(idle, 1, 1, 4, M, SMALL, steps=0)
    with pytest.raises(ValueError, match="m must be >= 4"):
        lab3d.run_torch_3d(idle, 1, 1, 4, 2, SMALL)
    with pytest.raises(ValueError, match="data_parallel"):
        lab3d.run_torch_3d(idle, 2, 1, 2, 2, SMALL, data_parallel="zero")
    assert idle.pids == []
    idle.close()


def test_reference_is_plain_training():
    reference = lab3d.reference_3d(SMALL)
    model = make_transformer(SMALL)
    loss = lm_loss(model(make_tokens(SMALL).inputs), make_tokens(SMALL).targets)
    loss.backward()
    assert reference.loss == loss.item()
    assert all(torch.equal(reference.grads[n], q.grad) for n, q in model.named_parameters())
    assert not dist.is_initialized()
