"""Notebook 09's expert pictures: the per-expert, per-rank token load of a router, kept and
dropped, and the widget that moves the router (top-k, capacity factor, skew, seed). `plot_*`
returns a Figure, `widget_*` a widget; `load_outputs` is what the widget shows."""
from __future__ import annotations

import ipywidgets as W
from matplotlib.figure import Figure

from helpers.configs import MOE, MoEConfig
from helpers.labs.experts import RouterLoad, router_load
from helpers.views.kit import aligned, png_output, previewed, text_output

CAPACITY_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


def plot_token_load(load: RouterLoad, title: str = "") -> Figure:
    """Token slots per expert: kept (coloured by the rank that holds the expert) and dropped
    (hatched, above); the dashed line is what an expert can take (e groups × capacity), at
    most `capacity` from each rank's group, so a bar below it may still show drops."""
    fig = Figure(figsize=(7.5, 3.4), layout="constrained")
    ax = fig.subplots()
    experts = len(load.kept)
    local = experts // load.e
    colors = [f"C{i // local}" for i in range(experts)]
    ax.bar(range(experts), load.kept, color=colors, label="kept (colour: the rank holding the expert)")
    ax.bar(range(experts), load.dropped, bottom=load.kept, color="white", edgecolor="C3",
           hatch="//", label="dropped")
    limit = load.e * load.capacity
    ax.axhline(limit, color="0.3", ls="--", lw=1,
               label=f"capacity {load.e} × {load.capacity}: at most {load.capacity} "
                     f"from each of the {load.e} ranks")
    ax.set_xticks(range(experts), [f"expert {i}\nrank {i // local}" for i in range(experts)],
                  fontsize=8)
    ax.set(ylabel="token slots", ylim=(0, max(limit, max(a + b for a, b in zip(load.kept, load.dropped))) * 1.25))
    per_rank = ", ".join(str(n) for n in load.per_rank)
    ax.set_title(title or f"rows per rank {per_rank}; dropped {sum(load.dropped)}; "
                 f"aux loss {load.aux_loss:.3f}", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    return fig


def load_outputs(top_k: int, capacity_factor: float, skew: float, seed: int, e: int = 4,
                 config: MoEConfig = MOE) -> tuple[dict, dict]:
    """What the widget shows for these settings: the router's load pictured, and a line saying
    what it shows (two outputs for an Output widget)."""
    load = router_load(config.with_(top_k=top_k, capacity_factor=capacity_factor, skew=skew,
                                    seed=seed), e)
    slots = sum(load.kept) + sum(load.dropped)
    busiest = max(load.per_rank)
    line = (f"{slots} token slots; {sum(load.dropped)} dropped ({sum(load.dropped) / slots:.0%}); "
            f"the busiest rank computes {busiest} rows, {busiest / (sum(load.kept) / e):.2f}× the mean")
    return png_output(plot_token_load(load)), text_output(line)


def widget_experts(e: int = 4, config: MoEConfig = MOE) -> W.VBox:
    """Top-k, capacity factor, router skew and seed; acts on release, redraws into its Output."""
    # one column: every description 300 px (the skew's, the longest, in full), every track
    # the same length
    common = dict(continuous_update=False, style=aligned(300), layout=W.Layout(width="620px"))
    top_k = W.ToggleButtons(options=[("top-1", 1), ("top-2", 2)], value=config.top_k,
                            description="experts per token (k)", style=aligned(300))
    factor = W.SelectionSlider(options=CAPACITY_FACTORS, value=1.25,
                               description="capacity factor (× balanced share)", **common)
    skew = W.FloatSlider(value=0.0, min=0.0, max=3.0, step=0.25,
                         description="router skew toward expert 0 (logit per expert)", **common)
    seed = W.IntSlider(value=config.seed, min=0, max=9, description="router seed", **common)
    out = W.Output()

    def redraw(_=None):
        out.outputs = load_outputs(top_k.value, factor.value, skew.value, seed.value, e, config)

    for control in (top_k, factor, skew, seed):
        control.observe(redraw, names="value")
    redraw()
    return previewed(W.VBox([top_k, factor, skew, seed, out]))
