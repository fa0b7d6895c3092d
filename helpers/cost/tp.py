"""When does tensor parallelism pay? Compute vs communication time per layer (notebook 04's widget).

A step of one layer on t ranks costs 6·tokens·h²/t FLOPs of compute (forward 2, backward 4)
plus the layout's collectives under the α–β ring model of notebook 02, on the link a ring of
t ranks crosses: NVLink inside a node, InfiniBand beyond, or this machine's fitted α, β.
Nothing is overlapped, so the sum is an upper bound of what a real step hides.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from helpers.parallel.tp import RING_FACTOR, _check_int, check_config



@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_Bps: float   # per direction, per rank
    latency_s: float       # α: one message


@dataclass(frozen=True)
class Machine:
    """Compute rate and the links a ring of t ranks crosses: `links` is ((size, Link), …),
    innermost first; a ring of t ranks runs at the speed of the first level holding t."""
    name: str
    flops: float
    bytes_per_element: int
    links: tuple


def h100_links() -> tuple[Link, Link]:
    """NVLink and InfiniBand per direction, from helpers.hardware.HIERARCHY (cited there)."""
    levels = {lv.name.split(" (")[0]: lv for lv in _hierarchy()["H100 SXM"]}
    nvlink, ib = levels["NVLink 4"], levels["InfiniBand NDR"]
    return (Link("NVLink 4", nvlink.bandwidth_Bps, nvlink.latency_s),
            Link("InfiniBand NDR", ib.bandwidth_Bps, ib.latency_s))


def _hierarchy():
    from helpers.hardware import HIERARCHY
    return HIERARCHY


def load_fit(path: Path | str | None = None) -> dict | None:
    """Notebook 02's all-reduce α–β fit of this machine, or None if it has not been run here."""
    from helpers.cost import alpha_beta
    record = alpha_beta.load_fit(path)
    fit = (record or {}).get("fit", {}).get("all_reduce")
    if not fit:
        return None
    return {"backend": record.get("backend"), "world_size": record.get("world_size"),
            "cores_per_rank": record.get("cores_per_rank"),
            "alpha_s": float(fit["alpha_s"]), "beta_s_per_byte": float(fit["beta_s_per_byte"])}


def machines(fit: dict | None = None, cpu_flops: float | None = None) -> dict[str, Machine]:
    """The widget's choices. H100 compute: dense bf16 peak (helpers.hardware.ROOFLINE_PEAKS).
    'this machine' appears only with notebook 02's fit and a measured FLOP/s (fp32)."""
    from helpers.hardware import H100_SXM, ROOFLINE_PEAKS
    peak = ROOFLINE_PEAKS["H100 SXM"][0]
    node = H100_SXM.network_levels[0].size  # 8 GPUs per node
    nvlink, ib = h100_links()
    out = {
        f"H100: NVLink inside a node of {node}, InfiniBand beyond":
            Machine("H100 cluster", peak, 2, ((node, nvlink), (None, ib))),
        "H100: InfiniBand only (one GPU per node)": Machine("H100 + IB", peak, 2, ((None, ib),)),
        "H100: NVLink at every size (hypothetical)": Machine("H100 + NVLink", peak, 2,
                                                             ((None, nvlink),)),
    }
    if fit is not None and cpu_flops:
        link = Link(f"{fit['backend']} (fitted, {fit['cores_per_rank']} core(s)/rank)",
                    1 / fit["beta_s_per_byte"], fit["alpha_s"])
        out["this machine: gloo fit from notebook 02"] = Machine("this machine", cpu_flops, 4,
                                                                 ((None, link),))
    return out


def link_for(machine: Machine, t: int) -> Link:
    for size, link in machine.links:
        if size is None or t <= size:
            return link
    raise ValueError(f"no link level of {machine.name} holds t={t}")


# Collectives per layer per training step (forward + backward), from formula_collectives.
_PER_LAYER = {"lecture": {"all_gather": 1, "all_reduce": 1},
              "megatron": {"all_reduce": 1},
              "sequence": {"all_gather": 1, "reduce_scatter": 1}}
_LATENCY_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}  # × (t−1) α


def layer_times(t: int, hidden: int, machine: Machine, tokens: int = 128,
                layout: str = "megatron") -> dict:
    """Seconds per layer per training step on one rank: compute (6·tokens·h²/t FLOP: forward 2,
    backward 4) and communication (α–β ring model of that layout's collectives). Nothing is
    overlapped: Megatron's all-reduces sit on the critical path."""
    check_config(t, hidden, layout=layout, batch=t if layout == "sequence" else 1)
    _check_int("tokens", tokens)
    compute = 6 * tokens * hidden**2 / t / machine.flops
    link = link_for(machine, t)
    n = tokens * hidden * machine.bytes_per_element
    comm = 0.0
    for op, calls in _PER_LAYER[layout].items():
        comm += calls * (_LATENCY_STEPS[op] * (t - 1) * link.latency_s
                         + RING_FACTOR[op](t) * n / link.bandwidth_Bps)
    return {"t": t, "compute_s": compute, "comm_s": comm, "step_s": compute + comm,
            "link": link.name if t > 1 else "none"}


