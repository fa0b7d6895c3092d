"""What a reader's code hands to torch.distributed, recorded on the rank while an exercise runs.

A checker must tell a right answer from right numbers got the wrong way: a ring all-reduce that
calls `dist.all_reduce`, an average taken over the whole world instead of the data group, a
result computed from data the rank was never meant to need. So while the reader's function runs,
every public call of torch.distributed that moves data is wrapped and logged (`Call`): its kind,
the bytes and shape it was handed, the peer, the group's ranks, the reduce op. A call the
recording wrapper makes itself (the checked-collectives comparison, a collective built on
another) is logged once, at the outermost call.

Arguments are read by their names (`signature.bind`), however the reader passed them: a group
given by position, a peer given as `group_dst=` (a rank within the group) are logged alike.
`dist.P2POp` accepts only torch's own `isend` and `irecv`: the wrappers compare equal to the
functions they wrap, so `P2POp(dist.isend, ...)` in the reader's code still passes that check;
`batch_isend_irecv` logs each isend and irecv of its list and gives torch its own functions back.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass

# The parameter holding the data a call moves ("what left here"), by the names torch gives them.
_DATA_PARAM = {
    "all_reduce": "tensor", "reduce": "tensor", "broadcast": "tensor", "send": "tensor",
    "recv": "tensor", "isend": "tensor", "irecv": "tensor", "gather": "tensor",
    "all_gather": "tensor", "reduce_scatter": "input_list", "all_to_all": "input_tensor_list",
    "scatter": "scatter_list", "barrier": None,
    # torch 2.13's single-tensor names, and the older aliases it still accepts
    "all_gather_single": "input_tensor", "all_gather_into_tensor": "input_tensor",
    "reduce_scatter_single": "input", "reduce_scatter_tensor": "input",
    "all_to_all_single": "input",
}
_REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_single",
             "reduce_scatter_tensor")


@dataclass(frozen=True)
class Call:
    """One call the reader's code made: `nbytes` is the data it handed over (the tensor of an
    all-reduce, send or recv; the input of an all-gather, reduce-scatter or all-to-all; the
    list's total where it takes a list), `total` the sum of those values (to tell which data
    went, where two tensors have the same size)."""
    op: str
    nbytes: int
    shape: tuple
    dtype: str
    peer: int | None = None             # send/recv: the other rank (its global rank)
    group: tuple[int, ...] | None = None  # the group's ranks (None: the default group)
    reduce_op: str | None = None
    total: float = 0.0

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


def _call(op: str, data, peer, group, reduce_op=None) -> Call:
    """A Call from what the arguments mean: `peer` is a global rank (or None)."""
    import torch
    import torch.distributed as dist
    tensors = _tensors(data)
    members = None
    if group is not None and group is not dist.group.WORLD:
        members = tuple(dist.get_process_group_ranks(group))
    with torch.no_grad():
        total = float(sum(float(t.detach().double().sum()) for t in tensors if t.numel()))
    return Call(op=op, nbytes=sum(t.numel() * t.element_size() for t in tensors),
                shape=tuple(tensors[0].shape) if len(tensors) == 1 else (len(tensors),),
                dtype=str(tensors[0].dtype).removeprefix("torch.") if tensors else "",
                peer=peer, group=members,
                reduce_op=None if reduce_op is None else str(reduce_op).rsplit(".", 1)[-1],
                total=total)


def _describe(op: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> Call:
    """Read the call's arguments by their names, however they were passed."""
    import torch.distributed as dist
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:  # torch will raise its own error for this call
        return Call(op=op, nbytes=0, shape=(), dtype="")
    bound.apply_defaults()
    given = bound.arguments
    group = given.get("group")
    peer = next((given[k] for k in ("dst", "src") if given.get(k) is not None), None)
    for key in ("group_dst", "group_src"):
        if peer is None and given.get(key) is not None:
            peer = dist.get_global_rank(group or dist.group.WORLD, given[key])
    name = _DATA_PARAM.get(op)
    return _call(op, given.get(name) if name else None, peer, group,
                 given.get("op") if op in _REDUCING else None)


class _Logged:
    """A torch.distributed function that logs its calls; equal to the function it wraps (see
    the module's note on P2POp)."""

    def __init__(self, op: str, real, log: list, inside: threading.local):
        self.op, self.real, self.log, self.inside = op, real, log, inside
        self.signature = inspect.signature(real)
        self.__wrapped__ = real
        self.__name__ = getattr(real, "__name__", op)

    def __call__(self, *args, **kwargs):
        if getattr(self.inside, "busy", False):
            return self.real(*args, **kwargs)
        self.log.append(_describe(self.op, self.signature, args, kwargs))
        self.inside.busy = True
        try:
            return self.real(*args, **kwargs)
        finally:
            self.inside.busy = False

    def __eq__(self, other) -> bool:
        return other is self or other is self.real

    def __hash__(self) -> int:
        return hash(self.real)


class _LoggedBatch:
    """`batch_isend_irecv`: logs each P2POp as the isend or irecv it runs, then hands torch its
    own functions back (it picks the peer's keyword by `op is isend`)."""

    def __init__(self, real, log: list, inside: threading.local):
        self.real, self.log, self.inside = real, log, inside
        self.__wrapped__ = real

    def __call__(self, p2p_op_list):
        import torch.distributed as dist
        for item in p2p_op_list:
            own = getattr(item.op, "real", item.op)  # ours, or torch's own
            sending = own is getattr(dist.isend, "real", dist.isend)
            if not getattr(self.inside, "busy", False):
                self.log.append(_call("isend" if sending else "irecv", item.tensor, item.peer,
                                      item.group))
            item.op = own
        self.inside.busy = True
        try:
            return self.real(p2p_op_list)
        finally:
            self.inside.busy = False


@contextlib.contextmanager
def recorded_calls():
    """`with recorded_calls() as calls:` logs, in `calls`, what the code inside hands to
    torch.distributed through its module (`dist.all_reduce(...)`)."""
    import torch.distributed as dist
    calls: list[Call] = []
    inside = threading.local()
    saved = {}
    for op in _DATA_PARAM:
        real = getattr(dist, op, None)
        if real is not None:
            saved[op] = real
            setattr(dist, op, _Logged(op, real, calls, inside))
    saved["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = _LoggedBatch(dist.batch_isend_irecv, calls, inside)
    try:
        yield calls
    finally:
        for op, real in saved.items():
            setattr(dist, op, real)
