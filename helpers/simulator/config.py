"""Hardware records as JSON (spec §1) and the checks that run before anything is computed.

A `--config` file is the hardware record with the spec's field names, plus an optional
`"settings"` object (see `Settings`). Every check raises one ValueError naming the field and
the range it must be in, so a typo in a custom GPU never turns into a silent nonsense curve.
"""
from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

from helpers.hardware import GPU, NetworkLevel, PRESETS

from .settings import Settings, validate_settings

# Price per GPU in USD where a source gives one; other GPUs take the reader's price.
PRICES_USD: dict[str, float] = {
    "GTX 580": 300.0,  # cost_model.md §1 ("Price ≈ $300 per GPU")
}

_NUMBER_FIELDS = ("register_bytes_per_processing_block", "l2_Bps", "l2_bytes", "hbm_Bps",
                  "hbm_bytes", "max_clock_Hz")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _check(cond: bool, field: str, allowed: str, value) -> None:
    if not cond:
        raise ValueError(f"{field} must be {allowed} (got {value!r})")


def validate_gpu(gpu: GPU) -> GPU:
    """Return `gpu` unchanged if the model can run on it; else raise a ValueError naming
    the field and the range it must be in."""
    _check(isinstance(gpu.name, str) and gpu.name != "", "name", "a non-empty string", gpu.name)
    _check(isinstance(gpu.bitwidth, int) and not isinstance(gpu.bitwidth, bool)
           and gpu.bitwidth > 0, "bitwidth", "a positive integer", gpu.bitwidth)
    fpct = gpu.flop_per_clock_per_thread
    _check(isinstance(fpct, dict) and gpu.bitwidth in fpct, "flop_per_clock_per_thread",
           f"a map with an entry for bitwidth {gpu.bitwidth}", fpct)
    for bits, v in fpct.items():
        _check(_is_number(v) and 0 < v < math.inf, f"flop_per_clock_per_thread[{bits}]",
               "a finite number > 0 (FLOP/s must be positive)", v)
    _check(isinstance(gpu.num_sms, int) and not isinstance(gpu.num_sms, bool)
           and gpu.num_sms > 0, "num_sms", "a positive integer", gpu.num_sms)
    for name in _NUMBER_FIELDS:
        v = getattr(gpu, name)
        _check(_is_number(v) and 0 < v < math.inf, name, "a finite number > 0", v)
    _check(_is_number(gpu.effective_utilization) and 0 < gpu.effective_utilization <= 1,
           "effective_utilization", "in (0, 1]", gpu.effective_utilization)
    _check(isinstance(gpu.distributed_shared_memory, bool), "distributed_shared_memory",
           "true or false", gpu.distributed_shared_memory)
    _check(_is_number(gpu.latency_per_matmul_s) and 0 <= gpu.latency_per_matmul_s < math.inf,
           "latency_per_matmul_s", "a finite number >= 0", gpu.latency_per_matmul_s)
    levels = gpu.network_levels
    _check(isinstance(levels, tuple) and len(levels) >= 1, "network_levels",
           "a non-empty list of levels, innermost first", levels)
    for k, lv in enumerate(levels):
        where = f"network_levels[{k}]"
        _check(isinstance(lv, NetworkLevel), where, "a network level", lv)
        _check(_is_number(lv.bandwidth_Bps) and lv.bandwidth_Bps > 0, f"{where}.bandwidth_Bps",
               "a number > 0 (infinity allowed)", lv.bandwidth_Bps)
        _check(_is_number(lv.latency_s) and 0 <= lv.latency_s < math.inf, f"{where}.latency_s",
               "a finite number >= 0", lv.latency_s)
        if k < len(levels) - 1:
            _check(isinstance(lv.size, int) and not isinstance(lv.size, bool) and lv.size >= 1,
                   f"{where}.size", "an integer >= 1 (every level but the last has a size)",
                   lv.size)
        else:
            _check(lv.size is None, f"{where}.size",
                   "absent: the last level is unbounded", lv.size)
    return gpu


def preset(name: str) -> GPU:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)} (got {name!r})")
    return PRESETS[name]


def gpu_to_json(gpu: GPU) -> dict:
    """The spec §1 JSON object of a hardware record (bitwidth keys as strings)."""
    out = {f.name: getattr(gpu, f.name) for f in fields(GPU) if f.name != "network_levels"}
    out["flop_per_clock_per_thread"] = {str(k): v for k, v in gpu.flop_per_clock_per_thread.items()}
    out["network_levels"] = [
        {"bandwidth_Bps": lv.bandwidth_Bps, "latency_s": lv.latency_s,
         **({"size": lv.size} if lv.size is not None else {})}
        for lv in gpu.network_levels]
    return out


def gpu_from_json(data: dict) -> GPU:
    """Build and validate a GPU from its JSON object; unknown or missing fields are errors."""
    if not isinstance(data, dict):
        raise ValueError(f"hardware record must be a JSON object (got {type(data).__name__})")
    names = [f.name for f in fields(GPU)]
    missing = [n for n in names if n not in data]
    if missing:
        raise ValueError(f"{missing[0]} is required in a hardware record "
                         f"(fields: {', '.join(names)})")
    unknown = sorted(set(data) - set(names) - {"settings"})
    if unknown:
        raise ValueError(f"{unknown[0]} is not a hardware field (fields: {', '.join(names)})")
    fpct = data["flop_per_clock_per_thread"]
    if not isinstance(fpct, dict):
        raise ValueError("flop_per_clock_per_thread must be a map bitwidth → value "
                         f"(got {fpct!r})")
    try:
        fpct = {int(k): v for k, v in fpct.items()}
    except ValueError:
        raise ValueError("flop_per_clock_per_thread keys must be bitwidths such as \"16\" "
                         f"(got {list(fpct)})") from None
    levels = data["network_levels"]
    if not isinstance(levels, list):
        raise ValueError(f"network_levels must be a list of levels (got {levels!r})")
    built = []
    for k, lv in enumerate(levels):
        if not isinstance(lv, dict) or not {"bandwidth_Bps", "latency_s"} <= set(lv) \
                or not set(lv) <= {"bandwidth_Bps", "latency_s", "size"}:
            raise ValueError(f"network_levels[{k}] must be an object with bandwidth_Bps, "
                             f"latency_s and (except the last) size (got {lv!r})")
        bw = lv["bandwidth_Bps"]
        if bw in ("Infinity", "inf"):  # how the simulator's own JSON output writes ∞
            bw = math.inf
        built.append(NetworkLevel(bw, lv["latency_s"], lv.get("size")))
    kwargs = {n: data[n] for n in names}
    kwargs["flop_per_clock_per_thread"] = fpct
    kwargs["network_levels"] = tuple(built)
    return validate_gpu(GPU(**kwargs))


def load_config(path: str | Path) -> tuple[GPU, Settings | None]:
    """Read a `--config` file: the hardware record and, if present, its `settings` section."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"config file is not valid JSON: {e}") from None
    gpu = gpu_from_json(data)
    settings = Settings.from_json(data["settings"]) if "settings" in data else None
    return gpu, settings


def validate(gpu: GPU, settings: Settings) -> None:
    validate_gpu(gpu)
    validate_settings(settings)
