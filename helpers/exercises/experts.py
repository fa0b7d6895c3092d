"""Notebook 09's coding exercises: its two communication patterns, written by hand.

* `dispatch_tokens` (expert parallelism): a rank holds its n tokens and, for each, the rank
  that owns its expert. It sorts them by destination, tells every rank how many rows to expect (an
  all-to-all of counts), then sends them (an all-to-all with uneven split sizes). The page
  prints the layer that does this through `exchange_counts` and `AllToAll`; here the reader
  makes the two torch.distributed calls and works out the split sizes.
* `causal_ring_attention` (long context): causal attention of this rank's query rows over the
  whole sequence, the K/V blocks passed around the ring with isend/irecv. A variation of the
  page's: the naive split (rank r holds the r-th block of the sequence, so blocks of later
  ranks are skipped) and the online softmax kept as a running max and sum, where the page
  prints the zig-zag ring and a log-sum-exp `merge`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.exercises.coding import Case, Exercise, Mistake, register

ALL_TO_ALL = {"all_to_all", "all_to_all_single"}
P2P = {"send", "recv", "isend", "irecv"}
HIDDEN = 3  # h, a token's width in `dispatch`: rows are compared, not timed
HEAD = 4    # the head dimension in `causal_ring_attention`


# == Expert parallelism: the dispatch ========================================================

def dispatch_tokens(tokens: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """Send each of this rank's (n, h) tokens to rank dest[i]; return the rows every rank sent
    here, source by source (rank 0's first), each source's rows in their original order."""
    e = dist.get_world_size()
    order = torch.argsort(dest, stable=True)   # stable: a source's rows keep their order
    send = torch.bincount(dest, minlength=e)   # send[j]: rows for rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)         # recv[j]: rows rank j will send here
    out = tokens.new_empty((int(recv.sum()), tokens.shape[1]))
    dist.all_to_all_single(out, tokens[order], recv.tolist(), send.tolist())
    return out


def _dispatch_given(rank: int, case: Case, group) -> tuple:
    g = case.generator(rank)
    n = case.size + rank + int(torch.randint(0, 3, (1,), generator=g))  # uneven across ranks
    tokens = torch.randint(-99, 100, (n, HIDDEN), generator=g).float()
    # One rank sends nothing to the next one: an empty split.
    skip = (rank + 1) % case.world if rank == case.seed % case.world else None
    choices = torch.tensor([j for j in range(case.world) if j != skip])
    return tokens, choices[torch.randint(0, len(choices), (n,), generator=g)]


def _dispatch_want(case: Case) -> dict:
    given = [_dispatch_given(r, case, None) for r in range(case.world)]
    return {j: torch.cat([t[d == j] for t, d in given]) for j in range(case.world)}


def _rows(x: torch.Tensor) -> list:
    return sorted(map(tuple, x.tolist()))


def _unsorted(case: Case, rank: int) -> torch.Tensor:
    """What `rank` receives when every rank sends its rows unsorted with the right split sizes:
    from source j, the rows at the positions where j's split for `rank` would start."""
    parts = []
    for j in range(case.world):
        tokens, dest = _dispatch_given(j, case, None)
        start = int((dest < rank).sum())
        parts.append(tokens[start:start + int((dest == rank).sum())])
    return torch.cat(parts)


def _dispatch_hint(case: Case, rank: int, got, want, given) -> str | None:
    if not isinstance(got, torch.Tensor) or got.dim() != 2:
        return None
    if got.shape[0] != want.shape[0]:
        return (f"it received {got.shape[0]} rows, the ranks addressed {want.shape[0]} to it: "
                "the output's size and split sizes come from the counts the others send first")
    if got.shape == want.shape and _rows(got) == _rows(want):
        return ("the right rows in the wrong order: they arrive source by source (rank 0's "
                "first), each source's in its own order: sort by destination with a stable sort")
    if torch.equal(got, _unsorted(case, rank)):
        return ("as many rows from each rank as it addressed here, but not the rows it "
                "addressed here: the input was not sorted by destination, so split j was not "
                "the rows for rank j")
    return None


def _dispatch_comm(case: Case, calls: list) -> str | None:
    e = case.world
    for rank, made in enumerate(calls):
        ops = [c.op for c in made]
        other = sorted(set(ops) - ALL_TO_ALL)
        gathers = [c for c in made if c.op.startswith("all_gather")]
        if gathers and all(c.nbytes <= 8 * e for c in gathers):
            return (f"rank {rank} shared its counts with {gathers[0].op}: every rank then "
                    f"receives all {e}×{e} counts where it needs {e}, the ones addressed to it; "
                    "one all-to-all of the counts delivers exactly those")
        if other and other[0].startswith("all_gather"):
            return (f"rank {rank} called {other[0]}: every token then reaches all {e} ranks, "
                    f"{e - 1} copies of each where the dispatch sends one, to its destination "
                    "only (an all-to-all)")
        if other:
            return (f"rank {rank} called {other[0]}: the dispatch is two all-to-alls, the "
                    "counts, then the tokens")
        if len(ops) != 2:
            return (f"rank {rank} made {len(ops)} all-to-all call(s): the dispatch makes two, "
                    "the counts, then the tokens")
        tokens = _dispatch_given(rank, case, None)[0]
        own = tokens.numel() * tokens.element_size()
        if made[0].nbytes > 8 * e:
            return (f"rank {rank}'s first all-to-all handed over {made[0].nbytes} B: it carries "
                    f"the counts, one number for each of the {e} ranks")
        if made[1].nbytes != own:
            return (f"rank {rank}'s token all-to-all handed over {made[1].nbytes} B, its tokens "
                    f"are {own} B: each token travels once")
    return None


def _dispatch_crash(op: str | None, text: str) -> str | None:
    """gloo ends a rank whose all-to-all receives a different size than it was told to expect."""
    if op and op.startswith("all_to_all") and "size" in text:
        return ("a rank received a different number of rows than its output and split sizes "
                "expected: those come from the counts the other ranks send, so all-to-all the "
                "counts first")
    return None


# -- wrong answers (the tests run each and expect its cause named) --------------------------

def _dispatch_without_counts(tokens, dest):
    e = dist.get_world_size()
    send = torch.bincount(dest, minlength=e).tolist()
    out = torch.empty_like(tokens)  # assumes it receives from each rank what it sends there
    dist.all_to_all_single(out, tokens[torch.argsort(dest, stable=True)], send, send)
    return out


def _dispatch_unsorted(tokens, dest):
    e = dist.get_world_size()
    send = torch.bincount(dest, minlength=e)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    out = tokens.new_empty((int(recv.sum()), tokens.shape[1]))
    dist.all_to_all_single(out, tokens, recv.tolist(), send.tolist())  # not sorted first
    return out


def _dispatch_keeps_its_own(tokens, dest):
    return tokens[dest == dist.get_rank()]


def _dispatch_gathers_everything(tokens, dest):
    e, rank = dist.get_world_size(), dist.get_rank()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(e)]
    dist.all_gather(sizes, torch.tensor([len(dest)]))
    most = max(int(s) for s in sizes)  # all_gather needs equal shapes: pad to the longest
    padded = torch.zeros(most, tokens.shape[1])
    padded[:len(tokens)] = tokens
    where = torch.full((most,), -1)
    where[:len(dest)] = dest
    everyone = [torch.empty_like(padded) for _ in range(e)]
    wheres = [torch.empty_like(where) for _ in range(e)]
    dist.all_gather(everyone, padded)
    dist.all_gather(wheres, where)
    return torch.cat([t[d == rank] for t, d in zip(everyone, wheres)])


