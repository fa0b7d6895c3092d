"""The rank side: a process that joins a process group and runs whatever the notebook sends.

Messages are (request id, kind, args); replies are (request id, status, data, out, err,
module files), the status "ok", "error" or "timeout" (the rank classifies its own exception:
see `_status`). A result follows its reply as frames written on the pipe (`Frames`): the
pickle, then each tensor's memory as it lies, so it crosses as bytes once.
A rank starts in one of two ways, both from a boot string run as `python -c`:
* `LAUNCHER_BOOT` starts a launcher (Linux): it imports torch once, then forks a rank per
  request, so a rank starts in tens of milliseconds instead of importing torch again (about
  2 s of CPU each: 8 ranks on 2 cores took 8 s to start). It is the ranks' parent and reaps
  each only when the notebook asks, so a pid the notebook may signal is never reused.
* `BOOT` starts one rank directly (elsewhere: on macOS forking after importing torch is not
  safe).

Why a rank is built this way:
* It dies with the process that owns it: PR_SET_PDEATHSIG when it was started from the
  owner's main thread (the signal follows the creating *thread*), and always a watchdog
  thread.
* It publishes the collective it is inside to a few bytes of a file the notebook maps too,
  so a hang or a crash names the operation.
* With checked collectives on (`LiveRanks(..., check_collectives=True)`), the same wrapper
  compares each collective across its group before it runs (`_check_collective`).
* Its file descriptor 2 goes to a file the notebook reads when the rank dies, so gloo's own
  words before it aborts a rank reach the RankError; it dumps no core.
* It prints into a buffer that goes back with the reply; the notebook prints every rank's
  output once, in rank order.
* It ignores SIGINT: the notebook decides what an interrupt kills.
* Every reply lists the reader's and the project's module files it imported since the last
  one (helpers.launch.shipping), so the notebook can tell when the code it runs changed on
  disk.
* The process group the lab formed stays the default one (`_tidy_groups`): after a call, a
  rank reports whether the function destroyed or replaced it (the notebook forms the lab's
  again), and destroys the sub-groups it created and left behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import io
import mmap
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import typing
from datetime import timedelta

from helpers.launch.host import threads_per_rank
from helpers.launch.shipping import dumps_frames, new_module_files, write_frames

_OP_SLOT_BYTES = 64
# The process-group timeout used for timeout=None: long enough never to matter in a course.
_NO_TIMEOUT = timedelta(days=365)
# The default process group this rank's lab formed ("group"), to tell it from a student's,
# and its timeout in seconds ("timeout", None for none).
_LAB: dict = {}

_COLLECTIVES = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_gather_single", "all_to_all", "all_to_all_single",
    # Not isend/irecv: they return at once (nothing to publish), and dist.P2POp checks
    # that it was given the very functions torch defines.
    "barrier", "send", "recv", "batch_isend_irecv", "broadcast_object_list",
    "all_gather_object", "gather_object", "scatter_object_list", "monitored_barrier",
)


class OpSlot:
    """A few bytes of a file both sides map: the name of the collective a rank is inside,
    readable by the parent even while the rank is stuck in it (or after it died)."""

    def __init__(self, path: str, create: bool = False):
        if create:
            with open(path, "wb") as f:
                f.write(bytes(_OP_SLOT_BYTES))
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _OP_SLOT_BYTES)

    @property
    def value(self) -> bytes:
        return bytes(self._map[:]).split(b"\0", 1)[0]

    @value.setter
    def value(self, name: bytes) -> None:
        self._map[:] = name[: _OP_SLOT_BYTES - 1].ljust(_OP_SLOT_BYTES, b"\0")

    def close(self) -> None:
        self._map.close()


def _publish_current_op(op_slot) -> None:
    """Wrap torch.distributed's collectives so the parent can see which one a rank is in, and
    so that, with checked collectives on (`_CHECKED`), each is compared across its group
    first (`_check_collective`). An exception a collective raises is marked with its name and
    how long it waited, for `_status`."""
    import inspect

    import torch.distributed as dist

    def wrap(name, real):
        signature = inspect.signature(real)

        @functools.wraps(real)
        def wrapper(*args, **kwargs):
            op_slot.value = name.encode()
            started = time.monotonic()
            try:
                if _CHECKED["on"] and name not in _UNCHECKED:
                    bound = signature.bind(*args, **kwargs)
                    bound.apply_defaults()
                    _check_collective(name, bound.arguments)
                result = real(*args, **kwargs)
            except BaseException as error:
                with contextlib.suppress(Exception):  # some exceptions take no attributes
                    error.__collective__ = (name, time.monotonic() - started,
                                            _own_timeout(signature, args, kwargs))
                raise
            op_slot.value = b""
            return result
        wrapper.__wrapped_collective__ = real
        return wrapper

    for name in _COLLECTIVES:
        real = getattr(dist, name, None)
        if real is not None and not hasattr(real, "__wrapped_collective__"):
            setattr(dist, name, wrap(name, real))


def _own_timeout(signature, args: tuple, kwargs: dict) -> float | None:
    """The `timeout=` a call gave itself (barrier and monitored_barrier take one), in seconds."""
    if "timeout" not in signature.parameters:
        return None
    try:
        limit = signature.bind(*args, **kwargs).arguments.get("timeout")
    except TypeError:
        return None
    return limit.total_seconds() if isinstance(limit, timedelta) else None


# -- checked collectives ----------------------------------------------------------------------

class CollectiveMismatchError(RuntimeError):
    """Checked collectives: the ranks of a group called one collective with different kinds,
    reduce ops, roots, dtypes, shapes or groups, or at different points in their sequence."""


# Whether collectives are checked on this rank (set when the lab forms its group), and each
# group's count of checked calls so far, by the group's name.
_CHECKED: dict = {"on": False, "calls": {}}
# Point-to-point calls end by timeout instead: a pair has no group of its own to compare in.
_UNCHECKED = {"send", "recv", "batch_isend_irecv"}
# The tensor argument whose dtype and shape must agree; None where only the dtype must
# (all_to_all's pieces may differ in size from rank to rank). Object collectives compare the
# kind, root, group and sequence only: their objects may differ.
_COMPARED_TENSOR = {
    "broadcast": ("tensor", True), "all_reduce": ("tensor", True), "reduce": ("tensor", True),
    "all_gather": ("tensor", True), "all_gather_into_tensor": ("input_tensor", True),
    "gather": ("tensor", True), "scatter": ("tensor", True),
    "reduce_scatter": ("output", True), "reduce_scatter_tensor": ("input", True),
    "reduce_scatter_single": ("input", True), "all_gather_single": ("input_tensor", True),
    "all_to_all": ("input_tensor_list", False), "all_to_all_single": ("input", False),
}
_ROOTS = ("src", "dst", "group_src", "group_dst")
_FIELDS = ("kind", "op", "root", "dtype", "shape", "group", "sequence")


def _fingerprint(name: str, arguments: dict) -> tuple[dict, object]:
    """What must agree across a group's ranks for the call `name(**arguments)`, in words, and
    the group it runs in."""
    import torch.distributed as dist
    group = arguments.get("group") or dist.group.WORLD
    key = dist.distributed_c10d._get_process_group_name(group)
    calls = _CHECKED["calls"]
    calls[key] = calls.get(key, 0) + 1
    found = {"kind": name, "sequence": calls[key],
             "group": str(dist.get_process_group_ranks(group)),
             "op": str(arguments.get("op", "")).replace("RedOpType.", "ReduceOp."),
             "root": ", ".join(f"{r}={arguments[r]}" for r in _ROOTS
                               if arguments.get(r) is not None),
             "dtype": "", "shape": ""}
    argument, with_shape = _COMPARED_TENSOR.get(name, (None, False))
    tensor = arguments.get(argument)
    if isinstance(tensor, (list, tuple)):
        tensor = tensor[0] if tensor else None
    if tensor is not None and hasattr(tensor, "dtype"):
        found["dtype"] = str(tensor.dtype)
        found["shape"] = str(tuple(tensor.shape)) if with_shape else ""
    return found, group


def _check_collective(name: str, arguments: dict) -> None:
    """Compare this call with the same call on the group's other ranks before it runs. One
    small all_reduce on the call's group (MAX of the fields' hash and of its negation: they
    agree everywhere when the largest and the smallest hash are the same); only when they
    differ are the fields themselves gathered, and every rank raises the same error."""
    import zlib

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    found, group = _fingerprint(name, arguments)
    text = "\0".join(str(found[f]) for f in _FIELDS).encode()
    digest = (zlib.crc32(text) << 31) ^ zlib.adler32(text)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    c10d.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)  # torch's own, not wrapped
    if int(extremes[0]) == -int(extremes[1]):
        return
    found_by_rank = [None] * dist.get_world_size(group)
    c10d.all_gather_object(found_by_rank, found, group=group)
    raise CollectiveMismatchError(_mismatch(name, found_by_rank,
                                            dist.get_process_group_ranks(group)))


def _mismatch(name: str, found_by_rank: list[dict], ranks: list[int]) -> str:
    """'checked collectives: all_reduce called differently by the ranks of group [0, 1]' and
    a line per field that differs ('  dtype: torch.float32 on rank(s) [0], torch.float64 on
    rank(s) [1]'): the same text on every rank."""
    kinds = {found["kind"] for found in found_by_rank}
    what = f"{name} called differently" if len(kinds) == 1 else "different collectives called"
    lines = [f"checked collectives: {what} by the ranks of group {ranks}"]
    # Different kinds: their other fields differ as a consequence, and would only be noise.
    for field in _FIELDS if len(kinds) == 1 else ("kind", "group", "sequence"):
        values: dict[str, list[int]] = {}
        for rank, found in zip(ranks, found_by_rank):
            values.setdefault(str(found[field]) or "(none)", []).append(rank)
        if len(values) > 1:
            lines.append(f"  {field}: " + ", ".join(f"{value} on rank(s) {who}"
                                                    for value, who in values.items()))
    return "\n".join(lines)


def _die_with_parent(parent_pid: int, pdeathsig: bool) -> None:
    # PR_SET_PDEATHSIG fires when the *thread* that started us ends, so the parent asks
    # for it only when that thread is its main thread (whose end is the process's end).
    if pdeathsig and sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    # Always poll too: covers other platforms and ranks started from other threads.
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)
    threading.Thread(target=watch, daemon=True).start()


