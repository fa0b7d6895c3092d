"""What notebook 06's app simulates, before anything is run or drawn: a configuration
(scaling laws + GPU + parallelism settings), the ones the app starts with, the GPU as the
app's two what-if sliders scale it, and the add-configuration form's values: which fields it
shows in which units, a configuration as plain values, and those values back to a validated
configuration. Pure: no widgets here (the form's controls are in app.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from helpers.hardware import GPU, GTX_580, H100_SXM, NetworkLevel
from helpers.units import KiB, MiB
from helpers.simulator.config import PRICES_USD, gpu_to_json, validate_gpu
from helpers.simulator.settings import Settings, validate_settings


@dataclass
class Configuration:
    """What Epoch's tool calls a configuration: scaling laws + GPU + parallelism assumptions."""

    name: str
    gpu: GPU
    settings: Settings
    included: bool = True


def default_configurations() -> list[Configuration]:
    return [
        Configuration("H100 SXM dense", H100_SXM, Settings()),
        Configuration("H100 SXM sparse (MoE)", H100_SXM, Settings(sparse=True)),
        Configuration("GTX 580 dense", GTX_580, Settings(price_per_gpu=PRICES_USD["GTX 580"])),
    ]


def scaled_gpu(gpu: GPU, latency: float = 1.0, bandwidth: float = 1.0) -> GPU:
    """The GPU with every latency (matmul and network) × `latency` and every network
    bandwidth × `bandwidth`: the app's two what-if sliders."""
    if latency == 1 and bandwidth == 1:
        return gpu
    return replace(gpu, latency_per_matmul_s=gpu.latency_per_matmul_s * latency,
                   network_levels=tuple(replace(lv, bandwidth_Bps=lv.bandwidth_Bps * bandwidth,
                                                latency_s=lv.latency_s * latency)
                                        for lv in gpu.network_levels))


# --- the add-configuration form: values → Configuration ---------------------------------

# (field, label, unit, scale, kind): the GPU record's fields, as the form shows them. A value
# in the form times `scale` is the record's value in SI units (bytes, B/s, Hz, s).
GPU_FIELDS = (
    ("bitwidth", "bits per number (training precision)", "bits", 1, int),
    ("fpct", "FLOP per clock per thread at that precision", "", 1, float),
    ("register_bytes_per_processing_block", "register file per processing block", "KiB",
     KiB, float),
    ("num_sms", "streaming multiprocessors (SMs)", "", 1, int),
    ("l2_Bps", "L2 cache bandwidth", "TB/s", 1e12, float),
    ("l2_bytes", "L2 cache size", "MiB", MiB, float),
    ("hbm_Bps", "memory (HBM) bandwidth", "TB/s", 1e12, float),
    ("hbm_bytes", "memory (HBM) size", "GB", 1e9, float),
    ("max_clock_Hz", "max clock", "MHz", 1e6, float),
    ("effective_utilization", "effective utilization (the MFU ceiling)", "", 1, float),
    ("latency_per_matmul_s", "fixed latency per matmul", "µs", 1e-6, float),
)
LEVEL_FIELDS = (("bandwidth_Bps", "bandwidth per GPU, both directions", "GB/s", 1e9),
                ("latency_s", "latency", "µs", 1e-6), ("size", "GPUs in the level", "", 1))


# The settings' fields, as the form names them (no units)
SETTING_LABELS = {"tokens_per_param": "training tokens per parameter",
                  "batch_law": "batch-size law", "depth_coef": "depth law: coefficient",
                  "depth_exp": "depth law: exponent", "schedules": "pipeline schedules",
                  "price_per_gpu": "price per GPU (USD)"}
# Which record fields the combined checks of validate_gpu name
_DERIVED = "flop_per_clock_per_thread, num_sms, bitwidth, max_clock_Hz and effective_utilization"
_FIELD_ERROR = re.compile(r"^(?:network_levels\[(\d+)\]\.)?([\w\[\]]+) must be (.*?)(?:, got (.*))?$",
                          re.S)


