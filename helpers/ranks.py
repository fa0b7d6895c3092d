"""Run a function on N real ranks from a notebook cell, and get the results back in rank order.

`spawn(fn, world_size, ...)` is the lecture's `mp.spawn` done right: fresh processes, each in
a real `torch.distributed` process group, returning `[fn(0, N, ...), fn(1, N, ...), ...]`.
`LiveRanks(world_size)` keeps those processes (and their process group) alive between calls,
so a slider can re-run a collective in milliseconds instead of seconds.

Why it is built this way:
* Rendezvous goes through a `FileStore` in a private temporary folder, so no TCP store listens
  at all; gloo and NCCL bind their transports to the loopback interface, whatever the
  environment says, unless the reader asks for `multi_node=True`.
* Ranks are forked from a launcher, one per `LiveRanks` (Linux): a plain `python -c` process
  that imports torch once, so a rank starts in tens of milliseconds instead of importing torch
  again (about 2 s of CPU each: 8 ranks on 2 cores took 8 s to start). It is the ranks' parent
  and reaps each only when the notebook asks, so a pid the notebook may signal is never
  reused. Elsewhere (macOS: forking after importing torch is not safe there) each rank is its
  own `python -c` process. Not `multiprocessing`: no resource-tracker helper is started, which
  ignores SIGTERM and so held up every kernel shutdown and restart.
* Every rank dies with the process that owns it: PR_SET_PDEATHSIG when it was started from the
  main thread (the signal follows the creating *thread*), and always a watchdog thread.
* Every request carries an id and every reply is matched to it; a call that was cut short
  (an error, a timeout, an interrupt) marks the ranks dirty and they are killed, then reaped,
  with interrupts held back, so the next call always starts from a known state.
* One lock per `LiveRanks` serialises calls from several threads; a per-process cap on live
  rank processes (the least recently used `LiveRanks` is stopped and restarts lazily) keeps
  re-run cells from piling up processes.
* Each rank publishes the collective it is inside, so a hang or crash names the operation.
* Ranks print into a buffer; the notebook prints every rank's output once, in rank order.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import io
import itertools
import json
import math
import mmap
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any, Callable

from helpers.checks import check_choice, check_int

BACKENDS = ("auto", "gloo", "nccl")
# A CPU rank costs a Python process with torch imported (~0.4 GB resident); beyond this the
# machine swaps or the kernel OOM-kills ranks, so refuse it up front.
_BYTES_PER_CPU_RANK = 512 * 1024**2
_MAX_CPU_WORLD_SIZE = 64
_RANKS_PER_CORE = 8
# The parent waits this much longer than the collective timeout before it stops waiting for
# a rank on its own, so that the rank's own (more precise) timeout error arrives first.
_GRACE_S = 5.0
# A starting rank imports torch before it answers: allow for that on a busy machine.
_START_S = 120.0
# How often a waiting parent also checks that its ranks are still alive.
_POLL_S = 0.5
_OP_SLOT_BYTES = 64
# Longest collective timeout accepted: a week. (Far longer would overflow the millisecond
# timeouts of poll() and of the backends; None means "no timeout" instead.)
MAX_TIMEOUT_S = 7 * 24 * 3600
# The process-group timeout used for timeout=None: long enough never to matter in a course.
_NO_TIMEOUT = timedelta(days=365)
# Variables that choose the network interface of gloo, NCCL and TensorPipe.
TRANSPORT_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
_FOLDER_PREFIX = "plab-ranks-"
# Most rank processes one kernel keeps alive at once (None: `max_cpu_world_size()`).
LIVE_RANK_LIMIT: int | None = None
# Fork ranks from a launcher that imported torch once (Linux only: see the module docstring).
FORK_RANKS = sys.platform.startswith("linux")


class RankError(RuntimeError):
    """A rank raised; carries the rank and its traceback."""

    def __init__(self, rank: int, op: str | None, tb: str):
        self.rank, self.op, self.remote_traceback = rank, op, tb
        where = f" during {op}" if op else ""
        super().__init__(f"rank {rank} failed{where}:\n{tb}")


class RankTimeoutError(RankError, TimeoutError):
    """A rank did not finish in time (typically: stuck in a collective its peers never joined)."""

    def __init__(self, rank: int, op: str | None, tb: str, timeout: float | None,
                 returned: list[int]):
        self.rank, self.op, self.remote_traceback = rank, op, tb
        hint = (f"; rank(s) {returned} had already returned without joining it" if returned
                else "; a peer never joined it")
        after = "" if timeout is None else f" after {timeout:g} s"
        TimeoutError.__init__(self, f"rank {rank} timed out{after} in "
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


def live_rank_limit() -> int:
    """Most rank processes this process keeps alive over all its `LiveRanks` together."""
    return LIVE_RANK_LIMIT if LIVE_RANK_LIMIT is not None else max_cpu_world_size()


def threads_per_rank(world_size: int) -> int:
    """Cap intra-op threads so N ranks together use the cores once, not N times over."""
    return max(1, cpu_cores() // world_size)


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' means NCCL when there is one GPU per rank, gloo on the CPU otherwise."""
    check_choice("backend", backend, BACKENDS)
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
    """1 … the ranks this machine can hold (memory and cores, or one per GPU)."""
    return check_int("world_size", world_size, 1, max(max_cpu_world_size(), _cuda_device_count()))


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


