"""What a reader's code hands to torch.distributed, recorded on the rank while an exercise runs.

A checker must tell a right answer from right numbers got the wrong way: a ring all-reduce that
calls `dist.all_reduce`, an average taken over the whole world instead of the data group, a
result computed from data the rank was never meant to need. So while the reader's function runs,
every public call of torch.distributed that moves data is wrapped and logged (`Call`): its kind,
the bytes and shape it was handed, the peer, the group's ranks, the reduce op. A call the
recording wrapper makes itself (the checked-collectives comparison, a collective built on
another) is logged once, at the outermost call.

`dist.P2POp` accepts only torch's own `isend` and `irecv`: the wrappers compare equal to the
functions they wrap, so `P2POp(dist.isend, ...)` in the reader's code still passes that check,
and `batch_isend_irecv` then logs each isend and irecv it runs.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

# Where the tensor a call moves sits in its arguments, and what it means for `nbytes`.
_DATA_ARG = {
    "all_reduce": 0, "reduce": 0, "broadcast": 0, "send": 0, "recv": 0, "isend": 0, "irecv": 0,
    # torch 2.13's single-tensor names, and the older aliases it still accepts
    "all_gather": 1, "all_gather_single": 1, "all_gather_into_tensor": 1, "reduce_scatter": 1,
    "reduce_scatter_single": 1, "reduce_scatter_tensor": 1, "all_to_all": 1,
    "all_to_all_single": 1, "gather": 0,
    "scatter": 1, "barrier": None,
}
_PEER_ARG = {"send": ("dst", 1), "recv": ("src", 1), "isend": ("dst", 1), "irecv": ("src", 1)}


@dataclass(frozen=True)
class Call:
    """One call the reader's code made: `nbytes` is the data it handed over (the tensor of an
    all-reduce, send or recv; the input of an all-gather, reduce-scatter or all-to-all; the
    list's total where it takes a list)."""
    op: str
    nbytes: int
    shape: tuple
    dtype: str
    peer: int | None = None             # send/recv: the other rank
    group: tuple[int, ...] | None = None  # the group's ranks (None: the default group)
    reduce_op: str | None = None

    def __str__(self) -> str:
        where = f" to/from rank {self.peer}" if self.peer is not None else ""
        group = f" on group {list(self.group)}" if self.group else ""
        return f"{self.op}({self.dtype}{list(self.shape)}){where}{group}"


def _tensors(value) -> list:
    import torch
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _describe(op: str, args: tuple, kwargs: dict) -> Call:
    import torch.distributed as dist
    index = _DATA_ARG.get(op)
    data = args[index] if index is not None and len(args) > index else None
    if data is None and index is not None:
        data = next((v for k, v in kwargs.items() if k in ("tensor", "input", "input_tensor",
                                                            "input_tensor_list")), None)
    tensors = _tensors(data)
    peer = None
    if op in _PEER_ARG:
        name, position = _PEER_ARG[op]
        peer = kwargs.get(name, args[position] if len(args) > position else None)
    group = kwargs.get("group", None)
    members = None
    if group is not None and group is not dist.group.WORLD:
        members = tuple(dist.get_process_group_ranks(group))
    reduce_op = kwargs.get("op")
    if reduce_op is None and op in ("all_reduce", "reduce_scatter", "reduce_scatter_single",
                                    "reduce_scatter_tensor"):
        position = 1 if op == "all_reduce" else 2
        reduce_op = args[position] if len(args) > position else dist.ReduceOp.SUM
    return Call(op=op, nbytes=sum(t.numel() * t.element_size() for t in tensors),
                shape=tuple(tensors[0].shape) if len(tensors) == 1 else (len(tensors),),
                dtype=str(tensors[0].dtype).removeprefix("torch.") if tensors else "",
                peer=peer, group=members,
                reduce_op=None if reduce_op is None else str(reduce_op).rsplit(".", 1)[-1])


class _Logged:
    """A torch.distributed function that logs its calls; equal to the function it wraps (see
    the module's note on P2POp)."""

    def __init__(self, op: str, real, log: list, inside: threading.local):
        self.op, self.real, self.log, self.inside = op, real, log, inside
        self.__wrapped__ = real
        self.__name__ = getattr(real, "__name__", op)

    def __call__(self, *args, **kwargs):
        if getattr(self.inside, "busy", False):
            return self.real(*args, **kwargs)
        self.log.append(_describe(self.op, args, kwargs))
        self.inside.busy = True
        try:
            return self.real(*args, **kwargs)
        finally:
            self.inside.busy = False

    def __eq__(self, other) -> bool:
        return other is self or other is self.real

    def __hash__(self) -> int:
        return hash(self.real)


@contextlib.contextmanager
def recorded_calls():
    """`with recorded_calls() as calls:` logs, in `calls`, what the code inside hands to
    torch.distributed through its module (`dist.all_reduce(...)`)."""
    import torch.distributed as dist
    calls: list[Call] = []
    inside = threading.local()
    saved = {}
    for op in _DATA_ARG:
        real = getattr(dist, op, None)
        if real is not None:
            saved[op] = real
            setattr(dist, op, _Logged(op, real, calls, inside))
    try:
        yield calls
    finally:
        for op, real in saved.items():
            setattr(dist, op, real)
