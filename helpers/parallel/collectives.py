"""The eight collectives of notebook 01, run on real ranks and drawn rank by rank.

Every rank starts from the lecture's tensor, `arange(length) + rank` (so with 4 ranks and
length 4, rank r holds [0, 1, 2, 3] + r); all-to-all uses `10 * rank + arange(length)`. `run_collective` is the rank function; `expected`
computes the same answer in one process, so the notebook and the tests can check the real
collective against what it is supposed to do.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys

import torch
import torch.distributed as dist

OPS = ("broadcast", "scatter", "gather", "reduce",
       "all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# Collectives that cut a tensor into one chunk per rank need a length divisible by the ranks.
SPLITTING_OPS = ("scatter", "reduce_scatter", "all_to_all")
ROOT = 0  # the source / destination rank of the rooted collectives


def check_op(op: str, world_size: int, length: int) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}")
    if op in SPLITTING_OPS and length % world_size:
        raise ValueError(f"length must be a multiple of world_size={world_size} for {op} "
                         f"(it cuts the tensor into one chunk per rank), got {length}")


def start_tensor(rank: int, length: int, op: str = "") -> torch.Tensor:
    """The lecture's `arange(length) + rank`; for all-to-all, `10 * rank + arange(length)`.

    All-to-all transposes the (rank, chunk) grid, and the lecture's tensor is symmetric
    under that transpose (element i of rank r is i + r), so it would look unchanged.
    """
    if op == "all_to_all":
        return torch.arange(length, dtype=torch.float32) + 10 * rank
    return torch.arange(length, dtype=torch.float32) + rank


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_collective(rank: int, world_size: int, op: str, length: int = 4) -> dict:
    """Rank function: one collective on `arange(length) + rank`; returns before and after.

    `None` stands for "this rank holds nothing here" (e.g. non-root ranks of a gather).
    """
    check_op(op, world_size, length)
    x = start_tensor(rank, length, op).to(_device())
    before = x.clone()
    chunks = list(x.chunk(world_size)) if op in SPLITTING_OPS else None
    if op == "broadcast":
        dist.broadcast(x, src=ROOT)
        after = x
    elif op == "scatter":
        before = x.clone() if rank == ROOT else None
        after = torch.empty(length // world_size, device=x.device)
        dist.scatter(after, [c.contiguous() for c in chunks] if rank == ROOT else None, src=ROOT)
    elif op == "gather":
        bucket = [torch.empty_like(x) for _ in range(world_size)] if rank == ROOT else None
        dist.gather(x, bucket, dst=ROOT)
        after = torch.cat(bucket) if rank == ROOT else None
    elif op == "reduce":
        dist.reduce(x, dst=ROOT, op=dist.ReduceOp.SUM)
        after = x if rank == ROOT else None  # other ranks' buffers are unspecified
    elif op == "all_gather":
        after = torch.empty(length * world_size, device=x.device)
        dist.all_gather_single(after, x)
    elif op == "reduce_scatter":
        after = torch.empty(length // world_size, device=x.device)
        dist.reduce_scatter_single(after, x, op=dist.ReduceOp.SUM)
    elif op == "all_reduce":
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        after = x
    else:  # all_to_all: chunk j of rank r goes to rank j, which stacks them in rank order
        after = torch.empty_like(x)
        dist.all_to_all_single(after, x)
    return {"before": before, "after": after}


def expected(op: str, world_size: int, length: int = 4) -> list[dict]:
    """What `run_collective` must return on each rank, computed in one process."""
    check_op(op, world_size, length)
    xs = [start_tensor(r, length, op) for r in range(world_size)]
    total = torch.stack(xs).sum(0)
    out = []
    for r, x in enumerate(xs):
        before, after = x, None
        if op == "broadcast":
            after = xs[ROOT]
        elif op == "scatter":
            before = x if r == ROOT else None
            after = xs[ROOT].chunk(world_size)[r]
        elif op == "gather":
            after = torch.cat(xs) if r == ROOT else None
        elif op == "reduce":
            after = total if r == ROOT else None
        elif op == "all_gather":
            after = torch.cat(xs)
        elif op == "reduce_scatter":
            after = total.chunk(world_size)[r]
        elif op == "all_reduce":
            after = total
        else:
            after = torch.cat([y.chunk(world_size)[r] for y in xs])
        out.append({"before": before, "after": after})
    return out


def all_reduce_two_ways(rank: int, world_size: int, length: int = 4) -> dict:
    """Rank function: all-reduce, and reduce-scatter followed by all-gather, on the same data."""
    check_op("reduce_scatter", world_size, length)
    direct = start_tensor(rank, length).to(_device())
    dist.all_reduce(direct)
    piece = torch.empty(length // world_size, device=direct.device)
    dist.reduce_scatter_single(piece, start_tensor(rank, length).to(direct.device))
    rebuilt = torch.empty(length, device=direct.device)
    dist.all_gather_single(rebuilt, piece)
    return {"all_reduce": direct, "reduce_scatter": piece, "then_all_gather": rebuilt}


def lecture_example(rank: int, world_size: int) -> dict:
    """The lecture's running example: rank r holds [0, 1, 2, 3] + r."""
    result = all_reduce_two_ways(rank, world_size, length=4)
    return {k: v.tolist() for k, v in result.items()}


