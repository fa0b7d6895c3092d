"""Mixed precision in FSDP (helpers.parallel.fsdp.MixedPrecision): bit for bit at d = 1 against
one process casting the same way, within the derived reduction bound at d > 1, the bytes a rank
keeps and hands to the collectives against the 2 + 2 + 12 formula, and no warnings.

Rank functions used here are defined at module level: spawned ranks import this module.
"""
import warnings

import pytest
import torch

from helpers.configs import SMALL
from helpers.cost import memory as cost
from helpers.labs import memory as mr
from helpers.parallel.fsdp import MixedPrecision

BF16 = MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
BF16_REDUCED = MixedPrecision(torch.bfloat16, reduce_dtype=torch.bfloat16)
# fp16 matmuls are about 9x slower than fp32 on this CPU: a smaller decoder for them
TINY = SMALL.with_(hidden=64, layers=1)
FP16_REDUCED = MixedPrecision(torch.float16, reduce_dtype=torch.float16)


@pytest.fixture(scope="module")
def ranks(start_ranks):
    # two ranks: d = 2 reduces once; notebook 08 checks d = 4 (three additions) under nbval
    return start_ranks(2, backend="gloo")


# --- the arithmetic, without ranks ---------------------------------------------------------

def test_the_lecture_formula_and_the_fp32_reduction_variant():
    assert cost.mixed_precision_bytes("bfloat16", "bfloat16") == (2, 2, 12)
    assert cost.mixed_precision_bytes("bfloat16", "float32") == (2, 4, 12)
    assert cost.mixed_precision_bytes("float32", "float32") == (4, 4, 12)
    # fp32 everywhere, FSDP's wire bytes are comm_volume's 3Ψ(d−1)/d
    assert cost.fsdp_wire_bytes(4, 1e6) == pytest.approx(cost.comm_volume(3, 4, 1e6))
    assert cost.fsdp_wire_bytes(4, 1e6, 2, 2) == pytest.approx(cost.comm_volume(3, 4, 1e6) / 2)


def test_the_reduction_bound_grows_with_depth_and_unit_roundoff():
    u = 2.0 ** -8
    assert cost.reduction_tolerance(2, "bfloat16") == pytest.approx(u / (1 - u) + 2.0 ** -24,
                                                                    rel=1e-6)
    assert cost.reduction_tolerance(4, "bfloat16") == pytest.approx(3 * u / (1 - 3 * u),
                                                                    rel=1e-4)
    by_dtype = [cost.reduction_tolerance(4, name) for name in ("bfloat16", "float16", "float32")]
    assert by_dtype == sorted(by_dtype, reverse=True)
    assert cost.reduction_tolerance(8, "bfloat16") > cost.reduction_tolerance(4, "bfloat16")
    with pytest.raises(ValueError, match="must be below 1"):
        cost.reduction_tolerance(257, "bfloat16")  # 256 roundings of 2⁻⁸: no bound left


@pytest.mark.parametrize("kwargs,words", [
    (dict(compute_dtype=torch.int8), "compute_dtype must be one of"),
    (dict(compute_dtype=torch.bfloat16, reduce_dtype=torch.float16),
     "reduce_dtype must be torch.float32 or the compute dtype"),
])
def test_a_policy_gloo_cannot_carry_is_refused_before_any_rank_starts(kwargs, words):
    with pytest.raises(ValueError, match=words):
        MixedPrecision(**kwargs)
    with pytest.raises(ValueError, match="stage 3"):
        mr.check_run(2, 2, SMALL, precision=BF16)


# --- on live ranks ----------------------------------------------------------------------------

def mixed_runs_without_warnings(rank, world_size, precision, config):
    """train_stage (measured) and fsdp_gradients with every warning an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = mr.train_stage(rank, world_size, 3, 3, config, precision=precision)
        mr.fsdp_gradients(rank, world_size, precision, config)
    return run


@pytest.mark.parametrize("precision,config", [(BF16, SMALL), (BF16_REDUCED, SMALL),
                                              (FP16_REDUCED, TINY)])
def test_a_rank_keeps_and_sends_what_the_formula_says_without_a_warning(ranks, precision,
                                                                        config):
    d, psi = 2, config.parameters
    for run in ranks.resize(d).run(mixed_runs_without_warnings, precision, config):
        formula = mr.mixed_formula(psi, d, precision)
        # the formula's bytes up to the padding of each unit's shard (< d elements) and
        # AdamW's 4-byte step per unit
        assert 0 <= run.state.params - formula.params < 8 * d * (config.layers + 2)
        assert 0 <= run.state.grads - formula.grads < 8 * d * (config.layers + 2)
        assert 0 <= run.state.optimizer - formula.optimizer < 24 * d * (config.layers + 2)
        compute, reduce = cost.mixed_precision_bytes(mr.dtype_name(precision.compute_dtype),
                                                     mr.dtype_name(precision.reduce_dtype))[:2]
        assert run.comm["all_gather"] == pytest.approx(2 * compute * psi, abs=64 * d)
        assert run.comm["reduce_scatter"] == pytest.approx(reduce * psi, abs=64 * d)
        assert run.wire_bytes() == pytest.approx(cost.fsdp_wire_bytes(d, psi, compute, reduce),
                                                 abs=64 * d)


@pytest.mark.parametrize("precision", [BF16, BF16_REDUCED])
def test_the_averaged_gradient_is_within_the_derived_bound(ranks, precision):
    d = 2
    check = mr.check_mixed_gradients(ranks, d, precision)
    assert check.holds, check
    assert check.tolerance == cost.reduction_tolerance(d, mr.dtype_name(precision.reduce_dtype))
    # the fp32 reduction rounds (almost) nothing; the bf16 one rounds, but by less than what
    # computing in bf16 already moved the gradient away from fp32's
    if precision.reduce_dtype == torch.float32:
        assert check.reduction_error < 1e-6
    else:
        assert 1e-4 < check.reduction_error < check.compute_error


def test_fp16_gradient_within_the_bound(ranks):
    assert mr.check_mixed_gradients(ranks, 2, FP16_REDUCED, TINY).holds


# d = 1 last: shrinking the live ranks stops one, growing them would start one (seconds)

@pytest.mark.parametrize("precision,config", [(BF16, SMALL), (BF16_REDUCED, SMALL),
                                              (FP16_REDUCED, TINY)])
def test_one_rank_trains_bit_for_bit_like_one_process_casting_the_same_way(ranks, precision,
                                                                           config):
    [run] = ranks.resize(1).run(mr.train_stage, 3, 3, config, measure_last=False,
                                precision=precision)
    reference = mr.train_reference(3, config, precision=precision)
    assert all(torch.equal(run.params[name], p) for name, p in reference.items())
    # and the masters hold what the compute dtype cannot: some differ from their own cast
    assert any(not torch.equal(p, p.to(precision.compute_dtype).to(p.dtype))
               for p in reference.values())
