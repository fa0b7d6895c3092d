"""Context-parallel (ring attention) arithmetic for notebook 09. Pure arithmetic, no torch.

The sequence of s tokens is cut into equal chunks spread over c ranks. Causal attention of
query chunk a on key/value chunk b costs a full block when b < a, half a block when b = a
(the diagonal, under the causal mask) and nothing when b > a.

* "naive": c chunks, rank r holds chunk r. Rank r works r + ½ blocks of (s/c)², rank c − 1
  almost c times rank 0's: the ring runs at the slowest rank's pace.
* "zigzag": 2c chunks, rank r holds chunks r and 2c − 1 − r (one early, one late). Every rank
  works the same 2c · (s/2c)² = s²/(2c): the causal triangle split evenly.
"""
from __future__ import annotations

from helpers.checks import check_choice, check_divisible, check_int
from helpers.cost import alpha_beta

LAYOUTS = ("naive", "zigzag")


def chunks_per_rank(layout: str) -> int:
    return 2 if check_choice("layout", layout, LAYOUTS) == "zigzag" else 1


def chunks_of(rank: int, c: int, layout: str) -> list[int]:
    """The sequence chunks rank `rank` of c holds, in the order it stores them."""
    if chunks_per_rank(layout) == 1:
        return [rank]
    return [rank, 2 * c - 1 - rank]


def check_split(seq: int, c: int, layout: str) -> int:
    """s must cut into c · chunks_per_rank equal chunks; returns the chunk length."""
    check_int("c", c)
    check_int("seq", seq)
    parts = c * chunks_per_rank(layout)
    check_divisible("seq", seq, parts, f"layout={layout!r} cuts it into {parts} equal chunks for c={c}")
    return seq // parts


def causal_work(c: int, layout: str) -> list[float]:
    """Causal attention work of each rank, in units of s² (score entries computed; the whole
    causal triangle sums to ½)."""
    check_int("c", c)
    n = c * chunks_per_rank(layout)
    work = []
    for rank in range(c):
        blocks = sum((0.5 if b == a else 1.0) for a in chunks_of(rank, c, layout)
                     for b in range(n) if b <= a)
        work.append(blocks / n ** 2)
    return work


def idle_share(work: list[float]) -> float:
    """The share of c ranks' time spent waiting when each step runs at the slowest rank's pace:
    1 − mean/max of the work."""
    return 1 - sum(work) / len(work) / max(work)