register(Exercise(
    id="dispatch_tokens", notebook="09",
    title="The MoE dispatch: counts, then tokens, two all-to-alls",
    form="variation", solution=dispatch_tokens,
    cases=(Case(world=3, seed=0, size=4), Case(world=4, seed=1, size=3),
           Case(world=2, seed=2, size=5)),
    given=_dispatch_given, want=_dispatch_want, comm=_dispatch_comm, hint=_dispatch_hint,
    crash=_dispatch_crash,
    mistakes=(
        Mistake("skipped a phase", _dispatch_without_counts, "all-to-all the counts first"),
        Mistake("wrong order", _dispatch_unsorted, "not sorted by destination"),
        Mistake("computed locally without communicating", _dispatch_keeps_its_own,
                "made no call"),
        Mistake("sent the whole tensor to every rank", _dispatch_gathers_everything,
                "copies of each"),
    ),
))


# == Long context: causal ring attention ======================================================

def causal_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of this rank's (s/c, h) queries over the whole sequence (rank r holds
    its r-th block), the K/V blocks passed to rank + 1 for c − 1 hops."""
    rank, c = dist.get_rank(), dist.get_world_size()
    best = q.new_full((q.shape[0], 1), float("-inf"))  # each query's largest score so far
    total = q.new_zeros((q.shape[0], 1))               # Σ exp(score − best)
    acc = torch.zeros_like(q)                          # Σ exp(score − best) · v
    kv = torch.stack([k, v])
    for step in range(c):
        if step < c - 1:  # start the hop first: it travels while this block is computed
            inbox = torch.empty_like(kv)
            hop = [dist.isend(kv, (rank + 1) % c), dist.irecv(inbox, (rank - 1) % c)]
        source = (rank - step) % c  # the block in hand left rank − step, step hops ago
        if source <= rank:          # a later rank's keys are in every query's future: skip
            scores = q @ kv[0].T / q.shape[-1] ** 0.5
            if source == rank:      # own block: query i sees keys 0 … i
                scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1),
                                            float("-inf"))
            new = torch.maximum(best, scores.amax(-1, keepdim=True))
            weights, rescale = torch.exp(scores - new), torch.exp(best - new)
            total = total * rescale + weights.sum(-1, keepdim=True)
            acc, best = acc * rescale + weights @ kv[1], new
        if step < c - 1:
            for work in hop:
                work.wait()
            kv = inbox
    return acc / total


def _ring_given(rank: int, case: Case, group) -> tuple:
    g = case.generator(rank)
    return tuple(torch.randn(case.size, HEAD, generator=g) for _ in range(3))


def _ring_want(case: Case) -> dict:
    q, k, v = (torch.cat(parts) for parts in
               zip(*(_ring_given(r, case, None) for r in range(case.world))))
    out = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None],
                                                           is_causal=True)[0]
    return dict(enumerate(out.split(case.size)))


def _attend(q: torch.Tensor, blocks: list) -> torch.Tensor:
    """Exact softmax attention of q over the (k, v, own) blocks (own: the causal triangle)."""
    scores = []
    for k, _, own in blocks:
        s = q @ k.T / q.shape[-1] ** 0.5
        scores.append(s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1),
                                    float("-inf")) if own else s)
    return torch.softmax(torch.cat(scores, 1), -1) @ torch.cat([v for _, v, _ in blocks])


def _causal(q: torch.Tensor, rank: int, received: list) -> torch.Tensor:
    """Rank `rank`'s output from the (source, k, v) blocks it holds: earlier sources whole,
    its own with the triangle, later ones skipped."""
    return _attend(q, [(k, v, j == rank) for j, k, v in received if j <= rank])


def _as_if(case: Case, rank: int, label) -> torch.Tensor:
    """What `rank` computes when it takes the block in hand at step s for rank label(s)'s."""
    q = _ring_given(rank, case, None)[0]
    held = [(label(s),) + _ring_given((rank - s) % case.world, case, None)[1:]
            for s in range(case.world)]
    return _causal(q, rank, held)


