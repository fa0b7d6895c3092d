"""What a configuration assumes besides the GPU: scaling laws, schedules, overlap, duration.

Defaults are the model's (docs/cost_model.md §3, §5–§7). `validate_settings` rejects anything the
model cannot run with one ValueError naming the field and its allowed range.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

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


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number > 0 (got {value!r})")


def validate_settings(s: Settings) -> Settings:
    """Return `s` unchanged if the model can run with it; else raise a ValueError naming
    the field and the range it must be in."""
    _positive("tokens_per_param", s.tokens_per_param)
    if s.batch_law not in BATCH_LAWS:
        raise ValueError(f"batch_law must be one of {', '.join(BATCH_LAWS)} (got {s.batch_law!r})")
    _positive("depth_coef", s.depth_coef)
    _positive("depth_exp", s.depth_exp)
    if not isinstance(s.sparse, bool):
        raise ValueError(f"sparse must be true or false (got {s.sparse!r})")
    if not s.schedules or any(x not in SCHEDULES for x in s.schedules):
        raise ValueError(f"schedules must be a non-empty subset of {', '.join(SCHEDULES)} "
                         f"(got {s.schedules!r})")
    for name in ("overlap_tp", "overlap_pp", "overlap_dp"):
        if not isinstance(getattr(s, name), bool):
            raise ValueError(f"{name} must be true or false (got {getattr(s, name)!r})")
    _positive("months", s.months)
    t = s.threshold
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
        raise ValueError(f"threshold must be in (0, 1] (got {t!r})")
    p = s.price_per_gpu
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                          or not 0 <= p < math.inf):
        raise ValueError(f"price_per_gpu must be a finite number >= 0 or null (got {p!r})")
    return s