# ---------------------------------------------------------------------------------------
# Gaps between backends: probe what this torch's backend does, and the portable way.
# ---------------------------------------------------------------------------------------

def _muted(call, *args):
    with fd2_muted():
        return call(*args)


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Average across ranks in place; SUM then divide where the backend has no AVG."""
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
    except (RuntimeError, ValueError):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= dist.get_world_size()
    return tensor


def reduce_scatter_rows(output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """Reduce-scatter that accepts any layout: gloo checks dim 0, NCCL only the element count.

    Flattening both sides makes the split happen over the flat memory, which is what
    NCCL does anyway, so the result is the same on every backend.
    """
    dist.reduce_scatter_single(output.view(-1), input.contiguous().view(-1))
    return output


@contextlib.contextmanager
def fd2_muted():
    """Silence file descriptor 2 for a moment.

    gloo logs a failed check straight to fd 2 (with a timestamp), bypassing sys.stderr, and a
    rank's fd 2 is the notebook's: the exception already carries the same words, so the
    duplicate would only add a line that changes every run.
    """
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def probe_backend(rank: int, world_size: int) -> dict:
    """Rank function: try the calls the lecture makes that some backends refuse."""
    def attempt(call):
        try:
            call()
            return "works"
        except (RuntimeError, ValueError) as error:
            first = str(error).strip().splitlines()[0]
            # Drop the C++ prefix "[rank0]:[F1129 12:00:00.0 File.cpp:123] " (time, path).
            return "fails: " + re.sub(r"^\[rank\d+\]:\[[^\]]*\]\s*", "", first)[:90]

    x = start_tensor(rank, 4).to(_device())
    n = 4
    lecture_input = torch.randn(world_size, n, device=x.device)   # the lecture's 2-D input
    lecture_output = torch.empty(n, device=x.device)
    flat_output = torch.empty(n, device=x.device)
    return {
        "backend": dist.get_backend(),
        "all_reduce(op=AVG)": attempt(lambda: dist.all_reduce(x.clone(), op=dist.ReduceOp.AVG)),
        "reduce_scatter(2-D input (w, n) -> output (n,))":
            attempt(lambda: _muted(dist.reduce_scatter_single, lecture_output, lecture_input)),
        "reduce_scatter_rows (flattened)":
            attempt(lambda: reduce_scatter_rows(flat_output, lecture_input)),
        "all_reduce_mean": attempt(lambda: all_reduce_mean(x.clone())),
    }


# ---------------------------------------------------------------------------------------
# Drawing: one row per rank, the tensor before and after, cells coloured by value.
# ---------------------------------------------------------------------------------------

def draw(op: str, results: list[dict], ax=None):
    """Draw what each rank held before and after `op`. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    world_size = len(results)
    longest = max(len(r[k]) for r in results for k in ("before", "after") if r[k] is not None)
    width = max(longest, 1)
    if ax is None:
        _, ax = plt.subplots(figsize=(2.2 + 0.45 * 2 * width, 0.5 + 0.45 * world_size))
    values = [float(v) for r in results for k in ("before", "after") if r[k] is not None
              for v in r[k].tolist()]
    hi = max(values + [1.0])
    cmap = plt.get_cmap("viridis")
    gap = 1.5
    for rank, res in enumerate(results):
        y = world_size - 1 - rank
        ax.text(-0.3, y + 0.5, f"rank {rank}", ha="right", va="center", fontsize=9)
        for column, key in enumerate(("before", "after")):
            x0 = column * (width + gap)
            tensor = res[key]
            if tensor is None:
                ax.text(x0 + 0.1, y + 0.5, "—", va="center", color="0.5", fontsize=9)
                continue
            for i, v in enumerate(tensor.tolist()):
                ax.add_patch(Rectangle((x0 + i, y + 0.05), 0.95, 0.9,
                                       color=cmap(0.15 + 0.75 * v / hi)))
                ax.text(x0 + i + 0.47, y + 0.5, f"{v:g}", ha="center", va="center",
                        fontsize=8, color="white" if v / hi < 0.6 else "black")
    for column, key in enumerate(("before", "after")):
        ax.text(column * (width + gap) + width / 2, world_size + 0.15, key, ha="center",
                fontsize=10, weight="bold")
    ax.annotate("", xy=(width + gap - 0.15, world_size / 2), xytext=(width + 0.15, world_size / 2),
                arrowprops=dict(arrowstyle="->", lw=1.5))
    ax.set_xlim(-1.6, 2 * width + gap + 0.2)
    ax.set_ylim(-0.2, world_size + 0.6)
    ax.set_title(op, fontsize=11)
    ax.axis("off")
    return ax


