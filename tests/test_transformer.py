"""helpers.models' decoder (notebook 07): seeded, causal, ln V at init, FLOPs as counted."""
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from helpers.configs import TRANSFORMER, TransformerConfig
from helpers.models import (causal_attention, lm_loss, make_tokens, make_transformer,
                            transformer_flops)

SMALL = TRANSFORMER.with_(vocab=64, hidden=32, heads=4, layers=2, seq=16, batch=2)


def test_same_config_same_weights_and_loss_whatever_the_global_rng():
    torch.manual_seed(123)
    a = make_transformer(SMALL)
    torch.manual_seed(456)
    b = make_transformer(SMALL)
    assert list(a.state_dict()) == list(b.state_dict())
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    inputs, targets = make_tokens(SMALL)
    assert torch.equal(lm_loss(a(inputs), targets), lm_loss(b(inputs), targets))
    # another seed gives other weights and other tokens
    c = make_transformer(SMALL.with_(seed=1))
    assert not torch.equal(a.head.out.weight, c.head.out.weight)
    assert not torch.equal(inputs, make_tokens(SMALL.with_(seed=1)).inputs)


def test_building_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    make_transformer(SMALL)
    make_tokens(SMALL)
    assert torch.equal(torch.rand(3), expected)


def test_tokens_are_targets_shifted_by_one():
    inputs, targets = make_tokens(SMALL)
    assert inputs.shape == targets.shape == (SMALL.batch, SMALL.seq)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert 0 <= int(inputs.min()) and int(targets.max()) < SMALL.vocab


def test_changing_a_later_token_leaves_earlier_logits_unchanged():
    model = make_transformer(SMALL)
    inputs, _ = make_tokens(SMALL)
    changed = inputs.clone()
    cut = SMALL.seq // 2
    changed[:, cut] = (changed[:, cut] + 1) % SMALL.vocab
    with torch.no_grad():
        before, after = model(inputs), model(changed)
    assert torch.equal(before[:, :cut], after[:, :cut])
    assert not torch.allclose(before[:, cut:], after[:, cut:])


def test_loss_at_init_is_about_ln_vocab():
    loss = lm_loss(*_forward(TRANSFORMER)).item()
    assert abs(loss - math.log(TRANSFORMER.vocab)) < 0.1 * math.log(TRANSFORMER.vocab)


def _forward(config):
    inputs, targets = make_tokens(config)
    return make_transformer(config)(inputs), targets


def test_loss_shards_add_up_with_numel():
    logits, targets = _forward(SMALL)
    whole = lm_loss(logits, targets)
    halves = [lm_loss(logits[i:i + 1], targets[i:i + 1], numel=targets.numel())
              for i in range(SMALL.batch)]
    torch.testing.assert_close(sum(halves), whole)


def test_parameter_count_and_flops_formula_match_the_module_for_the_defaults():
    model = make_transformer(TRANSFORMER)
    assert sum(p.numel() for p in model.parameters()) == TRANSFORMER.parameters
    inputs, _ = make_tokens(TRANSFORMER)
    # The CPU's fused attention kernel has no FLOP formula; the math kernel is plain bmm's.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(inputs)
    flops = transformer_flops(TRANSFORMER)
    assert counter.get_total_flops() == flops.total
    assert flops.total == TRANSFORMER.layers * flops.block + flops.head


def test_attention_on_a_slice_of_heads_is_that_slice_of_the_output():
    """What tensor parallelism relies on: heads are independent."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 16, generator=g) for _ in range(3))
    full = causal_attention(q, k, v, heads=4)
    half = causal_attention(q[..., 8:], k[..., 8:], v[..., 8:], heads=2)
    torch.testing.assert_close(half, full[..., 8:])


def test_blocks_slice_into_pipeline_stages():
    model = make_transformer(SMALL)
    inputs, _ = make_tokens(SMALL)
    x = model.embed(inputs)
    for stage in (model.blocks[:1], model.blocks[1:]):
        for block in stage:
            x = block(x)
    torch.testing.assert_close(model.head(x), model(inputs))


@pytest.mark.parametrize("changes, error", [
    ({"hidden": 30}, "hidden must be a multiple of 4"),
    ({"heads": 0}, "heads must be >= 1"),
    ({"seed": -1}, "seed must be >= 0"),
])
def test_bad_sizes_are_refused_with_one_wording(changes, error):
    with pytest.raises(ValueError, match=error):
        TRANSFORMER.with_(**changes)
    with pytest.raises(TypeError, match="vocab must be an int"):
        TransformerConfig(vocab=10.0)
