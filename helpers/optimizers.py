"""The course's optimizers in one table, and the step sizes its checks train with.

Every run that trains (03's wrappers, 07's layouts, 08's ZeRO stages) is checked against one
process with `assert_close`, and the step size decides what such a check can see. Two settings:

* "visible": steps large enough that the weights move visibly in three steps (the lecture's
  loss is small, ~0.01, so SGD takes lr = 10): a wrong average then lands far outside
  assert_close's tolerance. Notebooks 03-07.
* "exact": AdamW takes steps of about lr whatever the gradient's size, so an element whose
  gradient is near zero moves by ±lr on rounding alone: lr = 1e-3 keeps that inside
  assert_close's 1e-5 after 3 steps. Adam is blind to a gradient's scale (a sum where a mean
  belongs trains the same), so those checks also run plain SGD, which is not. Notebook 08.
"""
from __future__ import annotations

import torch

from helpers.checks import check_choice

OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
SETTINGS = {
    "visible": {"sgd": {"lr": 10.0, "momentum": 0.9}, "adamw": {"lr": 1e-2}},
    "exact": {"sgd": {"lr": 0.5}, "adamw": {"lr": 1e-3}},
}


def optimizer_spec(name: str, setting: str = "visible",
                   lr: float | None = None) -> tuple[type[torch.optim.Optimizer], dict]:
    """The class and keyword arguments of optimizer `name` under `setting`; `lr` overrides."""
    check_choice("optimizer", name, OPTIMIZERS)
    options = dict(SETTINGS[check_choice("setting", setting, SETTINGS)][name])
    if lr is not None:
        options["lr"] = lr
    return OPTIMIZERS[name], options


def make_optimizer(name: str, params, lr: float | None = None,
                   setting: str = "visible") -> torch.optim.Optimizer:
    """Optimizer `name` over `params` with `setting`'s hyperparameters (or another `lr`)."""
    cls, options = optimizer_spec(name, setting, lr)
    return cls(params, **options)
