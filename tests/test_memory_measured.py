"""What a rank holds, measured (helpers.parallel.memory), against helpers.cost.memory."""
import pytest
import torch

from helpers.configs import SMALL
from helpers.cost import memory as cost
from helpers.labs import memory as mr
from helpers.models import lm_loss, make_tokens, make_transformer, transformer_forward
from helpers.parallel import trace
from helpers.parallel.memory import PeakMemory, SavedActivations, storage_bytes


def shape_of(config):
    return cost.ActivationShape(config.batch, config.seq, config.hidden, config.heads,
                                config.layers, config.vocab)


@pytest.mark.parametrize("config", [SMALL, SMALL.with_(heads=2, layers=3, vocab=100)])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_saved_activations_are_the_formula_byte_for_byte(config, checkpointed):
    model, tokens = make_transformer(config), make_tokens(config)
    with SavedActivations() as saved:
        loss = lm_loss(transformer_forward(model, tokens.inputs, checkpointed), tokens.targets)
    assert saved.bytes == cost.activation_bytes(shape_of(config), 4, checkpointed)
    loss.backward()  # and the checkpointed graph still trains
    assert all(p.grad is not None for p in model.parameters())


def test_checkpointing_gives_the_same_gradients():
    model, tokens = make_transformer(SMALL), make_tokens(SMALL)
    grads = []
    for checkpointed in (False, True):
        lm_loss(transformer_forward(model, tokens.inputs, checkpointed), tokens.targets).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        model.zero_grad()
    torch.testing.assert_close(grads[1], grads[0])


def test_storage_is_counted_once():
    flat = torch.zeros(100)
    views = [flat[:50], flat[50:], flat.view(10, 10)]
    assert storage_bytes(views) == 400
    assert storage_bytes(views + [torch.zeros(3)]) == 412
    freed = torch.zeros(10)
    freed.untyped_storage().resize_(0)
    assert storage_bytes([freed]) == 0


def test_peak_memory_sees_a_temporary_that_is_gone_at_the_end():
    with PeakMemory(baseline=1000) as peak:
        kept = torch.zeros(1000)       # 4000 bytes, kept
        temp = torch.zeros(25_000)     # 100 kB, freed before the end
        del temp
    assert peak.bytes >= 1000 + 4000 + 100_000
    assert peak.curve[-1][1] == pytest.approx(1000 + 4000, abs=512)
    assert kept.numel() == 1000


def test_the_event_log_counts_elements_times_itemsize_while_someone_records():
    zero, fsdp = trace.Recorder("zero"), trace.Recorder("fsdp")
    zero.add("all_gather", torch.zeros(1))               # nobody records: dropped
    with trace.recording("zero") as log:
        zero.add("all_gather", torch.zeros(10))
        zero.add("all_gather", torch.zeros(5, dtype=torch.float64))
        fsdp.add("all_gather", torch.zeros(7))           # another block: not asked for
        with trace.recording("zero") as inner:           # the innermost recording gets it
            zero.add("reduce_scatter", torch.zeros(3, dtype=torch.bfloat16))
    assert trace.bytes_by_op(log) == {"all_gather": 80}
    assert trace.bytes_by_op(inner) == {"reduce_scatter": 6}
    assert not trace.recording_for("zero")


def check_measured_like_the_formulas(results):
    """Shared by tests/test_zero2.py (stages 0-2) and tests/test_fsdp.py (stage 3), which
    measure in the runs they train anyway (one set of live ranks per module)."""
    for res in results:
        formula = res.formula()
        for run in res.ranks:  # state within 2 % of the formula, term by term
            assert abs(mr.rel_error(run.state.total, formula.total)) < 0.02
            for kind in ("params", "grads", "optimizer"):
                assert getattr(run.state, kind) == pytest.approx(getattr(formula, kind), rel=0.02)
        run = res.run
        # wire bytes: 2Ψ(d−1)/d for stages 0-2, 3Ψ(d−1)/d for stage 3, up to the padding
        assert run.wire_bytes() == pytest.approx(
            cost.comm_volume(res.stage, res.d, res.config.parameters), rel=1e-3, abs=1)
        forward, backward, step = run.phases
        assert (forward.name, backward.name, step.name) == ("forward", "backward",
                                                           "optimizer step")
        # the forward ends holding what it started with plus the saved activations (less the
        # token ids, allocated before the step began); the peak is the highest phase's
        assert forward.end_bytes >= forward.start_bytes + run.activations - 4096
        assert run.peak_bytes == max(p.peak_bytes for p in run.phases)
