"""The latency–bandwidth (α–β) model of a collective, and how to fit it to measurements.

A collective on N ranks moving an n-byte message takes

    t(n, N) = a(N) · α + b(N) · n · β

α is the cost of one message (latency, seconds), β the cost of one byte on the busiest link
(seconds per byte), and a(N), b(N) count how many of each the algorithm pays. For the ring
algorithms NCCL uses, b(N) is exactly the nccl-tests "bus bandwidth" factor, so 1/β is the
bus bandwidth a large message approaches. Ring all-reduce, for instance, is a reduce-scatter
then an all-gather: 2(N−1) steps, each moving n/N bytes: `2(N−1)α + 2(N−1)/N · n·β`.

Notation: N is the number of ranks (nccl-tests writes n for it; p is pipeline stages), n the
message size in bytes as defined per operation in `COST_MODELS`. Nothing here imports torch:
the model is pure arithmetic.

Also here: ranks on nodes, two network levels (the section at the end): which ranks share a node,
the bytes a flat ring and a hierarchical all-reduce send over each node's uplink, and both
all-reduces' times from the two levels' fits.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from helpers.checks import check_choice, check_int, check_number
from helpers.units import GB



@dataclass(frozen=True)
class CollectiveModel:
    """α and β coefficients of one operation's algorithm, as functions of the world size N."""

    name: str
    latency_steps: Callable[[int], float]   # a(N): how many α
    bus_factor: Callable[[int], float]      # b(N): how many n·β; also nccl-tests' busbw factor
    splits: bool                            # the n-byte buffer is cut into N equal chunks
    bytes_are: str                          # what n counts, in words
    algorithm: str                          # the algorithm whose coefficients these are


COST_MODELS: dict[str, CollectiveModel] = {m.name: m for m in (
    CollectiveModel("all_reduce", lambda N: 2 * (N - 1), lambda N: 2 * (N - 1) / N, False,
                    "the buffer on each rank", "ring: reduce-scatter then all-gather"),
    CollectiveModel("all_gather", lambda N: N - 1, lambda N: (N - 1) / N, True,
                    "the gathered output (N chunks)", "ring"),
    CollectiveModel("reduce_scatter", lambda N: N - 1, lambda N: (N - 1) / N, True,
                    "the input on each rank (N chunks)", "ring"),
    CollectiveModel("broadcast", lambda N: N - 1, lambda N: 1.0, False,
                    "the buffer", "pipelined chain"),
    CollectiveModel("reduce", lambda N: N - 1, lambda N: 1.0, False,
                    "the buffer", "pipelined chain"),
    CollectiveModel("all_to_all", lambda N: N - 1, lambda N: (N - 1) / N, True,
                    "the send buffer on each rank (N chunks)", "pairwise exchange"),
    CollectiveModel("send_recv", lambda N: 1, lambda N: 1.0, False,
                    "what each rank sends to its neighbour", "one point-to-point hop"),
)}


def model(op: str) -> CollectiveModel:
    return COST_MODELS[check_choice("op", op, sorted(COST_MODELS))]


def coefficients(op: str, N: int) -> tuple[float, float]:
    """(a(N), b(N)): the number of α and of n·β the algorithm pays on N ranks."""
    m = model(op)
    check_int("world size N (a collective needs 2 ranks)", N, 2)
    return float(m.latency_steps(N)), float(m.bus_factor(N))


def busbw_factor(op: str, N: int) -> float:
    """nccl-tests: busbw = algbw × this factor, so that every op reports the link's speed."""
    return coefficients(op, N)[1]