def _to_cpu(value):
    """A result's tensors on the CPU, each alone in its storage: a tensor pickles with its
    whole storage, so a small view of a large tensor is copied out first."""
    import torch
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if (value.layout == torch.strided
                and value.untyped_storage().nbytes() > value.numel() * value.element_size()):
            value = value.clone()
        return value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _init_group(index: int, world_size: int, store_path: str, backend: str,
                timeout: float | None, checked: bool = False) -> None:
    import torch
    import torch.distributed as dist
    _leave_group(index)
    torch.set_num_threads(threads_per_rank(world_size))
    if backend == "nccl":
        torch.cuda.set_device(index)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=index, world_size=world_size,
                            timeout=_NO_TIMEOUT if timeout is None else timedelta(seconds=timeout))
    _LAB.update(group=dist.group.WORLD, timeout=timeout)
    _CHECKED.update(on=checked, calls={})


def _leave_group(index: int) -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


class Frames(typing.NamedTuple):
    """In a reply, where the data will be: in the frames that follow it on the pipe, of these
    sizes (the result as `shipping.dumps_frames` cut it: sent as bytes, once)."""
    sizes: tuple[int, ...]


def _run_function(index: int, payload: bytes) -> tuple[list, str | None]:
    """(the result's frames, what became of the lab's default group: see `_tidy_groups`)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    fn, args, kwargs = pickle.loads(payload)
    before = set(c10d._world.pg_map)
    frames = dumps_frames(_to_cpu(fn(index, dist.get_world_size(), *args, **kwargs)))
    return frames, _tidy_groups(before)


def _tidy_groups(before: set) -> str | None:
    """After a rank function returned: "destroyed" or "replaced" when it did that to the lab's
    default group (the notebook forms the lab's again before the next call), else None. The
    sub-groups it created that nothing but torch's own registry refers to any more are
    destroyed (each holds connections to its peers); one it kept (in a rank-side cache, as
    helpers.labs.layouts keeps its layouts' groups) stays."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    if not dist.is_initialized():
        return "destroyed"
    if dist.group.WORLD is not _LAB.get("group"):
        return "replaced"
    for group in _abandoned([g for g in c10d._world.pg_map if g not in before]):
        dist.destroy_process_group(group)
    return None


def _abandoned(groups: list) -> list:
    """The groups of `groups` that only torch's registry and this list refer to."""
    import gc
    import types
    from torch.distributed import distributed_c10d as c10d
    if not groups:
        return []
    # torch's own containers: c10d's module-level tables (_pg_map, _pg_names, ...), the
    # _World's, and the lists of tags_to_pg.
    tables = [*vars(c10d).values(), *vars(c10d._world).values()]
    registry = [t for t in tables if type(t) in (dict, list)]  # type(): no deprecated getattr
    registry += list(c10d._world.tags_to_pg.values())
    ours = {id(c) for c in registry} | {id(groups)}
    named = _names_in_device_meshes()  # a DeviceMesh keeps its groups by name, not by reference
    return [g for g in groups if c10d._get_process_group_name(g) not in named
            and all(id(r) in ours or isinstance(r, types.FrameType) for r in gc.get_referrers(g))]


def _names_in_device_meshes() -> set:
    """The names of the groups any live DeviceMesh uses (torch keeps meshes of its own, for
    reuse by a later `init_device_mesh`): destroying one breaks the next call that meets it."""
    import gc
    import sys
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    if mesh_module is None:  # no mesh was ever made on this rank
        return set()
    # type(), not isinstance: DeviceMesh's metaclass would look into every object, and
    # torch.distributed's deprecated `reduce_op` among them warns when looked at.
    meshes = (o for o in gc.get_objects() if issubclass(type(o), mesh_module.DeviceMesh))
    return {name for mesh in meshes for name in getattr(mesh, "_dim_group_names", ())}


_HANDLERS = {"init": _init_group, "leave": _leave_group, "run": _run_function}


def _handle(index: int, kind: str, args: tuple) -> tuple:
    """(status, data, out, err): data is the pickled result, or the traceback on an error;
    the status is "ok", "error" or "timeout" (`_status`). After a timeout, data is
    (traceback, the seconds the collective was allowed)."""
    out, err = io.StringIO(), io.StringIO()  # shown by the parent, in rank order
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            data = _HANDLERS[kind](index, *args)
        return "ok", data, out.getvalue(), err.getvalue()
    except BaseException as error:
        status, limit = _status(error)
        text = traceback.format_exc()
        return status, (text, limit) if status == "timeout" else text, out.getvalue(), err.getvalue()


def _status(error: BaseException) -> tuple[str, float | None]:
    """("timeout", seconds allowed) when a collective raised `error` after waiting its whole
    timeout for its peers (its own `timeout=`, or the process group's), else ("error",
    None). The wrapper in `_publish_current_op` marks what a collective raises with how
    long it waited. Decided here, on the rank, from the exception itself: the parent reads
    the flag, never the traceback's words."""
    _, waited, own = getattr(error, "__collective__", (None, 0.0, None))
    limit = own if own is not None else _LAB.get("timeout")
    if limit is not None and waited >= 0.95 * limit:
        return "timeout", limit
    return "error", None


def _rank_main(config: dict) -> None:
    """A rank process: started as `python -c BOOT` (or forked, see `_forked_rank`), it serves
    requests until its pipe closes (the parent closed it or died)."""
    if config.get("namespaces"):  # an emulated node: join it before any thread or socket exists
        from helpers.launch.cluster import join
        join(*config["namespaces"])
    conn = mpc.Connection(config["fd"])
    _die_with_parent(config["parent_pid"], config["pdeathsig"])
    _stderr_to(config["stderr_path"])
    with contextlib.suppress(Exception):  # an aborted rank (gloo) dumps no 400 MB core
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt kills
    import torch
    _publish_current_op(OpSlot(config["op_path"]))
    torch.set_num_interop_threads(1)
    index = config["index"]
    seen: set[str] = set()  # modules whose files were reported (see new_module_files)
    conn.send((0, "ok", None, "", "", new_module_files(seen)))  # request 0: "ready"
    while True:
        try:
            request, kind, args = conn.recv()
        except (EOFError, OSError):
            return
        with contextlib.suppress(OSError):
            os.ftruncate(2, 0)  # the file holds what the current request wrote
        status, data, out, err = _handle(index, kind, args)
        frames = []
        if status == "ok" and kind == "run":
            frames, group = data
            data = (Frames(tuple(f.nbytes for f in frames)), group)
        conn.send((request, status, data, out, err, new_module_files(seen)))
        write_frames(conn.fileno(), frames)
        del data, frames  # not held while the rank waits for the next request


def _stderr_to(path: str) -> None:
    """The rank's file descriptor 2 into a file the parent reads when the rank dies: what C++
    writes there (gloo's own message before it aborts the rank, say) then reaches the
    RankError instead of a terminal the notebook's reader never sees. Python's sys.stderr is
    the call's own buffer meanwhile (`_handle`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)


def _launcher_main(config: dict) -> None:
    """The launcher: started as `python -c LAUNCHER_BOOT`, it imports torch once, then forks
    a rank per request and reaps one only when asked. When its socket closes (the notebook
    closed it or died) it kills and reaps every rank it forked, then exits. `preload`: more
    modules to import once here rather than in every rank."""
    _die_with_parent(config["parent_pid"], config["pdeathsig"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch  # noqa: F401  (what every rank would otherwise import again)
    import torch.distributed  # noqa: F401
    for module in config.get("preload", ()):
        importlib.import_module(module)
    sock = socket.socket(fileno=config["fd"])
    conn = mpc.Connection(os.dup(sock.fileno()))
    children: set[int] = set()
    me = os.getpid()
    conn.send("ready")
    try:
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                return
            if request[0] == "fork":
                _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                pid = os.fork()
                if pid == 0:
                    _forked_rank(request[1], fds[0], me, (conn, sock))
                os.close(fds[0])  # only that rank holds its end of the pipe
                children.add(pid)
                conn.send(pid)
            else:  # ("poll", pid): its exit code once it has exited (then it is reaped), or None
                done, status = os.waitpid(request[1], os.WNOHANG)
                children.discard(done)
                conn.send(os.waitstatus_to_exitcode(status) if done else None)
    finally:
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)
        os._exit(0)  # not the interpreter's shutdown with torch loaded: that takes ~0.7 s


def _forked_rank(config: dict, fd: int, launcher: int, launcher_ends) -> None:
    """In a child the launcher just forked: become a rank as `python -c` would; never return."""
    code = 1
    try:
        for end in launcher_ends:
            end.close()
        os.setpgid(0, 0)  # a process group of its own, as a `python -c` rank gets
        os.chdir(config["cwd"])
        os.environ.clear()
        os.environ.update(config["env"])
        sys.path[:] = config["path"]
        _rank_main(dict(config, fd=fd, parent_pid=launcher, pdeathsig=True))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# What `python -c` runs: the parent's sys.path first, so the rank imports the same helpers
# (and the same rank functions) as the notebook, then one of the two entry points above.
BOOT = ("import json, sys; config = json.loads(sys.argv[1]); sys.path[:] = config['path']; "
        f"from {__name__} import _rank_main; _rank_main(config)")
LAUNCHER_BOOT = ("import json, sys; config = json.loads(sys.argv[1]); "
                 "sys.path[:] = config['path']; "
                 f"from {__name__} import _launcher_main; _launcher_main(config)")
