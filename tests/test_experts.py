"""Expert parallelism (notebook 09): the MoE layer on e ranks against the one-process layer.

Loss, outputs and every gradient (router, each expert, the input) for e = 2 and 4, top-1 and
top-2, with tokens dropped; bytes counted against the routing; the decoder with expert-parallel
MLPs; bad input refused in the parent.
"""
import pytest
import torch

from helpers.configs import MOE, TRANSFORMER
from helpers.cost.experts import sent_bytes
from helpers.labs import experts as ep_lab
from helpers.models import (MoE, make_moe_batch, make_moe_transformer, make_tokens, moe_loss,
                            moe_transformer_loss, route)

DROPPING = MOE.with_(tokens=128, capacity_factor=1.0)   # tight: some slots are dropped


@pytest.fixture(scope="module")
def ranks(start_ranks):
    return start_ranks(4, backend="gloo", timeout=60)


def test_moe_decoder_expert_parallel_matches_one_process(ranks):
    config = TRANSFORMER.with_(layers=2, seq=16, batch=4, hidden=64)
    moe = MOE.with_(groups=2, capacity_factor=1.0)
    results = ranks.resize(2).run(ep_lab.ep_transformer_step, config, moe)
    model = make_moe_transformer(config, moe)
    tokens = make_tokens(config)
    loss = moe_transformer_loss(model, model(tokens.inputs), tokens.targets)
    loss.backward()
    assert results[0].loss == pytest.approx(loss.item(), abs=1e-5)
    params = dict(model.named_parameters())
    for result in results:
        for name, grad in result.grads.items():
            torch.testing.assert_close(grad, params[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    held = {n for r in results for n in r.grads}
    assert held == set(params)   # every parameter, each expert on one rank


# Ordered so that the live ranks change size as rarely as possible (starting one costs seconds).
@pytest.mark.parametrize("e, top_k", [(2, 1), (2, 2), (4, 2), (4, 1)])
def test_expert_parallel_matches_one_process(ranks, e, top_k):
    config = DROPPING.with_(top_k=top_k)
    steps = ep_lab.run_ep_step(ranks, e, config)
    reference = ep_lab.reference_step(config.with_(groups=e))
    assert reference.stats.dropped > 0
    assert sum(s.stats.dropped for s in steps) == reference.stats.dropped
    assert ep_lab.compare(steps, reference) < 1e-5
    # every expert's gradient came from exactly one rank
    names = [n for s in steps for n in s.grads if ".up." in n]
    assert sorted(names) == sorted(n for n in reference.grads if ".up." in n)
    # bytes: the kept rows that leave the rank, counted from the one-process routing
    kept = reference.stats.kept        # [group = source rank][expert]
    local, row = config.experts // e, config.hidden * 4
    to = [[sum(kept[src][dst * local:(dst + 1) * local]) for dst in range(e)] for src in range(e)]
    for r, step in enumerate(steps):
        out = sent_bytes(to[r], r, row)                          # dispatch, and its gradient back
        back = sent_bytes([to[j][r] for j in range(e)], r, row)  # combine, and its gradient
        assert step.sent_bytes == 2 * (out + back)
        assert step.count_bytes == (e - 1) * local * 8


def test_one_rank_is_the_one_process_layer(ranks):
    steps = ep_lab.run_ep_step(ranks, 1, DROPPING)
    assert ep_lab.compare(steps, ep_lab.reference_step(DROPPING)) == 0
    assert steps[0].sent_bytes == 0


def test_routing_counts_drops_and_balances():
    logits = torch.tensor([[2.0, 0.0], [3.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    routing = route(logits, top_k=1, capacity=2)
    assert routing.expert.squeeze(1).tolist() == [0, 0, 0, 1]
    assert routing.keep.squeeze(1).tolist() == [True, True, False, True]   # third to expert 0 dropped
    assert routing.load.tolist() == [3, 1]
    uniform = route(torch.zeros(8, 4), top_k=1, capacity=8)
    # all to expert 0 (ties), P uniform: E · (1 · 1/4) = 1
    assert uniform.aux_loss.item() == pytest.approx(1.0)


def test_top2_gates_sum_to_one_and_second_choices_queue_last():
    layer = MoE(MOE.with_(top_k=2, capacity_factor=0.5))
    routing = layer.route_groups(make_moe_batch(MOE), 1)[0]
    torch.testing.assert_close(routing.gate.sum(-1), torch.ones(MOE.tokens))
    # with a tight capacity first choices are kept at least as often as second ones
    assert routing.keep[:, 0].sum() >= routing.keep[:, 1].sum()


def test_skew_piles_tokens_on_expert_zero_and_raises_the_aux_loss():
    fair, skewed = MoE(MOE), MoE(MOE.with_(skew=3.0))
    x = make_moe_batch(MOE)
    y0, y1 = fair(x), skewed(x)
    assert skewed.stats.load[0][0] > fair.stats.load[0][0]
    assert skewed.aux_loss > fair.aux_loss
    assert skewed.stats.dropped > fair.stats.dropped
    assert moe_loss(y1, skewed.aux_loss, MOE) > 0


class Refuse:
    """A stand-in for LiveRanks that fails if anything tries to start a process."""
    def resize(self, n):
        raise AssertionError("a process was started")


@pytest.mark.parametrize("e, config, word", [
    (3, MOE, "experts"),
    (0, MOE, "e must be"),
    (4, MOE.with_(tokens=130, experts=4), "tokens"),
])
def test_bad_input_is_refused_before_any_process_starts(e, config, word):
    with pytest.raises((ValueError, TypeError), match=word):
        ep_lab.run_ep_step(Refuse(), e, config)


@pytest.mark.parametrize("field, value, word", [
    ("top_k", 3, "top_k must be between 1 and 2"),
    ("capacity_factor", 0, "capacity_factor"),
    ("groups", 3, "tokens must be a multiple of 3"),
    ("skew", -1.0, "skew"),
])
def test_bad_config_names_the_argument(field, value, word):
    with pytest.raises(ValueError, match=word):
        MOE.with_(**{field: value})


@pytest.mark.parametrize("top_k, factor, skew, seed", [(1, 0.25, 0.0, 0), (2, 4.0, 3.0, 9)])
def test_widget_callback_at_the_controls_extremes(top_k, factor, skew, seed):
    import matplotlib
    matplotlib.use("Agg")
    from helpers.labs.experts import router_load
    from helpers.views.experts import CAPACITY_FACTORS, load_outputs, widget_experts
    assert factor in CAPACITY_FACTORS
    load = router_load(MOE.with_(top_k=top_k, capacity_factor=factor, skew=skew, seed=seed), 4)
    slots = MOE.tokens * top_k
    assert sum(load.kept) + sum(load.dropped) == slots
    assert max(load.kept) <= load.e * load.capacity
    picture, line = load_outputs(top_k, factor, skew, seed)
    assert picture["data"]["image/png"]
    assert line["text"].startswith(f"{slots} token slots; {sum(load.dropped)} dropped")
    widget = widget_experts()
    assert [o["output_type"] for o in widget.children[-1].outputs] == ["display_data", "stream"]


def test_the_capacity_line_says_it_holds_per_sending_rank():
    """Drops happen per sending rank (one capacity group each), so a bar under the dashed line
    can still have drops: the default router shows it, and the legend has to say why."""
    from helpers.labs.experts import router_load
    from helpers.views.experts import plot_token_load
    load = router_load(MOE, 4)
    under = [d for k, d in zip(load.kept, load.dropped) if k + d < load.e * load.capacity]
    assert any(under), "the default router drops tokens from a bar under the line"
    labels = [t.get_text() for t in plot_token_load(load).axes[0].get_legend().get_texts()]
    assert f"at most {load.capacity} from each of the {load.e} ranks" in labels[0]


@pytest.mark.parametrize("row_s", [None, 1e-6])
def test_timed_steps_split_the_all_to_all_time(ranks, row_s):
    """With one step the medians are that step's numbers: waiting + moving is exactly the time
    inside the all-to-alls; the experts' rows add up to the kept slots; wait mode sends the
    same bytes (the routing is the same, only the experts sleep)."""
    config = DROPPING
    runs = ep_lab.run_timed_ep_steps(ranks, 2, config, 1, row_s)
    reference = ep_lab.reference_step(config.with_(groups=2))
    kept = sum(map(sum, reference.stats.kept))
    assert sum(r.expert_rows for r in runs) == kept
    for r in runs:
        assert r.waiting_s + r.moving_s == pytest.approx(r.comm_s, abs=1e-9)
        assert r.waiting_s >= 0 and r.moving_s > 0
    compute = ep_lab.run_timed_ep_steps(ranks, 2, config, 1)
    assert [r.sent_bytes for r in runs] == [r.sent_bytes for r in compute]


def test_waiting_expert_passes_rows_through_and_waits():
    import time
    ffn = MoE(MOE).experts[0]
    x = torch.randn(50, MOE.hidden, requires_grad=True)
    expert = ep_lab.WaitingExpert(ffn, 2e-4)   # 50 rows: 10 ms forward + backward
    start = time.perf_counter()
    y = expert(x)
    y.sum().backward()
    assert time.perf_counter() - start >= 0.01 * 0.99
    assert torch.equal(y, x) and torch.equal(x.grad, torch.ones_like(x))
    assert all(torch.count_nonzero(p.grad) == 0 for p in ffn.parameters())
    assert ep_lab.expert_row_seconds(MOE, repeat=2) > 0


@pytest.mark.parametrize("e, steps, row_s, word", [
    (2, 0, None, "steps must be between 1"),
    (2, 5, 0.5, "expert_row_s must be"),
    (2, 5, -1e-6, "expert_row_s must be"),
    (3, 5, None, "experts"),
])
def test_timed_steps_refuse_bad_input_before_any_process_starts(e, steps, row_s, word):
    with pytest.raises(ValueError, match=word):
        ep_lab.run_timed_ep_steps(Refuse(), e, MOE, steps, row_s)