def algbw_GBps(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth: message bytes over time, in GB/s (1 GB = 1e9 B)."""
    return nbytes / seconds / GB


def busbw_GBps(op: str, N: int, nbytes: float, seconds: float) -> float:
    """Bus bandwidth (nccl-tests): algbw × factor, in GB/s (1 GB = 1e9 B)."""
    return algbw_GBps(nbytes, seconds) * busbw_factor(op, N)


def predict(op: str, N: int, nbytes: float, alpha_s: float, beta_s_per_byte: float) -> float:
    a, b = coefficients(op, N)
    return a * alpha_s + b * nbytes * beta_s_per_byte


@dataclass(frozen=True)
class Fit:
    op: str
    alpha_s: float
    beta_s_per_byte: float

    @property
    def bandwidth_GBps(self) -> float:
        """1/β: the bus bandwidth a very large message approaches."""
        return 1 / self.beta_s_per_byte / GB if self.beta_s_per_byte > 0 else float("inf")

    def predict(self, N: int, nbytes: float) -> float:
        return predict(self.op, N, nbytes, self.alpha_s, self.beta_s_per_byte)

    def as_dict(self) -> dict:
        return {"alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte}


def fit_alpha_beta(op: str, points: Iterable[tuple[int, float, float]],
                   weighting: str = "relative") -> Fit:
    """Least-squares α, β ≥ 0 from measured (N, n_bytes, seconds) points of one operation.

    Each point gives one equation a(N)·α + b(N)·n·β = t. Sizes span decades, so plain
    least squares ("absolute") would fit only the largest messages and predict small ones
    with large relative errors. "relative" divides each equation by its t, minimising the
    relative error instead: every size counts the same.
    """
    check_choice("weighting", weighting, ("relative", "absolute"))
    rows, times = [], []
    for N, nbytes, seconds in points:
        check_number("measured time", seconds, 0, low_inclusive=False, unit="s")
        a, b = coefficients(op, N)
        rows.append((a, b * nbytes))
        times.append(seconds)
    if len(rows) < 2:
        raise ValueError(f"points must hold at least 2 measurements to fit α and β for {op}, "
                         f"got {len(rows)}")
    A, t = np.array(rows, dtype=float), np.array(times, dtype=float)
    w = 1 / t if weighting == "relative" else np.ones_like(t)
    # Scale the β column so both unknowns are of order one: better conditioned.
    scale = np.array([1.0, 1.0 / max(A[:, 1].max(), 1.0)])
    (x0, x1), *_ = np.linalg.lstsq(A * scale * w[:, None], t * w, rcond=None)
    alpha, beta = x0 * scale[0], x1 * scale[1]
    # A negative latency or byte cost is unphysical: pin it at zero and refit the other.
    if alpha < 0 or beta < 0:
        col = 1 if alpha < 0 else 0
        Aw, tw = A[:, col] * w, t * w
        value = max(float(Aw @ tw / (Aw @ Aw)), 0.0)
        alpha, beta = (0.0, value) if col == 1 else (value, 0.0)
    return Fit(op, float(alpha), float(beta))


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


# ----------------------------------------------------------------------------------------
# Keeping a fit for later notebooks (tensor parallelism, the simulator).
#
# The file holds one record per network level (format 2):
#     {"format": 2, "levels": {"loopback": {"backend": ..., "world_size": ..., "fit": {...}}}}
# Notebook 02 measures ranks on one machine ("loopback"); emulated nodes joined by a slower
# link write their own level ("link"). A file of format 1 is one record with "fit" at the top:
# it reads as the "loopback" level.
# ----------------------------------------------------------------------------------------

RESULTS_ENV = "PLAB_RESULTS_DIR"
FIT_FILE = "collective_fit.json"
DEFAULT_LEVEL = "loopback"


def results_dir() -> Path:
    """Where measured results are kept: $PLAB_RESULTS_DIR when set; else results/ at the root
    of the checkout this package sits in (the folder holding pyproject.toml above helpers/);
    else, for a package installed outside a checkout, the user's data folder."""
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV]).expanduser()
    root = Path(__file__).resolve().parents[2]  # helpers/cost/alpha_beta.py -> the root
    if (root / "pyproject.toml").is_file():
        return root / "results"
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "parallelism-lab" / "results"


def default_fit_path() -> Path:
    """results/collective_fit.json at the repository root (results/ is not committed);
    see `results_dir` for where it goes otherwise."""
    return results_dir() / FIT_FILE


def _fit_entries_ok(fit) -> bool:
    return isinstance(fit, dict) and all(
        isinstance(v, dict) and all(
            isinstance(v.get(k), (int, float)) and not isinstance(v.get(k), bool)
            for k in ("alpha_s", "beta_s_per_byte"))
        for v in fit.values())