def check_timeout(timeout: Any) -> float | None:
    """Seconds a collective may wait for its peers: a number in (0, MAX_TIMEOUT_S], or None."""
    ok = (timeout is None or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                              and 0 < timeout <= MAX_TIMEOUT_S))
    if not ok:
        raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S}] (one week), "
                         f"or None for no timeout; got {timeout!r}")
    return None if timeout is None else float(timeout)


def loopback_interface() -> str:
    """The name of the loopback interface ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        if name.startswith("lo"):
            return name
    return "lo"


def pin_transports(env: dict, multi_node: bool = False) -> dict:
    """Bind gloo's, NCCL's and TensorPipe's sockets to loopback in `env`.

    An inherited GLOO_SOCKET_IFNAME=eth0 (a cluster's login profile sets such things) must
    not put a notebook's ranks on the network, so the pin overrides it. `multi_node=True`
    is the reader asking for the opposite: what the environment says wins, loopback is
    only the default.
    """
    loopback = loopback_interface()
    for name in TRANSPORT_VARIABLES:
        if multi_node:
            env.setdefault(name, loopback)
        else:
            env[name] = loopback
    return env


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {code}, killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _notice(text: str) -> None:
    """One line for the reader about something done on their behalf."""
    print(f"helpers.ranks: {text}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------
# The rank side: a loop that joins a process group and runs whatever the parent sends.
# Messages are (request id, kind, args); replies are (request id, status, data, out, err).
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


class _OpSlot:
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
    """Wrap torch.distributed's collectives so the parent can see which one a rank is in."""
    import torch.distributed as dist

    def wrap(name, real):
        @functools.wraps(real)
        def wrapper(*args, **kwargs):
            op_slot.value = name.encode()
            result = real(*args, **kwargs)
            op_slot.value = b""
            return result
        wrapper.__wrapped_collective__ = real
        return wrapper

    for name in _COLLECTIVES:
        real = getattr(dist, name, None)
        if real is not None and not hasattr(real, "__wrapped_collective__"):
            setattr(dist, name, wrap(name, real))


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
    import torch
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _init_group(index: int, world_size: int, store_path: str, backend: str,
                timeout: float | None) -> None:
    import torch
    import torch.distributed as dist
    _leave_group(index)
    torch.set_num_threads(threads_per_rank(world_size))
    if backend == "nccl":
        torch.cuda.set_device(index)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=index, world_size=world_size,
                            timeout=_NO_TIMEOUT if timeout is None else timedelta(seconds=timeout))


def _leave_group(index: int) -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_function(index: int, payload: bytes) -> bytes:
    import torch.distributed as dist
    fn, args, kwargs = pickle.loads(payload)
    return pickle.dumps(_to_cpu(fn(index, dist.get_world_size(), *args, **kwargs)))


_HANDLERS = {"init": _init_group, "leave": _leave_group, "run": _run_function}


def _handle(index: int, kind: str, args: tuple) -> tuple:
    """(status, data, out, err): data is the pickled result, or the traceback on an error."""
    out, err = io.StringIO(), io.StringIO()  # shown by the parent, in rank order
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            data = _HANDLERS[kind](index, *args)
        return "ok", data, out.getvalue(), err.getvalue()
    except BaseException:
        return "error", traceback.format_exc(), out.getvalue(), err.getvalue()