def ring_bytes(c: int, batch: int, heads: int, seq: int, head_dim: int,
               bytes_per_element: int = 4) -> int:
    """Bytes one rank sends in one ring-attention step, forward + backward.

    A K/V block is 2 · b · heads · (s/c) · d_head numbers (d_head: the head dimension).
    Forward: c − 1 hops of it (the last block need not go on). Backward: c − 1 hops of K/V
    again, and c hops of its gradient dK/dV, the same size (the accumulated gradient comes
    home to the block's owner in the last hop).
    """
    check_int("c", c)
    check_divisible("seq", seq, c, f"each of the c={c} ranks keeps seq/c tokens")
    block = 2 * batch * heads * (seq // c) * head_dim * bytes_per_element
    if c == 1:
        return 0
    return (c - 1) * block + (c - 1) * block + c * block


def block_pairs(mine: list[int], theirs: list[int]) -> list[tuple[int, int, bool]]:
    """(index in mine, index in theirs, diagonal) for every (query chunk, key chunk) pair with
    something to compute: the key chunk is not later than the query chunk."""
    return [(i, j, a == b) for i, a in enumerate(mine) for j, b in enumerate(theirs) if b <= a]


def step_work(rank: int, step: int, c: int, layout: str) -> float:
    """Forward work of `rank` at ring step `step` (the block of rank (rank − step) mod c), in
    full chunk pairs: 1 per full pair, ½ per diagonal."""
    pairs = block_pairs(chunks_of(rank, c, layout), chunks_of((rank - step) % c, c, layout))
    return sum(0.5 if diagonal else 1.0 for _, _, diagonal in pairs)


def ring_schedule_idle(c: int, layout: str) -> float:
    """Idle share of the ring schedule itself, forward then backward (a backward pair costs
    twice a forward one), transfers taking no time: what wait mode measures.

    A hop is one isend to the next rank and one irecv from the previous, posted together;
    waiting for it ends once both neighbours have posted theirs (the previous rank's block has
    left, the next rank is ready to take mine). Forward, rank r posts the hop of step i, works
    its block, waits, and starts step i + 1. Backward, the same for K/V, and the block's dK/dV
    goes on once this rank's share is added and the accumulator from before has arrived.
    Higher than `idle_share(causal_work(...))`, which only compares the work: in the ring the
    busiest rank also holds up its neighbours' hops and starts its backward last.
    """
    check_int("c", c)
    work = [[step_work(r, i, c, layout) for i in range(c)] for r in range(c)]

    def hop_done(r: int, called: float, posted: list[float]) -> float:
        return max(called, posted[r - 1], posted[(r + 1) % c])

    start = [[0.0] * c for _ in range(c)]           # forward: step i begins (hop i posted)
    for i in range(c - 1):
        for r in range(c):
            start[r][i + 1] = hop_done(r, start[r][i] + work[r][i], [x[i] for x in start])
    forward_end = [start[r][c - 1] + work[r][c - 1] for r in range(c)]
    begin = [[0.0] * c for _ in range(c)]           # backward: step i begins (K/V hop posted)
    passed = [[0.0] * c for _ in range(c)]          # backward: dK/dV of step i posted
    for r in range(c):
        begin[r][0] = forward_end[r]
    for i in range(c):
        for r in range(c):
            done = begin[r][i] + 2 * work[r][i]
            passed[r][i] = hop_done(r, done, [x[i - 1] for x in passed]) if i else done
        if i < c - 1:
            for r in range(c):
                begin[r][i + 1] = hop_done(r, passed[r][i], [x[i] for x in begin])
    backward_end = [hop_done(r, passed[r][c - 1], [x[c - 1] for x in passed]) for r in range(c)]
    busy = 3 * sum(map(sum, work))
    span = max(forward_end) + (max(backward_end) - min(forward_end))
    return 1 - busy / (c * span)


def formula_bytes(c: int, config) -> int:
    """Per-rank bytes of one ring-attention step (forward and backward) of `config` (a
    `helpers.configs.RingConfig`) over c ranks."""
    return ring_bytes(c, config.batch, config.heads, config.seq, config.head_dim)


# ----------------------------------------------------------------------------------------
# One ring step on a GPU: the same arithmetic, other hardware numbers.
# ----------------------------------------------------------------------------------------

def hop_seconds(n: int, batch: int, heads: int, head_dim: int, link_Bps: float,
                latency_s: float, bytes_per_element: int = 2) -> float:
    """One K/V hop of a rank's n tokens: 2 · b · heads · n · d_head numbers over a link of
    `link_Bps` in one direction, plus its latency (notebook 02's α–β model of a send)."""
    check_int("n", n)
    nbytes = 2 * batch * heads * n * head_dim * bytes_per_element
    return alpha_beta.predict("send_recv", 2, nbytes, latency_s, 1 / link_Bps)


def block_flops(n: int, batch: int, heads: int, head_dim: int) -> int:
    """Forward FLOPs of one full (n × n) attention block: q kᵀ and p v, 2 · n² · d_head each."""
    return 4 * batch * heads * n * n * head_dim


def block_seconds(n: int, batch: int, heads: int, head_dim: int, peak_flops: float,
                  efficiency: float) -> float:
    """One full block's forward attention at `efficiency` of `peak_flops`."""
    return block_flops(n, batch, heads, head_dim) / (peak_flops * efficiency)


def hop_shorter_from(link_Bps: float, latency_s: float, peak_flops: float, efficiency: float,
                     bytes_per_element: int = 2, batch: int = 1, heads: int = 1,
                     head_dim: int = 128) -> int:
    """The fewest tokens per rank n for which the hop is shorter than the block.

    hop < block ⇔ 4·b·H·d·n²/F' − 2·b·H·d·B·n/W − α > 0 (F' the sustained FLOP/s, W the link,
    B bytes per number, α the latency): the larger root of the quadratic, rounded up. Without
    α it is n* = B·F'/(2·W), whatever b, heads and d_head are.
    """
    a = 4 * batch * heads * head_dim / (peak_flops * efficiency)
    b = 2 * batch * heads * head_dim * bytes_per_element / link_Bps
    root = (b + (b * b + 4 * a * latency_s) ** 0.5) / (2 * a)
    n = max(1, int(root))
    while hop_seconds(n, batch, heads, head_dim, link_Bps, latency_s, bytes_per_element) \
            >= block_seconds(n, batch, heads, head_dim, peak_flops, efficiency):
        n += 1
    return n