def _read_levels(path: Path) -> dict[str, dict] | None:
    """The file's records by level; {} when there is no file; None (after one warning
    naming the file) when it is corrupt, half-written or not a fit file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        levels = {DEFAULT_LEVEL: data} if "fit" in data else data.get("levels")  # format 1, 2
        if not isinstance(levels, dict) or not all(
                isinstance(r, dict) and _fit_entries_ok(r.get("fit")) for r in levels.values()):
            raise ValueError("no fit records in it")
    # JSON and UTF-8 errors are ValueErrors; deep nesting a RecursionError
    except (OSError, ValueError, RecursionError) as e:
        what = "cannot be read" if isinstance(e, OSError) else "is corrupt or half-written"
        warnings.warn(f"fit file {path} {what} ({type(e).__name__}: {e}); ignoring it (run "
                      "notebook 02 again to write a new one)", stacklevel=3)
        return None
    return levels


def _write_atomically(path: Path, text: str) -> None:
    """A temporary file in the same folder, flushed to disk, then renamed over `path`: a
    reader sees the old file or the new one, never half of one, and an interrupted write
    leaves the old file as it was."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_fit(fits: dict[str, Fit], backend: str, world_size: int, cores_per_rank: int | None,
             path: str | os.PathLike | None = None, level: str = DEFAULT_LEVEL,
             **extra) -> Path:
    """Write `fits` as the record of network `level`, keeping the other levels' records (a
    corrupt file is replaced). Two processes saving different levels at the same moment
    leave a whole file, but only the level of the one that renames last."""
    if not isinstance(level, str) or not level:
        raise ValueError(f"level must be a non-empty name such as {DEFAULT_LEVEL!r} or 'link' "
                         f"(got {level!r})")
    path = Path(path) if path is not None else default_fit_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    levels = _read_levels(path) or {}
    levels[level] = {"backend": backend, "world_size": world_size,
                     "cores_per_rank": cores_per_rank,
                     "fit": {op: f.as_dict() for op, f in fits.items()}, **extra}
    _write_atomically(path, json.dumps({"format": 2, "levels": levels}, indent=1) + "\n")
    return path


def load_fit(path: str | os.PathLike | None = None, level: str = DEFAULT_LEVEL) -> dict | None:
    """The saved record of network `level` as a dict ("backend", "world_size",
    "cores_per_rank", "fit", ...), or None when none was saved (run notebook 02 first) or
    the file is corrupt (a warning names it)."""
    path = Path(path) if path is not None else default_fit_path()
    levels = _read_levels(path)
    return None if levels is None else levels.get(level)


def fits_from_record(record: dict) -> dict[str, Fit]:
    """Turn a loaded record's "fit" back into `Fit` objects."""
    return {op: Fit(op, v["alpha_s"], v["beta_s_per_byte"]) for op, v in record["fit"].items()}


# ----------------------------------------------------------------------------------------
# Two network levels: ranks on nodes.
#
# A placement gives the node of each rank: (0, 0, 1, 1) is 2 nodes of 2 ranks. Inside a node
# ranks talk over the fast level (NVLink; loopback on emulated nodes), between nodes over the
# node's uplink (InfiniBand; the shaped link). Bytes are counted per node uplink, one
# direction: what the node sends. On emulated nodes the k ranks of a node share one uplink
# (helpers.launch.cluster); an H100 node gives each GPU its own NIC, so there k streams that
# cross at once each have a NIC, and the uplink counts below are k NICs' bytes together.
# ----------------------------------------------------------------------------------------

def node_blocks(placement: tuple[int, ...]) -> list[list[int]]:
    """The ranks of each node, in rank order: (0, 1, 0, 1) -> [[0, 2], [1, 3]]."""
    placement = _check_placement(placement)
    return [[r for r, node in enumerate(placement) if node == i]
            for i in range(max(placement) + 1)]


def cross_blocks(placement: tuple[int, ...]) -> list[list[int]]:
    """The j-th rank of every node, for each j: the groups a hierarchical all-reduce runs its
    across-nodes step on ((0, 0, 1, 1) -> [[0, 2], [1, 3]])."""
    nodes = node_blocks(placement)
    return [[block[j] for block in nodes] for j in range(len(nodes[0]))]