def tp_curve(hidden: int, machine: Machine, tokens: int = 128, layout: str = "megatron",
             ts: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> list[dict]:
    """layer_times for each t that divides hidden, with speedup over t = 1."""
    rows = [layer_times(t, hidden, machine, tokens, layout) for t in ts if hidden % t == 0]
    base = rows[0]["step_s"]
    for row in rows:
        row["speedup"] = base / row["step_s"]
    return rows


def best_t(rows: list[dict]) -> int:
    """The t with the shortest step: beyond it, TP stops paying."""
    return min(rows, key=lambda r: r["step_s"])["t"]


def describe(t: int, hidden: int, machine: Machine, tokens: int = 128) -> str:
    """The widget's text: this t's split, and where TP stops paying for this machine."""
    from helpers.timing import format_seconds
    rows = tp_curve(hidden, machine, tokens)
    row = next((r for r in rows if r["t"] == t), None)
    if row is None:
        return f"t={t} does not divide h={hidden}: pick another t"
    share = row["comm_s"] / row["step_s"]
    best = best_t(rows)
    if best == 1:
        verdict = "TP never pays here: even at t=2 the all-reduce costs more than the compute it saves."
    elif best == rows[-1]["t"]:
        verdict = f"Still getting faster at t={best}, the largest t shown."
    else:
        verdict = (f"Fastest at t={best}; beyond it the all-reduce costs more than the compute "
                   f"it saves (link there: {next(r for r in rows if r['t'] == best)['link']}).")
    return (f"t={t}, h={hidden}, b·s={tokens}, link {row['link']}: compute "
            f"{format_seconds(row['compute_s'])} + communication {format_seconds(row['comm_s'])} "
            f"per layer ({share:.0%} communication); speedup over t=1: {row['speedup']:.2f}×.\n"
            + verdict)


def plot_curve(hidden: int, machine: Machine, tokens: int = 128, t: int | None = None, ax=None):
    """Compute and communication time per layer against t (log-log), the chosen t marked."""
    import matplotlib.pyplot as plt
    rows = tp_curve(hidden, machine, tokens)
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.6))
    ts = [r["t"] for r in rows]
    ax.plot(ts, [r["compute_s"] * 1e6 for r in rows], "o-", label="compute / rank")
    ax.plot(ts[1:], [r["comm_s"] * 1e6 for r in rows[1:]], "s-", label="communication / rank")
    ax.plot(ts, [r["step_s"] * 1e6 for r in rows], "k--", lw=1, label="step (no overlap)")
    node = machine.links[0][0]
    if node is not None:  # shade the t that fit on the innermost (fastest) link
        ax.axvspan(1, node, color="C2", alpha=0.08, label=f"{machine.links[0][1].name}, t ≤ {node}")
    ax.axvline(best_t(rows), color="grey", lw=0.8, ls=":", label=f"fastest t = {best_t(rows)}")
    if t is not None:
        ax.axvline(t, color="C3", lw=1.5, alpha=0.5, label=f"t = {t}")
    ax.set(xscale="log", yscale="log", xlabel="tensor degree t", ylabel="µs per layer per step",
           title=f"{machine.name}: h = {hidden}, b·s = {tokens}")
    ax.set_xticks(ts, [str(v) for v in ts])
    ax.legend(fontsize=8)
    return ax


def measure_cpu_flops(hidden: int = 1024, tokens: int = 512,
                      threads: float | None = None) -> float:
    """fp32 matmul FLOP/s of this process (threads as notebook 02's ranks had), median of 5.

    `threads` may be a fraction (4 ranks on 2 cores have 0.5 core each); a process runs at
    least one thread, so it is rounded and floored at 1.
    """
    from helpers.timing import measure
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(max(1, round(threads)))
    try:
        a, w = torch.randn(tokens, hidden), torch.randn(hidden, hidden)
        m = measure(lambda: a @ w, "matmul", repeat=5, warmup=2)
    finally:
        torch.set_num_threads(previous)
    return 2 * tokens * hidden**2 / m.median


T_OPTIONS = (1, 2, 4, 8, 16, 32, 64)
HIDDEN_OPTIONS = tuple(2**k for k in range(8, 16))   # 256 … 32768
TOKEN_OPTIONS = tuple(2**k for k in range(7, 17))    # 128 … 65536 (b·s)


def show_choice(choices: dict[str, Machine], t: int, hidden: int, tokens: int, machine: str):
    """The widget's callback: the curve and its sentence for one setting of the sliders."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    plot_curve(hidden, choices[machine], tokens, t, ax=ax)
    plt.show()
    text = describe(t, hidden, choices[machine], tokens)
    print(text)
    return text


def widget(choices: dict[str, Machine], t: int = 4, hidden: int = 1024, tokens: int = 128):
    """Sliders for t, h and b·s, and a link menu, over `show_choice`."""
    import ipywidgets as w

    def show(t, hidden, tokens, machine):
        show_choice(choices, t, hidden, tokens, machine)

    return w.interactive(
        show,
        t=w.SelectionSlider(options=T_OPTIONS, value=t, description="t"),
        hidden=w.SelectionSlider(options=HIDDEN_OPTIONS, value=hidden, description="h"),
        tokens=w.SelectionSlider(options=TOKEN_OPTIONS, value=tokens, description="b·s"),
        machine=w.Dropdown(options=list(choices), description="link",
                           layout=w.Layout(width="520px")))
