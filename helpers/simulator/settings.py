"""What a configuration assumes besides the GPU: scaling laws, schedules, overlap, duration.

Defaults are the model's (docs/cost_model.md §3, §5–§7). `validate_settings` rejects anything the
model cannot run with one ValueError naming the field and its allowed range.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from helpers.checks import check_that, is_number

BATCH_LAWS = ("default", "none", "deepseek")
SCHEDULES = ("1f1b", "interleaved", "zero_bubble")
SECONDS_PER_YEAR = 3.154e7


@dataclass(frozen=True)
class Settings:
    # Scaling laws (§3).
    tokens_per_param: float = 20
    batch_law: str = "default"
    depth_coef: float = 0.10056
    depth_exp: float = 0.3751
    sparse: bool = False
    # Parallelism and overlap (§5, §6). "interleaved" is 1F1B with v = L/PP; "1f1b" is v = 1.
    schedules: tuple[str, ...] = ("interleaved", "zero_bubble")
    overlap_tp: bool = True
    overlap_pp: bool = True
    overlap_dp: bool = False
    # The question asked of the curve (§6, §7).
    months: float = 3
    threshold: float = 0.8
    price_per_gpu: float | None = None

    @property
    def duration_s(self) -> float:
        return self.months / 12 * SECONDS_PER_YEAR

    def to_json(self) -> dict:
        out = asdict(self)
        out["schedules"] = list(self.schedules)
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Settings":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"settings: unknown field(s) {unknown}; allowed: {sorted(known)}")
        data = dict(data)
        if "schedules" in data and isinstance(data["schedules"], list):
            data["schedules"] = tuple(data["schedules"])
        return validate_settings(cls(**data))


def validate_settings(s: Settings) -> Settings:
    """Return `s` unchanged if the model can run with it; else raise a ValueError naming
    the field and the range it must be in."""
    for name in ("tokens_per_param", "depth_coef", "depth_exp", "months"):
        value = getattr(s, name)
        check_that(is_number(value) and 0 < value < math.inf, name, "a finite number > 0", value)
    check_that(s.batch_law in BATCH_LAWS, "batch_law", f"one of {', '.join(BATCH_LAWS)}",
               s.batch_law)
    for name in ("sparse", "overlap_tp", "overlap_pp", "overlap_dp"):
        check_that(isinstance(getattr(s, name), bool), name, "true or false", getattr(s, name))
    check_that(bool(s.schedules) and all(x in SCHEDULES for x in s.schedules), "schedules",
               f"a non-empty subset of {', '.join(SCHEDULES)}", s.schedules)
    check_that(is_number(s.threshold) and 0 < s.threshold <= 1, "threshold", "in (0, 1]",
               s.threshold)
    p = s.price_per_gpu
    check_that(p is None or (is_number(p) and 0 <= p < math.inf), "price_per_gpu",
               "a finite number >= 0 or null", p)
    return s
