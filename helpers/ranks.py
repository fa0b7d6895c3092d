"""Run a function on N real ranks from a notebook cell, and get the results back in rank order.

`spawn(fn, world_size, ...)` is the lecture's `mp.spawn` done right: fresh processes, each in
a real `torch.distributed` process group, returning `[fn(0, N, ...), fn(1, N, ...), ...]`.
`LiveRanks(world_size)` keeps those processes (and their process group) alive between calls,
so a slider can re-run a collective in milliseconds instead of seconds.

Why it is built this way:
* Rendezvous goes through a `FileStore` in a private temporary folder, so no TCP store listens
  at all; gloo and NCCL bind their transports to the loopback interface. Nothing is reachable
  from outside the machine.
* Every rank is a child that dies with its parent (PR_SET_PDEATHSIG on Linux, and a watchdog
  thread elsewhere), so an interrupted or crashed kernel leaves no orphans behind.
* Each rank publishes the collective it is inside, so a hang or crash names the operation.
* Ranks print into a buffer; the notebook prints every rank's output once, in rank order.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any, Callable

BACKENDS = ("auto", "gloo", "nccl")
# A CPU rank costs a Python process with torch imported (~0.4 GB resident); beyond this the
# machine swaps or the kernel OOM-kills ranks, so refuse it up front.
_BYTES_PER_CPU_RANK = 512 * 1024**2
_MAX_CPU_WORLD_SIZE = 64
_RANKS_PER_CORE = 8
# The parent waits this much longer than the collective timeout before it stops waiting for
# a rank on its own, so that the rank's own (more precise) timeout error arrives first.
_GRACE_S = 5.0
_OP_SLOT_BYTES = 64


class RankError(RuntimeError):
    """A rank raised; carries the rank and its traceback."""

    def __init__(self, rank: int, op: str | None, tb: str):
        self.rank, self.op, self.remote_traceback = rank, op, tb
        where = f" during {op}" if op else ""
        super().__init__(f"rank {rank} failed{where}:\n{tb}")


class RankTimeoutError(RankError, TimeoutError):
    """A rank did not finish in time (typically: stuck in a collective its peers never joined)."""

    def __init__(self, rank: int, op: str | None, tb: str, timeout: float, returned: list[int]):
        self.rank, self.op, self.remote_traceback = rank, op, tb
        hint = (f"; rank(s) {returned} had already returned without joining it" if returned
                else "; a peer never joined it")
        TimeoutError.__init__(self, f"rank {rank} timed out after {timeout:g} s in "
                              f"{op or 'a collective'}{hint}.\n{tb}")


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _memory_bytes() -> int | None:
    """Physical memory, or the container's limit when one is set (cgroup v2)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            total = min(total, int(limit))
    return total


def max_cpu_world_size() -> int:
    """How many CPU ranks this machine can run: each needs memory for a process with torch
    imported, and more than a few ranks per core only queue behind each other."""
    memory = _memory_bytes()
    by_memory = _MAX_CPU_WORLD_SIZE if memory is None else memory // _BYTES_PER_CPU_RANK
    by_cores = max(8, _RANKS_PER_CORE * cpu_cores())
    return max(1, min(_MAX_CPU_WORLD_SIZE, by_memory, by_cores))


def threads_per_rank(world_size: int) -> int:
    """Cap intra-op threads so N ranks together use the cores once, not N times over."""
    return max(1, cpu_cores() // world_size)


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' means NCCL when there is one GPU per rank, gloo on the CPU otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gpus = _cuda_device_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} "
                         f"but this machine has {gpus} CUDA device(s); use backend='gloo' or 'auto'")
    return backend


def _cuda_device_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    limit = max(max_cpu_world_size(), _cuda_device_count())
    if not 1 <= world_size <= limit:
        raise ValueError(f"world_size must be between 1 and {limit} on this machine, got {world_size}")
    return world_size