def ring_crossings(placement: tuple[int, ...]) -> list[int]:
    """Per node, how many hops of the flat ring (rank r sends to r+1, the last to 0) leave it."""
    placement = _check_placement(placement)
    world_size = len(placement)
    out = [0] * (max(placement) + 1)
    for r in range(world_size):
        if placement[r] != placement[(r + 1) % world_size]:
            out[placement[r]] += 1
    return out


def flat_uplink_bytes(nbytes: float, placement: tuple[int, ...]) -> list[float]:
    """Bytes each node's uplink sends in one flat ring all-reduce of `nbytes` per rank.

    Every rank sends 2(P−1)/P · n to its successor (P = all ranks); a node's uplink carries that
    for each ring hop that leaves the node. Consecutive ranks on a node: one hop per node, so
    2(P−1)/P · n; ranks alternating between 2 nodes: every hop crosses, k times that."""
    world_size = len(placement)
    per_hop = 2 * (world_size - 1) / world_size * nbytes
    return [hops * per_hop for hops in ring_crossings(placement)]


def hierarchical_uplink_bytes(nbytes: float, placement: tuple[int, ...]) -> list[float]:
    """Bytes each node's uplink sends in one hierarchical all-reduce of `nbytes` per rank.

    Only the middle step crosses: each of a node's k ranks all-reduces its n/k shard with its
    peers on the N−1 other nodes, sending 2(N−1)/N · n/k; k of them: 2(N−1)/N · n per node,
    whatever k is. The reduce-scatter and all-gather stay inside the node."""
    nodes = len(node_blocks(placement))
    return [2 * (nodes - 1) / nodes * nbytes] * nodes


def predict_flat_all_reduce(nbytes: float, placement: tuple[int, ...], link: Fit) -> float:
    """A flat ring all-reduce on P ranks whose slowest hop crosses the link, in seconds.

    The ring moves in 2(P−1) lock-step steps of n/P bytes per rank; a step ends when its slowest
    hop does, and the slowest hop is the busiest uplink's: c hops share it (c from
    `ring_crossings`), so a step costs α + c · n/P · β with the link's α, β (fitted with one rank
    per node, where c = 1)."""
    world_size, crossing = len(placement), max(ring_crossings(placement))
    if crossing == 0:
        raise ValueError(f"placement {placement} puts every rank on one node: no hop crosses the link")
    return 2 * (world_size - 1) * (link.alpha_s + crossing * nbytes / world_size * link.beta_s_per_byte)


def predict_hierarchical_all_reduce(nbytes: float, placement: tuple[int, ...],
                                    inside: dict[str, Fit], link: Fit) -> float:
    """Reduce-scatter inside each node, all-reduce across, all-gather inside, in seconds.

    inside: the fast level's fits of "reduce_scatter" and "all_gather" (k ranks, n bytes);
    link:   the link's all-reduce fit (one rank per node). The k shard all-reduces of n/k
            bytes run at once over the node's one uplink, so together they cost a single
            all-reduce of n on N ranks (2(N−1)/N · n bytes per uplink), each paying the
            2(N−1) latencies at the same time."""
    blocks = node_blocks(placement)
    nodes, k = len(blocks), len(blocks[0])
    if nodes < 2 or k < 2:
        raise ValueError(f"a hierarchical all-reduce needs 2 or more nodes of 2 or more ranks; "
                         f"placement {placement} has {nodes} node(s) of {k}")
    across = 2 * (nodes - 1) * link.alpha_s + 2 * (nodes - 1) / nodes * nbytes * link.beta_s_per_byte
    return inside["reduce_scatter"].predict(k, nbytes) + across + inside["all_gather"].predict(k, nbytes)


def _check_placement(placement) -> tuple[int, ...]:
    placement = tuple(placement)
    ok = len(placement) >= 2 and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                     for n in placement)
    counts = [placement.count(i) for i in range(max(placement) + 1)] if ok else []
    ok = ok and min(counts) == max(counts) > 0
    if not ok:
        raise ValueError("placement must give each rank a node 0 … N−1, as many ranks on every "
                         f"node, got {placement!r}")
    return placement
