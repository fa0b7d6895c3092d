"""Hardware records as JSON (docs/cost_model.md §1) and the checks that run before anything is computed.

A `--config` file is the hardware record with the model's field names, plus an optional
`"settings"` object (see `Settings`). Every check raises one ValueError naming the field and
the range it must be in, so a typo in a custom GPU never turns into a silent nonsense curve.
"""
from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import fields
from pathlib import Path

from helpers.checks import check_that, is_number, shorten
from helpers.hardware import GPU, NetworkLevel, PRESETS

from .settings import Settings, validate_settings

# Price per GPU in USD where a source gives one; other GPUs take the reader's price.
PRICES_USD: dict[str, float] = {
    "GTX 580": 300.0,  # docs/cost_model.md §1 ("Price ≈ $300 per GPU")
}

_NUMBER_FIELDS = ("register_bytes_per_processing_block", "l2_Bps", "l2_bytes", "hbm_Bps",
                  "hbm_bytes", "max_clock_Hz")
# What the search can finish (measured: beyond these it takes minutes and gigabytes).
MAX_LEVELS = 8  # levels in all, the unbounded outermost included
MAX_LEVEL_SIZE = 2**30
MAX_PLACEMENTS = 5000  # placements of the five degrees per layout: 8×32 levels give 4410
# A hardware record is about 1 KiB; a larger file is a mistake (or /dev/zero) and is refused
# unread rather than filling memory.
MAX_CONFIG_BYTES = 1 << 20


def _factorizations5(n: int) -> int:
    """How many ordered 5-way factorizations `n` has: C(e+4, 4) per prime power p^e."""
    count, p = 1, 2
    while p * p <= n:
        e = 0
        while n % p == 0:
            n, e = n // p, e + 1
        count *= math.comb(e + 4, 4)
        p += 1
    return count * (5 if n > 1 else 1)


def _check_search_size(levels) -> None:
    """The search enumerates every split of the five degrees over the inner levels: refuse
    networks whose splits would not fit in memory or finish in minutes."""
    check_that(len(levels) <= MAX_LEVELS, "network_levels", f"at most {MAX_LEVELS} levels",
               f"{len(levels)} levels")
    placements = math.prod(_factorizations5(lv.size) for lv in levels[:-1])
    check_that(placements <= MAX_PLACEMENTS, "network_levels",
               f"levels whose sizes allow at most {MAX_PLACEMENTS} placements per layout "
               "(fewer or smaller levels)", f"sizes {[lv.size for lv in levels[:-1]]}: "
               f"{placements} placements")


def _check_derived(gpu: GPU) -> None:
    """Products of valid fields can still underflow to 0 or overflow to infinity."""
    for name, attr in (("peak FLOP/s", "peak_flops"), ("clock_Hz", "clock_Hz"),
                       ("shared-memory bandwidth", "shared_Bps"),
                       ("bytes per word", "bytes_per_word")):
        try:
            value = getattr(gpu, attr)
        except OverflowError:  # an integer field too large for a float (num_sms = 10**400)
            value = math.inf
        check_that(0 < value < math.inf,
                   "flop_per_clock_per_thread, num_sms, bitwidth, max_clock_Hz and "
                   "effective_utilization", f"such that the {name} is a finite number > 0", value)


def validate_gpu(gpu: GPU) -> GPU:
    """Return `gpu` unchanged if the model can run on it; else raise a ValueError naming
    the field and the range it must be in."""
    check_that(isinstance(gpu.name, str) and gpu.name != "", "name", "a non-empty string", gpu.name)
    check_that(isinstance(gpu.bitwidth, int) and not isinstance(gpu.bitwidth, bool)
               and gpu.bitwidth > 0, "bitwidth", "a positive integer", gpu.bitwidth)
    fpct = gpu.flop_per_clock_per_thread
    check_that(isinstance(fpct, dict) and gpu.bitwidth in fpct, "flop_per_clock_per_thread",
               f"a map with an entry for bitwidth {gpu.bitwidth}", fpct)
    for bits, v in fpct.items():
        check_that(is_number(v) and 0 < v < math.inf, f"flop_per_clock_per_thread[{bits}]",
                   "a finite number > 0 (FLOP/s must be positive)", v)
    check_that(isinstance(gpu.num_sms, int) and not isinstance(gpu.num_sms, bool)
               and gpu.num_sms > 0, "num_sms", "a positive integer", gpu.num_sms)
    for name in _NUMBER_FIELDS:
        v = getattr(gpu, name)
        check_that(is_number(v) and 0 < v < math.inf, name, "a finite number > 0", v)
    check_that(is_number(gpu.effective_utilization) and 0 < gpu.effective_utilization <= 1,
               "effective_utilization", "in (0, 1]", gpu.effective_utilization)
    check_that(isinstance(gpu.distributed_shared_memory, bool), "distributed_shared_memory",
               "true or false", gpu.distributed_shared_memory)
    check_that(is_number(gpu.latency_per_matmul_s) and 0 <= gpu.latency_per_matmul_s < math.inf,
               "latency_per_matmul_s", "a finite number >= 0", gpu.latency_per_matmul_s)
    levels = gpu.network_levels
    check_that(isinstance(levels, tuple) and len(levels) >= 1, "network_levels",
               "a non-empty list of levels, innermost first", levels)
    for k, lv in enumerate(levels):
        where = f"network_levels[{k}]"
        check_that(isinstance(lv, NetworkLevel), where, "a network level", lv)
        check_that(is_number(lv.bandwidth_Bps) and lv.bandwidth_Bps > 0, f"{where}.bandwidth_Bps",
               "a number > 0 (infinity allowed)", lv.bandwidth_Bps)
        check_that(is_number(lv.latency_s) and 0 <= lv.latency_s < math.inf, f"{where}.latency_s",
               "a finite number >= 0", lv.latency_s)
        if k < len(levels) - 1:
            check_that(isinstance(lv.size, int) and not isinstance(lv.size, bool)
                   and 1 <= lv.size <= MAX_LEVEL_SIZE, f"{where}.size",
                   f"an integer in [1, {MAX_LEVEL_SIZE}] (every level but the last has a size)",
                   lv.size)
        else:
            check_that(lv.size is None, f"{where}.size",
                   "absent: the last level is unbounded", lv.size)
    _check_search_size(levels)
    _check_derived(gpu)
    return gpu


