"""Mixture-of-experts arithmetic (notebook 09): expert capacity and the bytes of expert
parallelism's all-to-alls; one step's all-to-all share on GPUs. Pure arithmetic, no torch.

Notation: E experts on e expert-parallel ranks (E/e experts each), k experts per token (top-k),
n tokens per rank, h the width of a token's row, `bytes_per_element` of each number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from helpers.checks import check_divisible, check_int, check_number
from helpers.cost import alpha_beta

# Expert-parallel step: dispatch and combine forward, and the same two (reversed) backward.
ALL_TO_ALLS_PER_STEP = 4


def capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Most token slots one expert takes from a group of `tokens` tokens: ⌈cf · n·k / E⌉.

    n·k / E is an expert's share when the router is perfectly balanced; the capacity factor
    (Switch Transformer, GShard) is the head-room above it. Slots beyond it are dropped.
    """
    check_int("tokens", tokens)
    check_int("experts", experts)
    check_int("top_k", top_k, 1, experts)
    check_number("capacity_factor", capacity_factor, 0, low_inclusive=False)
    return math.ceil(capacity_factor * tokens * top_k / experts)


def sent_bytes(rows_to: list[int], rank: int, row_bytes: int) -> int:
    """Bytes `rank` hands to the network in one all-to-all sending rows_to[j] rows to rank j:
    everything but the rows it keeps (its own chunk never leaves the process)."""
    return sum(rows for j, rows in enumerate(rows_to) if j != rank) * row_bytes


def all_to_all_bytes(e: int, rows: int, row_bytes: int) -> float:
    """Bytes per rank of one all-to-all of `rows` rows spread evenly over e ranks:
    (e − 1)/e of the buffer (alpha_beta's all_to_all bus factor)."""
    check_int("e", e)
    return (e - 1) / e * rows * row_bytes


def moe_step_bytes(e: int, tokens: int, top_k: int, hidden: int, bytes_per_element: int = 4) -> float:
    """Bytes per rank of one expert-parallel MoE layer step (forward + backward) when the
    router is balanced and nothing is dropped: 4 all-to-alls of the n·k token slots of width h
    (dispatch, combine; their gradients back). Imbalance moves bytes between ranks; drops send
    fewer."""
    check_int("tokens", tokens)
    check_int("top_k", top_k)
    check_int("hidden", hidden)
    return ALL_TO_ALLS_PER_STEP * all_to_all_bytes(e, tokens * top_k, hidden * bytes_per_element)


def check_expert_degree(e: int, experts: int) -> int:
    """e must divide the experts: each rank keeps E/e whole experts."""
    check_int("e", e)
    return check_divisible("experts", experts, e, f"each of the e={e} ranks keeps experts/e experts")


def formula_bytes(e: int, config, bytes_per_element: int = 4) -> float:
    """Per-rank bytes of one step of `config` (a `helpers.configs.MoEConfig`) with a balanced
    router and no drops."""
    return moe_step_bytes(e, config.tokens // e, config.top_k, config.hidden, bytes_per_element)




# ----------------------------------------------------------------------------------------
# One expert-parallel step on a GPU: the same bytes, other hardware numbers.
# ----------------------------------------------------------------------------------------

def expert_flops(rows: int, hidden: int) -> int:
    """Forward + backward FLOPs of `rows` rows through one expert (h → 4h → h, notebook 07's
    FeedForward): 2 matmuls of 2·4h² per row forward, twice that backward: 48·h² per row."""
    check_int("rows", rows, 0)
    check_int("hidden", hidden)
    return 3 * 2 * 2 * rows * hidden * 4 * hidden


@dataclass(frozen=True)
class EPStep:
    """One expert-parallel MoE layer step (forward + backward) on GPUs, balanced router, no
    overlap: the four all-to-alls and the experts' matmuls, seconds."""
    all_to_all_s: float
    experts_s: float

    @property
    def all_to_all_share(self) -> float:
        return self.all_to_all_s / (self.all_to_all_s + self.experts_s)


def ep_step_seconds(e: int, tokens: int, top_k: int, hidden: int, link_Bps: float, latency_s: float,
                    peak_flops: float, efficiency: float, bytes_per_element: int = 2) -> EPStep:
    """n = `tokens` per rank, each of its n·k slots (h numbers) through the 4 all-to-alls
    (notebook 02's α–β model, e ranks on one link) and, balanced, n·k rows through this rank's
    experts at `efficiency` of `peak_flops`."""
    check_int("e", e, 2)
    check_number("efficiency", efficiency, 0, 1, low_inclusive=False)
    slots = check_int("tokens", tokens) * check_int("top_k", top_k)
    one = alpha_beta.predict("all_to_all", e, slots * hidden * bytes_per_element, latency_s,
                             1 / link_Bps)
    return EPStep(ALL_TO_ALLS_PER_STEP * one,
                  expert_flops(slots, hidden) / (peak_flops * efficiency))