def _ring_hint(case: Case, rank: int, got, want, given) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return None
    c = case.world
    known = (
        (lambda s: (rank + s) % c, "it took the block in hand at step s for rank (rank + s)'s: "
         "blocks travel to rank + 1, so at step s it is rank (rank − s)'s"),
        (lambda s: rank if s == 0 else c, "only its own K/V block counted: the blocks of "
         "earlier ranks never entered the softmax"),
        (lambda s: rank if s == 0 else -1, "it attended to keys after its queries: skip the "
         "blocks of later ranks, whose keys lie in the future"),
        (lambda s: -1, "no causal mask: skip later ranks' blocks and mask its own block's "
         "upper triangle (query i sees keys 0 … i)"),
    )
    for label, cause in known:
        if torch.allclose(got, _as_if(case, rank, label), rtol=1e-4, atol=1e-5):
            return cause
    return None


def _ring_comm(case: Case, calls: list) -> str | None:
    c, block = case.world, 2 * case.size * HEAD * 4  # this rank's K and V, fp32
    for rank, made in enumerate(calls):
        other = sorted({x.op for x in made} - P2P)
        if other:
            return (f"rank {rank} called {other[0]}: ring attention passes the K/V blocks to the "
                    "next rank with isend/irecv, one block in hand at a time (gathering all c "
                    "at once costs the memory the ring saves)")
        for x in made:
            if x.op in ("send", "isend") and x.peer != (rank + 1) % c:
                return (f"rank {rank} sent to rank {x.peer}: in the ring a rank sends only to "
                        "the next (rank + 1) and receives only from the previous (rank − 1)")
            if x.op in ("recv", "irecv") and x.peer != (rank - 1) % c:
                return (f"rank {rank} received from rank {x.peer}: in the ring a rank receives "
                        "only from the previous (rank − 1)")
        sent = sum(x.nbytes for x in made if x.op in ("send", "isend"))
        if sent != (c - 1) * block:
            return (f"rank {rank} sent {sent} B, c − 1 = {c - 1} hops of its K/V block are "
                    f"{(c - 1) * block} B: " + (
                        "more: after c − 1 hops every block has been in hand, and K and V go "
                        "once per hop" if sent > (c - 1) * block else "fewer: a hop left out?"))
    return None


