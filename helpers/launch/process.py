"""The notebook's handles on rank processes: start them, watch them, kill them, reap them.

Why it is built this way:
* Ranks are forked from a launcher, one per `LiveRanks` (Linux; see helpers.launch.worker):
  `Launcher` is the notebook's end of it, and `_Forked` gives a forked rank the part of
  `subprocess.Popen` that `RankProcess` uses. Elsewhere each rank is its own `python -c`
  process. Not `multiprocessing`: no resource-tracker helper is started, which ignores
  SIGTERM and so held up every kernel shutdown and restart.
* Every process started here gets a process group of its own (see `_python`).
* A rank leads a process group, so killing it kills the subprocesses it started too.
* `kill_all` kills every rank before it waits on any, then reaps each, and `sigint_deferred`
  holds interrupts back meanwhile, so a clean-up always finishes and no rank is left that
  nobody tracks.
* Rendezvous files and op slots live in a private folder (mode 0700) named after its owner's
  pid, so the folders a SIGKILLed kernel leaves are recognised and removed by the next start.
"""
from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from helpers.launch.errors import RankError, describe_exit
from helpers.launch.shipping import read_frame
from helpers.launch.worker import BOOT, LAUNCHER_BOOT, Frames, OpSlot

# How often a waiting parent also checks that its ranks are still alive.
POLL_S = 0.5
# A result larger than this is named in a warning (it crosses once, but the notebook holds it).
LARGE_RESULT_BYTES = 1024**3
_FOLDER_PREFIX = "plab-ranks-"


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


class Launcher:
    """The notebook's end of one launcher (see `worker._launcher_main`): one per LiveRanks."""

    def __init__(self, env: dict, preload: tuple = ()):
        ours, theirs = socket.socketpair()
        try:
            config = dict(_parent_config(theirs.fileno()), preload=list(preload))
            self.process = _python(LAUNCHER_BOOT, config, theirs.fileno(), env)
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
                if self.conn.poll(min(POLL_S, max(0.0, deadline - time.monotonic()))):
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
                         f"({describe_exit(self.process.returncode)})")

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
    """A rank forked by a launcher, with the part of `subprocess.Popen` that `RankProcess`
    uses."""

    def __init__(self, launcher: Launcher, pid: int):
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


class RankProcess:
    """One rank process and the parent's end of its pipe."""

    def __init__(self, index: int, folder: str, env: dict, launcher: Launcher | None,
                 namespaces: tuple[str, ...] = ()):
        self.index = index
        op_path = os.path.join(folder, f"op-{index}")
        self.op_slot = OpSlot(op_path, create=True)
        self.stderr_path = os.path.join(folder, f"stderr-{index}")
        self.conn, child = mp.Pipe()
        config = dict(_parent_config(child.fileno()), index=index, op_path=op_path,
                      stderr_path=self.stderr_path, namespaces=namespaces)
        try:
            if launcher is None:
                self.process = _python(BOOT, config, child.fileno(), env)
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

    def kill(self) -> None:
        """SIGKILL to the rank and to the subprocesses it started: they share the process
        group it leads (see `_python` and worker._forked_rank). Only while the rank is not
        reaped, so the group's id cannot be anyone else's; one that started a session of its
        own (`start_new_session=True`) is out of reach."""
        if self.process.returncode is None:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.process.kill()

    def stderr_tail(self, lines: int = 12, chars: int = 4000) -> str:
        """The last lines the rank wrote to its file descriptor 2 during its current request
        (see worker._stderr_to): gloo's own words when it aborted the rank."""
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4 * chars))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])[-chars:]

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_code(self) -> int:
        """The exit status, for certain: wait for the process (kill it if it lingers) first."""
        try:
            return self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def receive(self) -> tuple:
        """The next reply, with a result's frames read after it (see worker.Frames): each
        into a bytearray of its own, which the result's tensors then use as their memory."""
        reply = self.conn.recv()
        data = reply[2]
        if type(data) is tuple and data and type(data[0]) is Frames:
            total = sum(data[0].sizes)
            if total > LARGE_RESULT_BYTES and reply[1] == "ok":
                warnings.warn(f"the result of rank {self.index} is {total / 1024**3:.1f} GiB: "
                              "the notebook holds all of it (return less, or save it to a "
                              "file on the rank)", stacklevel=5)
            frames = [read_frame(self.conn.fileno()) for _ in data[0].sizes]
            reply = (*reply[:2], (frames, *data[1:]), *reply[3:])
        return reply

    def drain(self) -> bool:
        """Throw away replies nobody waits for any more (from a request that was given up);
        False if the rank is gone (exited, or its pipe is closed as it exits)."""
        try:
            while self.conn.poll():
                self.receive()
        except (EOFError, OSError):
            return False
        return self.alive()

    def release(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self.conn.close()
        self.op_slot.close()


def left_behind(ranks: list[RankProcess]) -> dict[int, list[str]]:
    """{rank: ["1234 (sleep)", ...]}: what still runs in the process group of each rank that
    has exited and been reaped already, so that killing its group is no longer certain to
    reach only its own (Linux's /proc; elsewhere nothing is found). Named, not killed."""
    exited = {rank.pid: rank.index for rank in ranks if rank.process.returncode is not None}
    found: dict[int, list[str]] = {}
    if not exited or not os.path.isdir("/proc"):
        return found
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                name, fields = f.read().rsplit(")", 1)
        except OSError:
            continue
        state, _, pgid = fields.split()[:3]
        if int(pgid) in exited and state != "Z":
            found.setdefault(exited[int(pgid)], []).append(
                f"{entry} ({name.split('(', 1)[1]})")
    return found


def kill_all(ranks: list[RankProcess], folders: list[str], launchers: list[Launcher],
             clusters: list = ()) -> None:
    """Kill every rank first, then reap each, then close the launcher, remove the folder and
    the emulated nodes (helpers.launch.cluster) the ranks ran on: killing all before waiting
    on any means one stuck rank cannot keep the others alive."""
    for rank in ranks:
        rank.kill()
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
    for cluster in clusters:
        with contextlib.suppress(Exception):
            cluster.close()
    if clusters:
        clusters.clear()


_deferring = False


@contextlib.contextmanager
def sigint_deferred():
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


def private_folder() -> str:
    _remove_stale_folders()
    # mkdtemp makes it mode 0700: private to this user.
    return tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")