def form_message(error: ValueError) -> str:
    """A validation error of the record or the settings in the form's own words: the field's
    label for its code name, the value in the field's unit (bytes in GB, B/s in GB/s …)."""
    text = str(error)
    if text.startswith(_DERIVED):
        labels = [label for f, label, *_ in GPU_FIELDS
                  if f in ("fpct", "num_sms", "bitwidth", "max_clock_Hz", "effective_utilization")]
        return f"{', '.join(labels[:-1])} and {labels[-1]}" + text[len(_DERIVED):]
    found = _FIELD_ERROR.match(text)
    if not found:
        return text
    level, field, allowed, got = found.groups()
    field = "fpct" if field.startswith("flop_per_clock_per_thread") else field
    if level is not None:
        label, unit, scale = next((f"network level {int(level) + 1}: {label}", unit, scale)
                                  for f, label, unit, scale in LEVEL_FIELDS if f == field)
    elif field in SETTING_LABELS:
        label, unit, scale = SETTING_LABELS[field], "", 1
    else:
        known = {f: (label, unit, scale) for f, label, unit, scale, _ in GPU_FIELDS}
        if field not in known:
            return text
        label, unit, scale = known[field]
    if got is not None and unit:
        try:
            got = f"{float(got) / scale:g} {unit}"
        except ValueError:
            pass
    allowed = allowed.replace(" or null", " or empty")  # JSON's word; the form's box is empty
    return f"{label} must be {allowed}" + ("" if got is None else f", got {got}")


def to_form_units(value: float, scale: float) -> float:
    """A record value in the form's unit, rounded to 12 significant digits (no 0.30000004)."""
    return float(f"{value / scale:.12g}")


def from_form_units(value: float, scale: float) -> float:
    return float(f"{value * scale:.12g}")


def form_values(name: str, gpu: GPU, settings: Settings) -> dict:
    """A configuration as plain values in SI units (to prefill the form from a preset)."""
    values = {f: getattr(gpu, f) for f, *_ in GPU_FIELDS if f != "fpct"}
    values.update(name=name, fpct=gpu.flop_per_clock_per_thread[gpu.bitwidth],
                  distributed_shared_memory=gpu.distributed_shared_memory,
                  levels=[{"bandwidth_Bps": lv.bandwidth_Bps, "latency_s": lv.latency_s,
                           "size": lv.size} for lv in gpu.network_levels],
                  price_per_gpu=settings.price_per_gpu, **{
                      k: getattr(settings, k) for k in (
                          "tokens_per_param", "batch_law", "depth_coef", "depth_exp", "sparse",
                          "overlap_tp", "overlap_pp", "overlap_dp")},
                  schedules=list(settings.schedules))
    return values


def configuration_from_form(values: dict) -> Configuration:
    """Build and validate a configuration; ValueError names the first field that cannot work."""
    levels = values["levels"]
    gpu = GPU(
        name=values["name"] or "custom GPU", bitwidth=values["bitwidth"],
        flop_per_clock_per_thread={values["bitwidth"]: values["fpct"]},
        register_bytes_per_processing_block=values["register_bytes_per_processing_block"],
        num_sms=values["num_sms"], l2_Bps=values["l2_Bps"], l2_bytes=values["l2_bytes"],
        hbm_Bps=values["hbm_Bps"], hbm_bytes=values["hbm_bytes"],
        max_clock_Hz=values["max_clock_Hz"],
        effective_utilization=values["effective_utilization"],
        distributed_shared_memory=values["distributed_shared_memory"],
        latency_per_matmul_s=values["latency_per_matmul_s"],
        network_levels=tuple(NetworkLevel(lv["bandwidth_Bps"], lv["latency_s"],
                                          lv["size"] if k < len(levels) - 1 else None)
                             for k, lv in enumerate(levels)))
    validate_gpu(gpu)
    settings = validate_settings(Settings(
        tokens_per_param=values["tokens_per_param"], batch_law=values["batch_law"],
        depth_coef=values["depth_coef"], depth_exp=values["depth_exp"],
        sparse=values["sparse"], schedules=tuple(values["schedules"]),
        overlap_tp=values["overlap_tp"], overlap_pp=values["overlap_pp"],
        overlap_dp=values["overlap_dp"], price_per_gpu=values["price_per_gpu"]))
    return Configuration(values["name"] or gpu.name, gpu, settings)


def same_configuration(a: Configuration, b: Configuration) -> bool:
    """Same hardware record (all but the name) and same settings: the same curve."""
    return (gpu_to_json(replace(a.gpu, name="")) == gpu_to_json(replace(b.gpu, name=""))
            and a.settings == b.settings)