def draw_many(ops, results_by_op: dict, columns: int = 2):
    import matplotlib.pyplot as plt
    ops = list(ops)
    rows = -(-len(ops) // columns)
    world_size = len(next(iter(results_by_op.values())))
    fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, (0.9 + 0.45 * world_size) * rows))
    axes = [axes] if rows * columns == 1 else list(getattr(axes, "flat", axes))
    for ax, op in zip(axes, ops):
        draw(op, results_by_op[op], ax=ax)
    for ax in axes[len(ops):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------
# The widget of notebook 01: world size and length -> the collectives, re-run on live ranks.
# ---------------------------------------------------------------------------------------

MAX_WIDGET_WORLD_SIZE = 8


def run_all(live, world_size: int, length: int, ops=OPS) -> dict:
    """Run `ops` on `live` ranks resized to `world_size`; check each against `expected`.

    Returns {op: per-rank results}. Ops that cannot cut `length` into `world_size` chunks
    are left out (and named in the returned "skipped" list) rather than failing the rest.
    """
    if not 1 <= world_size <= MAX_WIDGET_WORLD_SIZE:
        raise ValueError(f"world_size must be between 1 and {MAX_WIDGET_WORLD_SIZE}, got {world_size}")
    live.resize(world_size)
    results, skipped = {}, []
    for op in ops:
        if op in SPLITTING_OPS and length % world_size:
            skipped.append(op)
            continue
        got = live.run(run_collective, op, length)
        want = expected(op, world_size, length)
        for rank, (g, w) in enumerate(zip(got, want)):
            for key in ("before", "after"):
                if (g[key] is None) != (w[key] is None) or (
                        g[key] is not None and not torch.equal(g[key], w[key])):
                    raise AssertionError(f"{op}: rank {rank} {key} is {g[key]}, expected {w[key]}")
        results[op] = got
    return {"results": results, "skipped": skipped}


def widget(live):
    """Sliders for world size (1-8) and length; redraws every collective on each change."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    size = w.IntSlider(value=live.world_size, min=1, max=MAX_WIDGET_WORLD_SIZE,
                       description="world size")
    length = w.IntSlider(value=4, min=1, max=16, description="length")
    out = w.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            done = run_all(live, size.value, length.value)
            if done["results"]:
                draw_many(list(done["results"]), done["results"])
                plt.show()
            if done["skipped"]:
                print(f"skipped {', '.join(done['skipped'])}: length {length.value} does not "
                      f"split into {size.value} equal chunks")

    size.observe(redraw, names="value")
    length.observe(redraw, names="value")
    redraw()
    display(w.VBox([w.HBox([size, length]), out]))


def all_reduce_once(rank: int, world_size: int, numel: int = 4) -> float:
    """Rank function: one small all-reduce; the unit of interactivity in benchmarks."""
    x = start_tensor(rank, numel).to(_device())
    dist.all_reduce(x)
    return float(x[0])


def forgetful_all_reduce(rank: int, world_size: int) -> str:
    """Rank function: every rank but the last calls all_reduce; the rest wait for it forever.

    The rule it breaks: every rank of a group must call every collective, in the same order.
    """
    if rank == world_size - 1:
        return "returned without calling all_reduce"
    x = start_tensor(rank, 4).to(_device())
    dist.all_reduce(x)
    return "done"


def barrier_demo(rank: int, world_size: int, seconds_per_rank: float = 0.2) -> dict:
    """Rank function: ranks arrive at a barrier at different times and leave it together."""
    import time
    start = time.monotonic()
    time.sleep(seconds_per_rank * rank)
    arrived = time.monotonic() - start
    dist.barrier()
    left = time.monotonic() - start
    return {"arrived_s": round(arrived, 2), "left_s": round(left, 2)}