def _rank_main(config: dict) -> None:
    """A rank process: started by `_Rank` as `python -c`, it serves requests until its pipe
    closes (the parent closed it or died)."""
    conn = mpc.Connection(config["fd"])
    _die_with_parent(config["parent_pid"], config["pdeathsig"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt kills
    import torch
    _publish_current_op(_OpSlot(config["op_path"]))
    torch.set_num_interop_threads(1)
    index = config["index"]
    conn.send((0, "ok", None, "", ""))  # request 0: "ready"
    while True:
        try:
            request, kind, args = conn.recv()
        except (EOFError, OSError):
            return
        conn.send((request, *_handle(index, kind, args)))


def _launcher_main(config: dict) -> None:
    """The launcher: started by `_Launcher` as `python -c`, it imports torch once, then forks
    a rank per request and reaps one only when asked. When its socket closes (the notebook
    closed it or died) it kills and reaps every rank it forked, then exits."""
    _die_with_parent(config["parent_pid"], config["pdeathsig"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch  # noqa: F401  (what every rank would otherwise import again)
    import torch.distributed  # noqa: F401
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
        os.setpgid(0, 0)  # a process group of its own, as `_Rank` gives a `python -c` rank
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


# ----------------------------------------------------------------------------------------
# The notebook side.
# ----------------------------------------------------------------------------------------

_BOOT = ("import json, sys; config = json.loads(sys.argv[1]); sys.path[:] = config['path']; "
         f"from {__name__} import _rank_main; _rank_main(config)")
_LAUNCHER_BOOT = ("import json, sys; config = json.loads(sys.argv[1]); "
                  "sys.path[:] = config['path']; "
                  f"from {__name__} import _launcher_main; _launcher_main(config)")


def _python(boot: str, config: dict, fd: int, env: dict) -> subprocess.Popen:
    # A process group of its own: ipykernel's shutdown signals every child in the kernel's
    # group and waits until none is left, and a rank it kills stays a zombie (nobody reaps
    # it while the kernel shuts down), so it waited 29 s every time. Ranks end with the
    # kernel anyway (death signal, watchdog pipe, exit handlers).
    return subprocess.Popen([sys.executable, "-c", boot, json.dumps(config)], pass_fds=(fd,),
                            env=env, stdin=subprocess.DEVNULL, process_group=0)


def _parent_config(fd: int) -> dict:
    return {"fd": fd, "parent_pid": os.getpid(),
            "pdeathsig": threading.current_thread() is threading.main_thread(),
            "path": [p for p in sys.path if isinstance(p, str)]}


class _Launcher:
    """The notebook's end of one launcher (see `_launcher_main`): one per LiveRanks."""

    def __init__(self, env: dict):
        ours, theirs = socket.socketpair()
        try:
            self.process = _python(_LAUNCHER_BOOT, _parent_config(theirs.fileno()),
                                   theirs.fileno(), env)
        finally:
            theirs.close()
        self.sock = ours
        self.conn = mpc.Connection(os.dup(ours.fileno()))
        self._lock = threading.Lock()
        self._holder: int | None = None
        self.ready = False

    def wait_ready(self, seconds: float) -> None:
        """Until torch is imported there: interruptible, and a launcher that died says so."""
        deadline = time.monotonic() + seconds
        while not self.ready:
            with contextlib.suppress(EOFError, OSError):  # dead: said below
                if self.conn.poll(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
                    self.ready = self.conn.recv() == "ready"
                    continue
            if self.process.poll() is not None:
                raise self.died("before it was ready")
            if time.monotonic() > deadline:
                raise RankError(0, "start", f"the ranks' launcher not ready in {seconds:g} s")

    def alive(self) -> bool:
        return self.process.poll() is None

    def exited(self) -> bool:
        """Whether it has exited, after waiting a moment: a request that failed on its socket
        means it is dying, but the socket closes a little before the process can be reaped."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        return self.process.returncode is not None

    def died(self, when: str) -> RankError:
        self.exited()
        return RankError(0, "start", f"the ranks' launcher exited {when} "
                         f"({_describe_exit(self.process.returncode)})")

    @contextlib.contextmanager
    def _turn(self):
        """One request and its reply at a time. An exit-signal handler that interrupted this
        very thread mid-request gets an OSError at once instead of a garbled reply."""
        if self._holder == threading.get_ident() or not self._lock.acquire(timeout=30):
            raise OSError("the ranks' launcher is busy")
        self._holder = threading.get_ident()
        try:
            yield
        finally:
            self._holder = None
            self._lock.release()

    def poll(self, pid: int) -> int | None:
        with self._turn():
            self.conn.send(("poll", pid))
            return self.conn.recv()

    def fork(self, config: dict, fd: int) -> "_Forked":
        with self._turn():
            try:
                self.conn.send(("fork", config))
                socket.send_fds(self.sock, [b"f"], [fd])
                return _Forked(self, self.conn.recv())
            except (EOFError, OSError):
                raise self.died(f"while it forked rank {config['index']}") from None

    def close(self) -> None:
        """Its socket closed, it kills and reaps what is left of its ranks, then exits."""
        self.conn.close()
        self.sock.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _Forked:
    """A rank forked by a launcher, with the part of `subprocess.Popen` that `_Rank` uses."""

    def __init__(self, launcher: _Launcher, pid: int):
        self.launcher, self.pid, self.returncode = launcher, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self.launcher.poll(self.pid)
            except (EOFError, OSError):
                if not self.launcher.exited():
                    raise
                # The launcher's death kills each of its ranks (PR_SET_PDEATHSIG, SIGKILL).
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        # Unreaped, the pid cannot belong to anyone else; with the launcher gone it might.
        if self.returncode is None and self.launcher.alive():
            os.kill(self.pid, signal.SIGKILL)


class _Rank:
    """One rank process and the parent's end of its pipe."""

    def __init__(self, index: int, folder: str, env: dict, launcher: _Launcher | None):
        self.index = index
        op_path = os.path.join(folder, f"op-{index}")
        self.op_slot = _OpSlot(op_path, create=True)
        self.conn, child = mp.Pipe()
        config = dict(_parent_config(child.fileno()), index=index, op_path=op_path)
        try:
            if launcher is None:
                self.process = _python(_BOOT, config, child.fileno(), env)
            else:
                self.process = launcher.fork(dict(config, cwd=os.getcwd(), env=env),
                                             child.fileno())
        finally:
            child.close()

    @property
    def op(self) -> str | None:
        with contextlib.suppress(ValueError):  # the slot is closed once the rank is reaped
            return self.op_slot.value.decode(errors="replace") or None
        return None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_code(self) -> int:
        """The exit status, for certain: wait for the process (kill it if it lingers) first."""
        try:
            return self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def drain(self) -> bool:
        """Throw away replies nobody waits for any more (from a request that was given up);
        False if the rank is gone (exited, or its pipe is closed as it exits)."""
        try:
            while self.conn.poll():
                self.conn.recv()
        except (EOFError, OSError):
            return False
        return self.alive()

    def release(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self.conn.close()
        self.op_slot.close()


def _kill_all(ranks: list[_Rank], folders: list[str], launchers: list[_Launcher]) -> None:
    """Kill every rank first, then reap each, then close the launcher and remove the folder:
    killing all before waiting on any means one stuck rank cannot keep the others alive."""
    for rank in ranks:
        with contextlib.suppress(OSError):
            rank.process.kill()
    for rank in ranks:
        with contextlib.suppress(Exception):
            rank.release()
    ranks.clear()
    for launcher in launchers:
        with contextlib.suppress(Exception):
            launcher.close()
    launchers.clear()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    folders.clear()


_deferring = False


@contextlib.contextmanager
def _sigint_deferred():
    """Hold back Ctrl-C (Jupyter's stop button) while ranks are started or killed.

    A second interrupt landing half-way through a clean-up would leave ranks that the object
    no longer tracks. A held interrupt is raised at the end, unless an exception is already on
    its way out (then the reader is interrupted anyway). Only the main thread gets SIGINT.
    """
    global _deferring
    previous = None
    if threading.current_thread() is threading.main_thread() and not _deferring:
        previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # not ours to change (SIG_IGN, SIG_DFL, set from C, nested)
        yield
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        signal.signal(signal.SIGINT, previous)
        if held and sys.exc_info()[1] is None:
            raise KeyboardInterrupt


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _remove_stale_folders() -> None:
    """Remove private folders left by processes that were SIGKILLed (nothing else can leave
    one): each folder's name starts with its owner's pid."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name[len(_FOLDER_PREFIX):].split("-", 1)[0]
            if not name.startswith(_FOLDER_PREFIX) or not pid.isdigit() or _pid_alive(int(pid)):
                continue
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                if os.stat(path).st_uid == os.getuid():
                    shutil.rmtree(path, ignore_errors=True)


def _private_folder() -> str:
    _remove_stale_folders()
    # mkdtemp makes it mode 0700: private to this user.
    return tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")


# Every LiveRanks of this process, for the cap on live ranks and for the exit handlers.
_POOL: "weakref.WeakSet[LiveRanks]" = weakref.WeakSet()
_POOL_LOCK = threading.Lock()  # a WeakSet may not change while another thread copies it
_CLOCK = itertools.count(1)
_exit_handlers_installed = False


def _on_exit_signal(signum, frame) -> None:
    """Kill our ranks and remove our folders, then die of the same signal as before."""
    for group in list(_POOL):  # no locks: the code this signal interrupted may hold them
        _kill_all(group._ranks, group._folders, group._launchers)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_exit_handlers() -> None:
    """SIGTERM and SIGHUP end Python without atexit, so ranks would linger until their
    watchdog noticed and the private folder would stay. Where nobody else handles them,
    clean up first. (Signal handlers can only be set from the main thread.)"""
    global _exit_handlers_installed
    if _exit_handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    _exit_handlers_installed = True
    for name in ("SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, _on_exit_signal)


def _make_room(owner: "LiveRanks", needed: int) -> None:
    """Stop the least recently used other LiveRanks until `needed` more ranks fit the cap."""
    limit = max(live_rank_limit(), owner.world_size)
    with _POOL_LOCK:
        groups = [g for g in list(_POOL) if g._ranks]
    total = needed + sum(len(g._ranks) for g in groups)
    for other in sorted((g for g in groups if g is not owner), key=lambda g: g._last_used):
        if total <= limit:
            return
        if not other._lock.acquire(blocking=False):
            continue  # in use by another thread right now: not idle
        try:
            count, name = len(other._ranks), f"LiveRanks(world_size={other.world_size})"
            other._teardown()
        finally:
            other._lock.release()
        total -= count
        _notice(f"stopped the {count} ranks of an idle {name} to keep at most {limit} rank "
                "processes alive; it restarts on its next call")


class LiveRanks:
    """Keep `world_size` ranks alive between calls.

    >>> with LiveRanks(4) as ranks:
    ...     ranks.run(helpers.collectives.lecture_example)

    Ranks start lazily on the first `run`. `resize(n)` re-forms the process group over the
    first n of the processes already started (starting more only if needed), so moving a
    world-size slider costs a re-rendezvous, not a process start.

    `timeout` is how long a collective may wait for its peers, in seconds (None: no limit).
    `multi_node=True` lets inherited GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / TP_SOCKET_IFNAME
    choose the interface; by default every transport is pinned to loopback.
    Calls from several threads are serialised. A kernel keeps at most `live_rank_limit()`
    rank processes alive over all its LiveRanks: the least recently used is stopped (with a
    one-line notice) and restarts on its next call.
    """

    def __init__(self, world_size: int, backend: str = "auto", timeout: float | None = 60,
                 multi_node: bool = False):
        self._world_size = check_world_size(world_size)
        self.backend = resolve_backend(backend, world_size)
        self.timeout = check_timeout(timeout)
        if not isinstance(multi_node, bool):
            raise TypeError(f"multi_node must be True or False, got {multi_node!r}")
        self.multi_node = multi_node
        self._ranks: list[_Rank] = []
        self._folders: list[str] = []  # the private folder while ranks run (at most one)
        self._launchers: list[_Launcher] = []  # the ranks' launcher while they run (at most one)
        self._group_size = 0           # size of the process group the ranks have joined
        self._generation = 0
        self._requests = itertools.count(1)  # request 0 is each rank's "ready"
        self._dirty = False            # a call is running, or was cut short
        self._lock = threading.RLock()
        self._last_used = 0
        # Close on garbage collection and at interpreter exit, whichever comes first. (The
        # finalizer holds the lists themselves, so they are only ever changed in place.)
        self._finalizer = weakref.finalize(self, _kill_all, self._ranks, self._folders,
                                           self._launchers)
        with _POOL_LOCK:
            _POOL.add(self)

    @property
    def world_size(self) -> int:
        return self._world_size

    def resize(self, world_size: int) -> "LiveRanks":
        world_size = check_world_size(world_size)
        # The backend chosen at construction stays: one object never mixes NCCL and gloo.
        resolve_backend(self.backend, world_size)
        with self._lock:
            self._world_size = world_size
        return self

    def run(self, fn: Callable, *args, **kwargs) -> list:
        """`[fn(r, world_size, *args, **kwargs) for r in ranks]`, each on its own rank."""
        check_rank_function(fn)
        payload = pickle.dumps((fn, args, kwargs))
        what = "run " + _name(fn)
        with self._lock:
            self._last_used = next(_CLOCK)
            try:
                if self._dirty:  # an earlier call was cut short: its ranks' state is unknown
                    self._teardown()
                self._dirty = True
                self._ensure_group()
                replies = self._exchange(self._ranks[:self._world_size], "run", (payload,), what)
                self._dirty = False
            except BaseException:
                # An error on a rank, a timeout or an interrupt may leave ranks blocked in a
                # collective: tear all of them down; the next call starts afresh.
                self._teardown()
                raise
        return [_unpickle(rank, data, what) for rank, data in enumerate(replies)]

    def close(self) -> None:
        """Stop every rank and remove the private folder; the next `run` starts afresh."""
        with self._lock:
            self._teardown()

    def __enter__(self) -> "LiveRanks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        alive = sum(r.alive() for r in list(self._ranks))
        return f"LiveRanks(world_size={self._world_size}, backend={self.backend!r}, processes={alive})"

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in list(self._ranks)]

    # -- internals ------------------------------------------------------------------------

    def _teardown(self) -> None:
        """Kill, reap, remove the folder, with interrupts held back: whatever happens the
        object is left ready for the next call."""
        with _sigint_deferred():
            self._group_size = 0
            _kill_all(self._ranks, self._folders, self._launchers)
            self._dirty = False

    def _ensure_group(self) -> None:
        self._replace_dead()
        n = self._world_size
        if self._group_size == n:
            return
        self._start(n - len(self._ranks))
        # Ranks beyond n leave the old group first so the new one forms cleanly.
        others = self._ranks[n:self._group_size]
        if others:
            self._exchange(others, "leave", (), "leave")
        self._group_size = 0
        self._generation += 1
        store = os.path.join(self._folders[0], f"store-{self._generation}")
        self._exchange(self._ranks[:n], "init", (n, store, self.backend, self.timeout),
                       "init_process_group")
        self._group_size = n

    def _replace_dead(self) -> None:
        """A rank that died while idle (killed, OOM, its creating thread's PDEATHSIG) broke
        the process group: say which, then start every rank afresh."""
        dead = [r for r in self._ranks if not r.drain()]
        if dead:
            which = ", ".join(f"rank {r.index} ({_describe_exit(r.exit_code())})" for r in dead)
            if self._launchers and not self._launchers[0].alive():
                code = self._launchers[0].process.returncode
                which = f"the ranks' launcher ({_describe_exit(code)}), and with it every rank,"
            _notice(f"{which} had exited while idle; starting fresh ranks")
            self._teardown()

    def _start(self, missing: int) -> None:
        if missing <= 0:
            return
        _make_room(self, missing)
        _install_exit_handlers()
        env = pin_transports(dict(os.environ), self.multi_node)
        new = []
        with _sigint_deferred():  # every started process is recorded before an interrupt lands
            if not self._folders:
                self._folders.append(_private_folder())
            if FORK_RANKS and not self._launchers:
                self._launchers.append(_Launcher(env))
        launcher = self._launchers[0] if self._launchers else None
        if launcher is not None:
            launcher.wait_ready(_START_S)  # importing torch: an interrupt may land here
        with _sigint_deferred():
            for index in range(len(self._ranks), len(self._ranks) + missing):
                new.append(_Rank(index, self._folders[0], env, launcher))
                self._ranks.append(new[-1])
        self._await(new, 0, "start", _START_S)

    def _exchange(self, ranks: list[_Rank], kind: str, args: tuple, what: str) -> list:
        request = next(self._requests)
        for rank in ranks:
            rank.drain()
            try:
                rank.conn.send((request, kind, args))
            except OSError:
                raise self._died(rank, what) from None
        wait = None if self.timeout is None else self.timeout + _GRACE_S
        return self._await(ranks, request, what, wait)

    def _await(self, ranks: list[_Rank], request: int, what: str, seconds: float | None) -> list:
        """Each rank's reply to `request`, in rank order; replies to older requests are
        dropped. Raises as soon as one rank fails, dies, or the time is up."""
        replies: dict[int, tuple] = {}
        pending = {rank.conn: rank for rank in ranks}
        deadline = math.inf if seconds is None else time.monotonic() + seconds
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out(ranks, pending, what)
            for conn in mpc.wait(list(pending), timeout=min(left, _POLL_S)):
                rank = pending[conn]
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    raise self._died(rank, what) from None
                if reply[0] != request:
                    continue  # stale: the answer to a request that was given up
                del pending[conn]
                replies[rank.index] = reply
                if reply[1] == "error":
                    self._show(replies)
                    # A rank that died takes down the collectives it was in, so its peers
                    # fail too, and their errors may be read first: name the dead rank (the
                    # cause). Its pipe closed as it exited, before a peer could notice.
                    dead = next((r for r in pending.values() if not r.drain()), None)
                    if dead is not None:
                        raise self._died(dead, what)
                    raise self._failed(rank, reply[2], ranks, pending)
            for rank in list(pending.values()):  # dead, but its pipe held open by a child
                if not rank.alive() and not rank.conn.poll():
                    raise self._died(rank, what)
        self._show(replies)
        return [replies[r.index][2] for r in ranks]

    def _died(self, rank: _Rank, what: str) -> RankError:
        code = rank.exit_code()  # reaped before it is read: never "exit code None"
        return RankError(rank.index, rank.op or what,
                         f"rank {rank.index} died ({_describe_exit(code)})")

    def _failed(self, rank: _Rank, tb: str, ranks: list[_Rank], pending: dict) -> RankError:
        if "Timed out" in tb or "timed out" in tb:
            returned = sorted(r.index for r in ranks if r.conn not in pending and r is not rank)
            return RankTimeoutError(rank.index, rank.op, tb, self.timeout, returned)
        return RankError(rank.index, rank.op, tb)

    def _timed_out(self, ranks: list[_Rank], pending: dict, what: str) -> RankTimeoutError:
        stuck = min(pending.values(), key=lambda r: r.index)
        done = sorted(r.index for r in ranks if r.conn not in pending)
        return RankTimeoutError(stuck.index, stuck.op or what, "(no reply from the rank)",
                                self.timeout, done)

    @staticmethod
    def _show(replies: dict[int, tuple]) -> None:
        """Print each rank's captured output once, in rank order."""
        for index in sorted(replies):
            out, err = replies[index][3:5]
            for text, stream in ((out, sys.stdout), (err, sys.stderr)):
                if text:
                    prefix = f"[rank {index}] "
                    stream.write("".join(prefix + line for line in text.splitlines(True)))
                    if not text.endswith("\n"):
                        stream.write("\n")


def _unpickle(rank: int, data: bytes, what: str):
    try:
        return pickle.loads(data)
    except Exception as e:  # e.g. a class the rank could import and the notebook cannot
        raise RankError(rank, what, f"the result of rank {rank} could not be unpickled in this "
                        f"process: {type(e).__name__}: {e}") from e


def _name(fn: Callable) -> str:
    target = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(target, "__qualname__", repr(fn))


def spawn(fn: Callable, world_size: int, *args, backend: str = "auto",
          timeout: float | None = 60, multi_node: bool = False, **kwargs) -> list:
    """Start `world_size` fresh processes, run `fn(rank, world_size, *args, **kwargs)` on each
    inside a process group, tear everything down, and return the results in rank order."""
    check_rank_function(fn)
    with LiveRanks(world_size, backend=backend, timeout=timeout, multi_node=multi_node) as ranks:
        return ranks.run(fn, *args, **kwargs)
