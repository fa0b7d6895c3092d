"""Notebook 00's table: memory and network levels, small-and-fast to large-and-slow, in words.

The same levels as a picture: `helpers.views.hardware.plot_hierarchy`.
"""
from __future__ import annotations

from helpers.checks import check_choice
from helpers.hardware import HIERARCHY, Level


def capacity_text(x: float | None) -> str:
    if x is None:
        return "—"
    for unit, scale in (("GB", 1e9), ("MiB", 1024**2), ("KiB", 1024)):
        if x >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x:.0f} B"


def rate_text(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x / 1e9:,.0f} GB/s" if x >= 1e11 else f"{x / 1e9:.3g} GB/s"


def latency_text(x: float | None) -> str:
    if x is None:
        return "—"
    return f"~{x * 1e9:.0f} ns" if x < 1e-6 else f"~{x * 1e6:.3g} µs"


def table(gpu: str) -> str:
    """A plain-text table of one GPU's hierarchy (bandwidth per direction, GB = 1e9 B)."""
    rows = [("level", "capacity", "bandwidth / direction", "latency")]
    rows += [(lv.name, capacity_text(lv.capacity_bytes), rate_text(lv.bandwidth_Bps), latency_text(lv.latency_s))
             for lv in HIERARCHY[gpu]]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return f"{gpu}\n" + "\n".join(lines)


def sources(gpu: str) -> str:
    return "\n".join(f"- {lv.name}: {lv.source}" for lv in HIERARCHY[gpu])


def level(gpu: str, prefix: str) -> Level:
    """The level of `gpu` whose name starts with `prefix` (e.g. "NVLink")."""
    check_choice("gpu", gpu, HIERARCHY)
    found = [lv for lv in HIERARCHY[gpu] if lv.name.startswith(prefix)]
    if not found:
        raise ValueError(f"prefix must start one of {[lv.name for lv in HIERARCHY[gpu]]}, "
                         f"got {prefix!r}")
    return found[0]


def ratio(gpu: str, faster: str, slower: str) -> float:
    """How many times more bandwidth level `faster` has than level `slower` (name prefixes)."""
    return level(gpu, faster).bandwidth_Bps / level(gpu, slower).bandwidth_Bps


def topo_text(sample=None) -> str:
    """`nvidia-smi topo -m`'s matrix for a cited sample node (helpers.hardware.TOPO_H100):
    GPU to GPU, GPU to NIC, and each GPU's CPU cores and NUMA node, then the command's legend."""
    from helpers.hardware import TOPO_H100
    sample = sample or TOPO_H100
    n, nics = sample.gpus, len(sample.nic_links[0])
    header = ([f"GPU{j}" for j in range(n)] + [f"NIC{k + 1}" for k in range(nics)]
              + ["CPU Affinity", "NUMA Affinity"])
    rows = [[""] + header]
    for i in range(n):
        links = ["X" if i == j else sample.gpu_link for j in range(n)]
        rows.append([f"GPU{i}"] + links + list(sample.nic_links[i])
                    + [sample.cpu_affinity[i], str(sample.numa_affinity[i])])
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    legend = [f"  {key:<4} = {meaning}" for key, meaning in sample.legend]
    return "\n".join(lines + ["", "Legend:", ""] + legend)