def preset(name: str) -> GPU:
    if name not in PRESETS:
        # The name first: a long list would push it past the end of a cut error line.
        raise ValueError(f"preset must be one of these (got {shorten(repr(name))}): "
                         f"{', '.join(PRESETS)}")
    return PRESETS[name]


def gpu_to_json(gpu: GPU) -> dict:
    """The docs/cost_model.md §1 JSON object of a hardware record (bitwidth keys as strings)."""
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


def _parse_int(digits: str):
    """Python refuses to turn more than 4300 digits into an int (the conversion is quadratic).
    Such a number is out of every field's range anyway: read it as the float it rounds to
    (±infinity), so the check of the field it stands in names it."""
    try:
        return int(digits)
    except ValueError:
        return float(digits)


def read_config_text(path: str | Path) -> str:
    """The text of a `--config` file. Anything but a regular file of at most MAX_CONFIG_BYTES
    is refused before it is read: a FIFO would hang, /dev/zero would never end."""
    def refuse_unless_regular(mode: int, size: int) -> None:
        if stat.S_ISDIR(mode):
            raise ValueError(f"config: {shorten(str(path))} is a folder, not a file")
        if not stat.S_ISREG(mode):
            raise ValueError(f"config: {shorten(str(path))} is not a regular file "
                             "(a pipe or a device may never answer or never end)")
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"config: {shorten(str(path))} is larger than {MAX_CONFIG_BYTES} "
                             "bytes; a hardware record is about 1 KiB")

    st = os.stat(path)  # before opening: opening a device can itself have effects
    refuse_unless_regular(st.st_mode, st.st_size)
    # O_NONBLOCK: should a FIFO take the file's place after the stat, opening it cannot hang.
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
        st = os.fstat(f.fileno())  # what was opened, not what was named
        refuse_unless_regular(st.st_mode, st.st_size)
        data = f.read(MAX_CONFIG_BYTES + 1)  # a file still growing stops here
    refuse_unless_regular(stat.S_IFREG, len(data))
    return data.decode("utf-8")


def load_config(path: str | Path) -> tuple[GPU, Settings | None]:
    """Read a `--config` file: the hardware record and, if present, its `settings` section."""
    try:
        data = json.loads(read_config_text(path), parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise ValueError(f"config file is not valid JSON: {e}") from None
    gpu = gpu_from_json(data)
    settings = settings_from_json(data["settings"]) if "settings" in data else None
    return gpu, settings


_SETTINGS_TYPES = {"tokens_per_param": "number", "depth_coef": "number", "depth_exp": "number",
                   "months": "number", "threshold": "number", "price_per_gpu": "number or null",
                   "batch_law": "string", "sparse": "bool", "overlap_tp": "bool",
                   "overlap_pp": "bool", "overlap_dp": "bool", "schedules": "list of strings"}


def _json_type_ok(value, kind: str) -> bool:
    if kind == "number or null":
        return value is None or is_number(value)
    return {"number": is_number, "string": lambda v: isinstance(v, str),
            "bool": lambda v: isinstance(v, bool),
            "list of strings": lambda v: isinstance(v, list) and v != []
            and all(isinstance(x, str) for x in v)}[kind](value)


def settings_from_json(data) -> Settings:
    """The `settings` section of a config file, each field's JSON type checked first (so a
    null, a string where a number belongs or a 400-digit integer is named, not a crash)."""
    check_that(isinstance(data, dict), "settings", "an object of settings", data)
    for name, value in data.items():
        kind = _SETTINGS_TYPES.get(name)
        if kind is not None:
            check_that(_json_type_ok(value, kind), f"settings.{name}", f"a JSON {kind}", value)
    return Settings.from_json(data)


def validate(gpu: GPU, settings: Settings) -> None:
    validate_gpu(gpu)
    validate_settings(settings)
    _check_grid(settings)


def _check_grid(settings: Settings) -> None:
    """The scaling laws must give finite models: a large depth_exp overflows the layer count,
    a huge tokens_per_param the compute."""
    from .scaling import grid
    try:
        models = grid(settings)
    except OverflowError:
        models = None
    check_that(models is not None, "depth_coef and depth_exp",
               "small enough that the layer count of every grid model is finite",
               (settings.depth_coef, settings.depth_exp))
    T = settings.duration_s
    check_that(0 < T < math.inf, "months", "a duration that is finite and > 0 in seconds",
               settings.months)
    for m in models:
        check_that(math.isfinite(m.C) and math.isfinite(m.D), "tokens_per_param",
               "small enough that the training compute of every grid model is finite",
               settings.tokens_per_param)
        # The search looks for the longest step that still finishes in time: it must be > 0.
        check_that(T / (m.D / m.B) > 0, "months and tokens_per_param",
               "such that one training step of every grid model may take more than 0 s",
               (settings.months, settings.tokens_per_param))
