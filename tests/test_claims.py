"""claim(): an exact claim prints its tick or fails the cell; a measured one only reports this run."""
import numpy as np
import pytest
import torch

from helpers.claims import ClaimError, claim


def test_exact_claim_prints_a_tick_with_its_numbers(capsys):
    claim("the bubble is 3/7", abs(3 / 7 - 0.4286) < 1e-3, kind="exact", detail="0.429")
    assert capsys.readouterr().out == "✓ the bubble is 3/7 (0.429)\n"


def test_false_exact_claim_fails_the_cell_and_says_why(capsys):
    with pytest.raises(ClaimError, match=r"^✗ bytes equal the formula \(524,288 against 655,360\)$"):
        claim("bytes equal the formula", 524_288 == 655_360, kind="exact",
              detail="524,288 against 655,360")
    assert capsys.readouterr().out == ""
    assert issubclass(ClaimError, AssertionError)  # nbval and pytest read it as a failed check


def test_measured_claim_reports_this_run_and_never_fails(capsys):
    claim("the bubble is within 10 % of the formula", True, kind="measured", detail="+3 %")
    claim("the bubble is within 10 % of the formula", False, kind="measured", detail="+34 %")
    assert capsys.readouterr().out.splitlines() == [
        "✓ this run shows that the bubble is within 10 % of the formula (+3 %)",
        "✗ this run does not show that the bubble is within 10 % of the formula (+34 %)"]


def test_numpy_and_torch_bools_count_as_verdicts(capsys):
    claim("the sum is 3", np.array([1, 2]).sum() == 3, kind="exact")
    claim("all equal", torch.equal(torch.ones(2), torch.ones(2)), kind="exact")
    claim("all close", torch.allclose(torch.ones(2), torch.ones(2)), kind="exact")
    claim("no difference", (torch.ones(2) == 1).all(), kind="exact")
    assert capsys.readouterr().out.splitlines() == ["✓ the sum is 3", "✓ all equal", "✓ all close",
                                                    "✓ no difference"]
    with pytest.raises(TypeError, match="holds must be a bool"):
        claim("equal", torch.ones(2) == 1, kind="exact")  # two verdicts, not one


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(kind="deterministic"), ValueError, "kind must be one of 'exact', 'measured'"),
    (dict(kind="exact", holds=0.3), TypeError, "holds must be a bool"),
    (dict(kind="exact", text="  "), ValueError, "text must be a non-empty sentence"),
])
def test_misuse_is_one_clear_error(kwargs, error, words):
    args = dict(text="a claim", holds=True) | kwargs
    with pytest.raises(error, match=words):
        claim(args.pop("text"), args.pop("holds"), **args)
