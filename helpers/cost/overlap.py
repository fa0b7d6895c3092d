"""Data parallelism's overlap model: how much of a step's gradient all-reduces backward hides,
when every rank has one processor for its compute and a link of its own (a GPU's SMs and its
NVLink), replayed from the pieces' durations.

Backward produces the gradients last layer first. A bucket's all-reduce can start once its last
gradient exists and the link has finished the bucket before it (every rank launches buckets in
the same order, one at a time on its link). `NaiveDDP` and `FlatDDP` launch nothing before
backward ends. The step exposes the time from the end of backward to the end of the last
all-reduce; everything before that ran beside backward.

Notebook 03 replays this machine's measured pieces (one layer's backward, an all-reduce measured
alone) and an H100's predicted ones, beside the steps it measured.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

from helpers.checks import check_int, check_number

OVERLAPPED = {"naive": False, "flat": False, "overlap": True, "bucketed": True}


@dataclass(frozen=True)
class Replay:
    """One step's backward and all-reduces on one processor and one link, seconds from the start
    of backward."""
    backward_s: float                              # when backward ends
    reduces: tuple[tuple[float, float], ...]       # (start, end) of each bucket's all-reduce

    @property
    def exposed_s(self) -> float:
        """Communication the step waits for after backward: what overlap did not hide."""
        return max(0.0, self.reduces[-1][1] - self.backward_s) if self.reduces else 0.0


def replay(layer_backward_s: Sequence[float], buckets: Sequence[int],
           reduce_s: Sequence[float], overlapped: bool) -> Replay:
    """The overlap model's step.

    layer_backward_s  each layer's backward, seconds, in the order backward runs (last layer first)
    buckets           layers per bucket, in that order (they add up to the layers)
    reduce_s          each bucket's all-reduce, seconds, as it takes alone on the link
    overlapped        launch a bucket as soon as it is full (OverlapDDP, BucketedDDP), or all of
                      them once backward has ended (NaiveDDP, FlatDDP)
    """
    check_buckets(layer_backward_s, buckets, reduce_s)
    ends = list(accumulate(layer_backward_s))          # when each layer's gradient exists
    last_layer = list(accumulate(buckets))             # each bucket's last layer, counted from 1
    ready = [ends[k - 1] if overlapped else ends[-1] for k in last_layer]
    reduces, link_free = [], 0.0
    for r, seconds in zip(ready, reduce_s):
        start = max(r, link_free)          # the bucket is full and the bucket before it is done
        link_free = start + seconds
        reduces.append((start, link_free))
    return Replay(ends[-1], tuple(reduces))


def bucket_layers(variant: str, layer_bytes: Sequence[int], bucket_bytes: int) -> tuple[int, ...]:
    """Layers per bucket for one of notebook 03's wrappers, in backward's order (`layer_bytes` is
    in that order): NaiveDDP and OverlapDDP one layer each, FlatDDP one bucket, BucketedDDP
    filling a bucket while it stays ≤ bucket_bytes (a bigger layer goes alone)."""
    if variant not in OVERLAPPED:
        raise ValueError(f"variant must be one of {', '.join(OVERLAPPED)}; got {variant!r}")
    check_int("bucket_bytes", bucket_bytes, 1)
    if variant in ("naive", "overlap"):
        return (1,) * len(layer_bytes)
    if variant == "flat":
        return (len(layer_bytes),)
    sizes, fill = [], 0
    for n in layer_bytes:
        if sizes and fill + n <= bucket_bytes:
            sizes[-1], fill = sizes[-1] + 1, fill + n
        else:
            sizes.append(1)
            fill = n
    return tuple(sizes)


def check_buckets(layer_backward_s, buckets, reduce_s) -> None:
    """One clear error for a replay whose pieces do not fit together."""
    if not layer_backward_s:
        raise ValueError("layer_backward_s must list at least one layer's backward")
    for s in layer_backward_s:
        check_number("layer_backward_s", s, 0, unit="seconds")
    for n in buckets:
        check_int("buckets (layers per bucket)", n, 1)
    if sum(buckets) != len(layer_backward_s):
        raise ValueError(f"buckets must add up to the {len(layer_backward_s)} layers; "
                         f"they add up to {sum(buckets)}")
    if len(reduce_s) != len(buckets):
        raise ValueError(f"reduce_s must give one all-reduce per bucket ({len(buckets)}); "
                         f"got {len(reduce_s)}")
    for s in reduce_s:
        check_number("reduce_s", s, 0, unit="seconds")