def check_rank_function(fn: Any) -> Callable:
    """A rank function must be importable by name in a fresh process."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    target = fn.func if isinstance(fn, functools.partial) else fn
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", "")
    if module in (None, "builtins") or not inspect.isfunction(inspect.unwrap(target)):
        raise ValueError(f"fn={fn!r} must be a Python function defined in an importable module")
    if module == "__main__" or module.startswith("__"):
        raise ValueError(
            f"fn={qualname or fn!r} is defined in a notebook cell or script (module {module!r}); "
            "a fresh rank process cannot import it. Put rank functions in a module, e.g. helpers/.")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"fn={qualname} is a lambda or nested function; rank processes can only "
                         "run module-level functions")
    return fn


def check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


def loopback_interface() -> str:
    """The name of the loopback interface ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        if name.startswith("lo"):
            return name
    return "lo"


# ----------------------------------------------------------------------------------------
# The rank side: a loop that joins a process group and runs whatever the parent sends.
# ----------------------------------------------------------------------------------------

_COLLECTIVES = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_gather_single", "all_to_all", "all_to_all_single",
    # Not isend/irecv: they return at once (nothing to publish), and dist.P2POp checks
    # that it was given the very functions torch defines.
    "barrier", "send", "recv", "batch_isend_irecv", "broadcast_object_list",
    "all_gather_object", "gather_object", "scatter_object_list", "monitored_barrier",
)


def _publish_current_op(op_slot) -> None:
    """Wrap torch.distributed's collectives so the parent can see which one a rank is in."""
    import torch.distributed as dist

    def wrap(name, real):
        @functools.wraps(real)
        def wrapper(*args, **kwargs):
            op_slot.value = name.encode()[: _OP_SLOT_BYTES - 1]
            result = real(*args, **kwargs)
            op_slot.value = b""
            return result
        wrapper.__wrapped_collective__ = real
        return wrapper

    for name in _COLLECTIVES:
        real = getattr(dist, name, None)
        if real is not None and not hasattr(real, "__wrapped_collective__"):
            setattr(dist, name, wrap(name, real))


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    # Also poll: covers other platforms and a parent that died before prctl ran.
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)
    threading.Thread(target=watch, daemon=True).start()


def _to_cpu(value):
    import torch
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _worker(index: int, conn, op_slot, parent_pid: int, loopback: str) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt kills
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    import torch
    import torch.distributed as dist
    _publish_current_op(op_slot)
    torch.set_num_interop_threads(1)
    conn.send(("ready", None, "", ""))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        kind = message[0]
        if kind == "stop":
            if dist.is_initialized():
                dist.destroy_process_group()
            return
        out, err = io.StringIO(), io.StringIO()  # shown by the parent, in rank order
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                if kind == "init":
                    _, world_size, store_path, backend, timeout = message
                    if dist.is_initialized():
                        dist.destroy_process_group()
                    torch.set_num_threads(threads_per_rank(world_size))
                    if backend == "nccl":
                        torch.cuda.set_device(index)
                    store = dist.FileStore(store_path, world_size)
                    dist.init_process_group(backend, store=store, rank=index,
                                            world_size=world_size,
                                            timeout=timedelta(seconds=timeout))
                    result = None
                elif kind == "leave":
                    if dist.is_initialized():
                        dist.destroy_process_group()
                    result = None
                else:  # "run"
                    _, payload = message
                    fn, args, kwargs = pickle.loads(payload)
                    result = _to_cpu(fn(index, dist.get_world_size(), *args, **kwargs))
            reply = ("ok", pickle.dumps(result), out.getvalue(), err.getvalue())
        except BaseException:
            reply = ("error", traceback.format_exc(), out.getvalue(), err.getvalue())
        try:
            conn.send(reply)
        except Exception:  # an unpicklable result: say so rather than die silently
            conn.send(("error", traceback.format_exc(), out.getvalue(), err.getvalue()))