# -- wrong answers (the tests run each and expect its cause named) --------------------------

def _ring_hops(k, v, receive_from: int) -> list:
    """The (source, k, v) blocks in the order a ring hands them to this rank."""
    rank, c = dist.get_rank(), dist.get_world_size()
    kv, held = torch.stack([k, v]), [(rank, k, v)]
    for step in range(1, c):
        inbox = torch.empty_like(kv)
        sending = dist.isend(kv, (rank + 1) % c)
        dist.recv(inbox, receive_from)
        sending.wait()
        kv = inbox
        held.append(((rank - step) % c, kv[0], kv[1]))
    return held


def _ring_receives_from_the_next(q, k, v):
    rank, c = dist.get_rank(), dist.get_world_size()
    return _causal(q, rank, _ring_hops(k, v, (rank + 1) % c))  # rank + 1 sends onward, never back


def _ring_reversed_sources(q, k, v):
    rank, c = dist.get_rank(), dist.get_world_size()
    held = _ring_hops(k, v, (rank - 1) % c)
    return _causal(q, rank, [((rank + s) % c, kk, vv) for s, (_, kk, vv) in enumerate(held)])


def _ring_all_gather(q, k, v):
    rank, c = dist.get_rank(), dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(c)], [torch.empty_like(v) for _ in range(c)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    return _causal(q, rank, list(zip(range(c), ks, vs)))


def _ring_own_block_only(q, k, v):
    return _causal(q, dist.get_rank(), [(dist.get_rank(), k, v)])


def _ring_sends_to_everyone(q, k, v):
    rank, c = dist.get_rank(), dist.get_world_size()
    others = [j for j in range(c) if j != rank]
    sending = [dist.isend(torch.stack([k, v]), j) for j in others]
    held = [(rank, k, v)]
    for j in others:
        inbox = torch.empty(2, *k.shape)
        dist.recv(inbox, j)
        held.append((j, inbox[0], inbox[1]))
    for work in sending:
        work.wait()
    return _causal(q, rank, held)


register(Exercise(
    id="causal_ring_attention", notebook="09",
    title="Causal ring attention: K/V blocks around the ring, an online softmax",
    form="variation", solution=causal_ring_attention,
    cases=(Case(world=3, seed=0, size=3), Case(world=4, seed=1, size=2),
           Case(world=2, seed=2, size=4)),
    given=_ring_given, want=_ring_want, comm=_ring_comm, hint=_ring_hint,
    mistakes=(
        Mistake("wrong neighbour", _ring_receives_from_the_next, "deadlock"),
        Mistake("wrong order", _ring_reversed_sources, "blocks travel to rank + 1"),
        Mistake("used the collective the lesson replaces", _ring_all_gather,
                "called all_gather"),
        Mistake("computed locally without communicating", _ring_own_block_only,
                "made no call"),
        Mistake("sent the whole tensor to every rank", _ring_sends_to_everyone,
                "sends only to the next"),
    ),
))
