"""Communication on a hierarchical network (docs/cost_model.md §4), one function per parallelism type.

Each degree is a tuple over network levels, innermost first (`X = Π_k X_k`). Bandwidth times
divide by the whole cluster's bandwidth `N · bw_k / 2` (bandwidth counts both directions).
The functions are split by type so the fast search can cache each one on its own inputs;
the arithmetic is the same in the reference and the fast path, so their results are
bit-identical.
"""
from __future__ import annotations

import math

from helpers.hardware import NetworkLevel


def allreduce(words, g, rs, rp, level: NetworkLevel, N, by) -> tuple[float, float]:
    """(bandwidth s, latency s) of `rs` sequential × `rp` parallel all-reduces, each among a
    group of `g` GPUs (of the cluster's N)."""
    bw = 2 * (g - 1) * words * rs * rp * by / (N * level.bandwidth_Bps / 2)
    lat = 2 * rs * level.latency_s if g > 1 else 0.0
    return bw, lat


def p2p(words, rs, rp, level: NetworkLevel, N, by) -> tuple[float, float]:
    return words * rs * rp * by / (N * level.bandwidth_Bps / 2), rs * level.latency_s


def outer(degrees: tuple[int, ...], k: int) -> int:
    """Product of the degrees on levels outside `k`."""
    return math.prod(degrees[k + 1:])


def top_level(degrees: tuple[int, ...]) -> int:
    """The outermost level on which a type has degree > 1; -1 if it never leaves the GPU."""
    return max((k for k, x in enumerate(degrees) if x > 1), default=-1)


def dp_comm(P: int, DP: tuple[int, ...], levels, N: int, by: float) -> tuple[float, float]:
    """Gradient all-reduce: bandwidth is the slowest level's, latencies add up."""
    bw_max, lat_sum = 0.0, 0.0
    for k, level in enumerate(levels):
        bw, lat = allreduce(P, DP[k], 1, outer(DP, k), level, N, by)
        bw_max = max(bw_max, bw)
        lat_sum += lat
    return bw_max, lat_sum


def tp_comm(h_model: int, h_ff: int, L: int, B: int, TPm: tuple[int, ...],
            TPf: tuple[int, ...], levels, N: int, by: float) -> tuple[float, float]:
    """2-D TP: `h_ff` words all-reduced among TP_model, `h_model` words among TP_ff, 2L times
    per step (the paper's f and d)."""
    bw_max, lat_sum = 0.0, 0.0
    for k, level in enumerate(levels):
        bw1, lat1 = allreduce(h_ff, TPm[k], 2 * L, B * outer(TPm, k), level, N, by)
        bw2, lat2 = allreduce(h_model, TPf[k], 2 * L, B * outer(TPf, k), level, N, by)
        bw_max = max(bw_max, bw1 + bw2)
        lat_sum += lat1 + lat2
    return bw_max, lat_sum


def pp_frequencies(L: int, v: int, PP: tuple[int, ...]) -> dict[int, float]:
    """How often a layer boundary is crossed on each level (-1: stays on the GPU)."""
    freq = {-1: (L - v * math.prod(PP)) / (L - 1)}
    top = top_level(PP)
    for pl in range(top + 1):
        if pl == top:
            freq[pl] = (v * PP[pl] - 1) / (L - 1)
        else:
            freq[pl] = v * outer(PP, pl) * (PP[pl] - 1) / (L - 1)
    return freq


def ep_frequencies(EP: tuple[int, ...]) -> tuple[dict[int, float], dict[int, float]]:
    """(bandwidth, latency) weights of the expert all-to-all per level (-1: on the GPU).

    Bandwidth: the share of tokens whose expert is first found on that level. Latency: a
    token waits for the farthest expert, so the whole weight sits on the top EP level.
    """
    top = top_level(EP)
    bw = {-1: 1 / math.prod(EP)}
    lat = {-1: 1.0 if top == -1 else 0.0}
    for el in range(len(EP)):
        bw[el] = 1 / outer(EP, el) - 1 / math.prod(EP[el:])
        lat[el] = 1.0 if el == top else 0.0
    return bw, lat


def ppep_comm(h_model: int, L: int, B: int, v: int, PP: tuple[int, ...], EP: tuple[int, ...],
              levels, N: int, by: float) -> tuple[float, float]:
    """Activations between pipeline stages and to experts: `h_model` words per token, p2p."""
    pp_freq = pp_frequencies(L, v, PP)
    ep_bw, ep_lat = ep_frequencies(EP)
    bw_sum, lat_sum = 0.0, 0.0
    for pl, pf in pp_freq.items():
        for el in ep_bw:
            level = max(pl, el)
            if level < 0:
                continue
            bw, _ = p2p(h_model, 2 * (L - 1) * pf * ep_bw[el], B, levels[level], N, by)
            _, lat = p2p(h_model, 2 * (L - 1) * pf * ep_lat[el], B, levels[level], N, by)
            bw_sum += bw
            lat_sum += lat
    return bw_sum, lat_sum