# ----------------------------------------------------------------------------------------
# The notebook side.
# ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def _main_module_hidden():
    """Start children without re-running the parent's main script in them.

    A spawned child normally re-imports `__main__` (so scripts need `if __name__ ==
    "__main__":`). Rank functions live in importable modules, so a rank never needs the
    parent's main module: hide it while the child is created.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class _Rank:
    def __init__(self, ctx, index: int, loopback: str):
        self.conn, child = ctx.Pipe()
        self.op_slot = ctx.Array("c", _OP_SLOT_BYTES, lock=False)
        self.process = ctx.Process(target=_worker, name=f"rank-{index}", daemon=True,
                                   args=(index, child, self.op_slot, os.getpid(), loopback))
        with _main_module_hidden():
            self.process.start()
        child.close()
        self.index = index

    @property
    def op(self) -> str | None:
        return self.op_slot.value.decode() or None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _kill_all(ranks: list[_Rank], tmpdir: str | None) -> None:
    for rank in ranks:
        with contextlib.suppress(Exception):
            rank.kill()
    ranks.clear()
    if tmpdir:
        shutil.rmtree(tmpdir, ignore_errors=True)


class LiveRanks:
    """Keep `world_size` ranks alive between calls.

    >>> with LiveRanks(4) as ranks:
    ...     ranks.run(helpers.collectives.lecture_example)

    Ranks start lazily on the first `run`. `resize(n)` re-forms the process group over the
    first n of the processes already started (starting more only if needed), so moving a
    world-size slider costs a re-rendezvous, not a process start.
    """

    def __init__(self, world_size: int, backend: str = "auto", timeout: float = 60):
        self._world_size = check_world_size(world_size)
        self.backend = resolve_backend(backend, world_size)
        self.timeout = check_timeout(timeout)
        self._ranks: list[_Rank] = []
        self._group_size = 0          # size of the process group the ranks have joined
        self._generation = 0
        # Rendezvous files live here; private to this user (mkdtemp is mode 0700).
        self._tmpdir = tempfile.mkdtemp(prefix="plab-ranks-")
        self._ctx = mp.get_context("spawn")
        # Close on garbage collection and at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _kill_all, self._ranks, self._tmpdir)

    @property
    def world_size(self) -> int:
        return self._world_size

    def resize(self, world_size: int) -> "LiveRanks":
        world_size = check_world_size(world_size)
        # The backend chosen at construction stays: one object never mixes NCCL and gloo.
        resolve_backend(self.backend, world_size)
        self._world_size = world_size
        return self

    def run(self, fn: Callable, *args, **kwargs) -> list:
        """`[fn(r, world_size, *args, **kwargs) for r in ranks]`, each on its own rank."""
        check_rank_function(fn)
        payload = pickle.dumps((fn, args, kwargs))
        try:
            self._ensure_group()
            n = self._world_size
            return self._exchange(self._ranks[:n], ("run", payload), "run " + _name(fn))
        except BaseException:
            # Any failure (an error on a rank, a timeout, a KeyboardInterrupt) may leave ranks
            # blocked in a collective: tear all of them down; the next call starts afresh.
            self.close()
            raise

    def close(self) -> None:
        """Stop every rank. (multiprocessing's own resource-tracker helper, started with the
        first spawned process, stays until the kernel exits: it holds no rank or socket.)"""
        for rank in self._ranks:
            with contextlib.suppress(Exception):
                rank.conn.send(("stop",))
        deadline = time.monotonic() + 2
        for rank in self._ranks:
            rank.process.join(timeout=max(0.0, deadline - time.monotonic()))
        _kill_all(self._ranks, None)
        for name in os.listdir(self._tmpdir) if os.path.isdir(self._tmpdir) else ():
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self._tmpdir, name))
        self._group_size = 0

    def __enter__(self) -> "LiveRanks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        alive = sum(r.process.is_alive() for r in self._ranks)
        return f"LiveRanks(world_size={self._world_size}, backend={self.backend!r}, processes={alive})"

    @property
    def pids(self) -> list[int]:
        return [r.process.pid for r in self._ranks]

    # -- internals ------------------------------------------------------------------------

    def _ensure_group(self) -> None:
        n = self._world_size
        if self._group_size == n and all(r.process.is_alive() for r in self._ranks[:n]):
            return
        os.makedirs(self._tmpdir, mode=0o700, exist_ok=True)
        loopback = loopback_interface()
        new = [_Rank(self._ctx, i, loopback) for i in range(len(self._ranks), n)]
        self._ranks.extend(new)
        if new:
            self._exchange(new, None, "start")  # wait for "ready"
        # Ranks beyond n leave the old group first so the new one forms cleanly.
        others = [r for r in self._ranks[n:self._group_size]]
        if others:
            self._exchange(others, ("leave",), "leave")
        self._generation += 1
        store = os.path.join(self._tmpdir, f"store-{self._generation}")
        self._exchange(self._ranks[:n], ("init", n, store, self.backend, self.timeout),
                       "init_process_group")
        self._group_size = n

    def _exchange(self, ranks: list[_Rank], message, what: str) -> list:
        if message is not None:
            for rank in ranks:
                rank.conn.send(message)
        replies: dict[int, tuple] = {}
        pending = {rank.conn: rank for rank in ranks}
        sentinels = {rank.process.sentinel: rank for rank in ranks}
        # Starting a process imports torch: allow for that on a busy machine.
        deadline = time.monotonic() + self.timeout + _GRACE_S + (60 if what == "start" else 0)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                stuck = min(pending.values(), key=lambda r: r.index)
                done = sorted(r.index for r in ranks if r.conn not in pending)
                raise RankTimeoutError(stuck.index, stuck.op or what, "(no reply from the rank)",
                                       self.timeout, done)
            ready = mpc.wait(list(pending) + [s for s, r in sentinels.items()
                                              if r.conn in pending], timeout=left)
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        reply = obj.recv()
                    except (EOFError, OSError):
                        raise RankError(rank.index, rank.op, f"rank {rank.index} exited "
                                        f"(exit code {rank.process.exitcode})") from None
                    replies[rank.index] = reply
                    if reply[0] == "error":
                        self._show(replies)
                        if "Timed out" in reply[1] or "timed out" in reply[1]:
                            returned = sorted(r.index for r in ranks
                                              if r.conn not in pending and r is not rank)
                            raise RankTimeoutError(rank.index, rank.op, reply[1],
                                                   self.timeout, returned)
                        raise RankError(rank.index, rank.op, reply[1])
                elif obj in sentinels and sentinels[obj].conn in pending:
                    rank = sentinels[obj]
                    if rank.conn.poll():  # its last words arrived before it died
                        continue
                    rank.process.join(timeout=1)
                    raise RankError(rank.index, rank.op or what,
                                    f"rank {rank.index} died (exit code {rank.process.exitcode})")
        self._show(replies)
        return [pickle.loads(replies[r.index][1]) if replies[r.index][1] else None
                for r in ranks] if message and message[0] == "run" else []

    @staticmethod
    def _show(replies: dict[int, tuple]) -> None:
        """Print each rank's captured output once, in rank order."""
        for index in sorted(replies):
            _, _, out, err = replies[index]
            for text, stream in ((out, sys.stdout), (err, sys.stderr)):
                if text:
                    prefix = f"[rank {index}] "
                    stream.write("".join(prefix + line for line in text.splitlines(True)))
                    if not text.endswith("\n"):
                        stream.write("\n")


def _name(fn: Callable) -> str:
    target = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(target, "__qualname__", repr(fn))


def spawn(fn: Callable, world_size: int, *args, backend: str = "auto", timeout: float = 60,
          **kwargs) -> list:
    """Start `world_size` fresh processes, run `fn(rank, world_size, *args, **kwargs)` on each
    inside a process group, tear everything down, and return the results in rank order."""
    check_rank_function(fn)
    with LiveRanks(world_size, backend=backend, timeout=timeout) as ranks:
        return ranks.run(fn, *args, **kwargs)

