"""`LiveRanks`: ranks kept alive between calls, and `spawn`, the one-call form of it.

`spawn(fn, world_size, ...)` is the lecture's `mp.spawn` done right: fresh processes, each in
a real `torch.distributed` process group, returning `[fn(0, N, ...), fn(1, N, ...), ...]`.
`LiveRanks(world_size)` keeps those processes (and their process group) alive between calls,
so a slider can re-run a collective in milliseconds instead of seconds.

Why it is built this way:
* Rendezvous goes through a `FileStore` in a private temporary folder, so no TCP store listens
  at all; gloo and NCCL bind their transports to the loopback interface, whatever the
  environment says, unless the reader asks for `multi_node=True` (helpers.launch.host).
* The call crosses as cloudpickle bytes (helpers.launch.shipping): a function typed into a
  cell goes by value, one from a module by name; what cannot cross fails before any start.
* Each call first checks the module files the ranks imported: one changed on disk since
  means fresh ranks, so no rank runs old code and all run the same.
* After each call the lab's process group is the default one again: a function that
  destroyed or replaced it gets the lab's back before the next call (see worker._tidy_groups).
* Checked collectives (`check_collectives=True`) are a setting of the process group: the
  ranks learn it when the lab forms the group (see worker._check_collective).
* Every request carries an id and every reply is matched to it; a call that was cut short
  (an error, a timeout, an interrupt) marks the ranks dirty and they are killed, then reaped,
  with interrupts held back (helpers.launch.process), so the next call always starts from a
  known state.
* One lock per `LiveRanks` serialises calls from several threads; a per-process cap on live
  rank processes (the least recently used `LiveRanks` is stopped and restarts lazily) keeps
  re-run cells from piling up processes.
* Every `LiveRanks` of this process is in one pool, so SIGTERM and SIGHUP (which end Python
  without atexit) can still kill every rank and remove every private folder first.

The two settings below are read at call time. Readers set them through helpers.ranks
(`helpers.ranks.LIVE_RANK_LIMIT = n`), which forwards the assignment here.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
import weakref
from typing import Callable

from helpers.launch import cluster as emulated
from helpers.launch.checks import check_rank_function, check_timeout, check_world_size
from helpers.launch.errors import RankError, RankTimeoutError, describe_exit
from helpers.launch.host import (TRANSPORT_VARIABLES, max_cpu_world_size, pin_transports,
                                 resolve_backend)
from helpers.launch.process import (POLL_S, Launcher, RankProcess, kill_all, left_behind,
                                    private_folder, sigint_deferred)
from helpers.launch.shipping import (changed_files, loads_frames, pack, shown_path,
                                     with_cell_lines)

# Most rank processes one kernel keeps alive at once (None: `max_cpu_world_size()`).
LIVE_RANK_LIMIT: int | None = None
# On emulated nodes the ranks restart with every placement, and each builds an optimizer, whose
# first parameter group imports torch._dynamo (1.5 s of a core, per rank and restart): the
# cluster's launcher imports it once, and the ranks it forks have it.
CLUSTER_PRELOAD = ("torch._dynamo",)
# Fork ranks from a launcher that imported torch once (Linux only: see helpers.launch.worker).
FORK_RANKS = sys.platform.startswith("linux")
# The parent waits this much longer than the collective timeout before it stops waiting for
# a rank on its own, so that the rank's own (more precise) timeout error arrives first.
_GRACE_S = 5.0
# How long a rank's error from inside a collective waits for a peer to die (see _dead_peer).
_DEATH_S = 2.0
# A starting rank imports torch before it answers: allow for that on a busy machine.
_START_S = 120.0


def live_rank_limit() -> int:
    """Most rank processes this process keeps alive over all its `LiveRanks` together."""
    return LIVE_RANK_LIMIT if LIVE_RANK_LIMIT is not None else max_cpu_world_size()


def _notice(text: str) -> None:
    """One line for the reader about something done on their behalf."""
    print(f"helpers.ranks: {text}", file=sys.stderr, flush=True)


# Every LiveRanks of this process, for the cap on live ranks and for the exit handlers.
_POOL: "weakref.WeakSet[LiveRanks]" = weakref.WeakSet()
_POOL_LOCK = threading.Lock()  # a WeakSet may not change while another thread copies it
_CLOCK = itertools.count(1)
_exit_handlers_installed = False


def _on_exit_signal(signum, frame) -> None:
    """Kill our ranks and remove our folders, then die of the same signal as before."""
    for group in list(_POOL):  # no locks: the code this signal interrupted may hold them
        kill_all(group._ranks, group._folders, group._launchers, group._clusters)
    emulated.close_all()
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
        if other._lock._is_owned():  # this thread is inside a call on it: a signal handler
            continue
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

    `timeout` is how long a collective may wait for its peers, in seconds (at least 1; None:
    no limit).
    `check_collectives=True` compares every collective across its group's ranks before it
    runs: kind, reduce op, root, dtype, shape, group and a per-group sequence number; a
    difference raises the same CollectiveMismatchError on every rank, naming the field and
    the ranks (docs/checked_collectives.md). Its cost is one more small all_reduce per call:
    a 1 KiB all_reduce on 2 gloo ranks took 1.0–1.4 ms instead of 0.30–0.48 ms (medians of
    2,000 calls in six runs on a 2-core machine, idle and loaded). Send and recv are not
    checked.
    `multi_node=True` lets inherited GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / TP_SOCKET_IFNAME
    choose the interface; by default every transport is pinned to loopback.
    `nodes=n` runs the ranks on n emulated nodes (helpers.launch.cluster): network namespaces
    whose uplinks into one switch are shaped to `link_bps` bits per second (default: this
    machine's loopback all-reduce bandwidth / DEFAULT_LINK_RATIO, measured on first start).
    Rank r sits on node `placement[r]` (default r // (world_size / n): consecutive ranks share
    a node, as a launcher places them); `place(...)` moves them (the ranks restart).
    Where namespaces cannot be made (not Linux, not root, no iproute2) one line says why and
    the ranks run on the flat network.
    Calls from several threads are serialised. A kernel keeps at most `live_rank_limit()`
    rank processes alive over all its LiveRanks: the least recently used is stopped (with a
    one-line notice) and restarts on its next call.
    """

    def __init__(self, world_size: int, backend: str = "auto", timeout: float | None = 60,
                 multi_node: bool = False, check_collectives: bool = False,
                 nodes: int | None = None, link_bps: float | None = None):
        self._world_size = check_world_size(world_size)
        self.nodes, self.link_bps, self.link_note = self._check_nodes(nodes, link_bps)
        self._placement: tuple[int, ...] | None = None  # None: consecutive ranks share a node
        self._told_link: float | None = None
        self.backend = resolve_backend(backend, world_size)
        self.timeout = check_timeout(timeout)
        if not isinstance(multi_node, bool):
            raise TypeError(f"multi_node must be True or False, got {multi_node!r}")
        self.multi_node = multi_node
        if not isinstance(check_collectives, bool):
            raise TypeError(f"check_collectives must be True or False, got {check_collectives!r}")
        self.check_collectives = check_collectives
        self._ranks: list[RankProcess] = []
        self._folders: list[str] = []  # the private folder while ranks run (at most one)
        self._launchers: list[Launcher] = []  # the ranks' launcher while they run (at most one)
        self._clusters: list = []      # their emulated nodes while they run (at most one)
        self._group_size = 0           # size of the process group the ranks have joined
        self._generation = 0
        self._requests = itertools.count(1)  # request 0 is each rank's "ready"
        self._dirty = False            # a call is running, or was cut short
        self._one_call = False         # spawn's: its ranks end with the call
        # {file: (mtime, size)} of the reader's and the project's modules the ranks imported
        self._module_files: dict[str, tuple[int, int]] = {}
        self._lock = threading.RLock()
        self._inside: str | None = None  # the last call that held the lock ("run", "close")
        self._last_used = 0
        # Close on garbage collection and at interpreter exit, whichever comes first. (The
        # finalizer holds the lists themselves, so they are only ever changed in place.)
        self._finalizer = weakref.finalize(self, kill_all, self._ranks, self._folders,
                                           self._launchers, self._clusters)
        with _POOL_LOCK:
            _POOL.add(self)

    @property
    def world_size(self) -> int:
        return self._world_size

    def resize(self, world_size: int) -> "LiveRanks":
        world_size = check_world_size(world_size)
        # The backend chosen at construction stays: one object never mixes NCCL and gloo.
        resolve_backend(self.backend, world_size)
        if self.nodes:
            emulated.check_nodes(self.nodes, world_size)
        with self._one_at_a_time("resize"):
            if self.nodes and world_size != self._world_size:
                self._teardown()  # every rank's node changes: they start afresh on theirs
                self._placement = None
            self._world_size = world_size
        return self

    # -- emulated nodes --------------------------------------------------------------------

    def _check_nodes(self, nodes, link_bps) -> tuple[int | None, float | None, str]:
        if nodes is None:
            if link_bps is not None:
                raise ValueError("link_bps needs nodes=n (2 or more emulated nodes), got "
                                 f"link_bps={link_bps!r} with nodes=None")
            return None, None, ""
        nodes = emulated.check_nodes(nodes, self._world_size)
        if link_bps is not None:
            link_bps = emulated.check_link_bps(link_bps)
        reason = emulated.missing()
        if reason:
            _notice(f"{reason}; the {self._world_size} ranks run on the flat network")
            return None, None, ""
        return nodes, link_bps, "" if link_bps is None else "set by the reader"

    @property
    def placement(self) -> tuple[int, ...] | None:
        """The node of each rank (None on the flat network)."""
        if not self.nodes:
            return None
        k = self._world_size // self.nodes
        return self._placement or tuple(r // k for r in range(self._world_size))

    def place(self, placement) -> "LiveRanks":
        """Put rank r on node placement[r] (each node holds world_size / nodes ranks); the
        ranks restart on their new nodes at the next call if any moved."""
        if not self.nodes:
            raise ValueError("place() needs emulated nodes: LiveRanks(..., nodes=n)")
        placement = tuple(placement)
        k = self._world_size // self.nodes
        if (len(placement) != self._world_size
                or any(isinstance(n, bool) or not isinstance(n, int) for n in placement)
                or sorted(placement) != sorted(r // k for r in range(self._world_size))):
            raise ValueError(f"placement must give each of the {self._world_size} ranks a node "
                             f"in 0 … {self.nodes - 1}, {k} ranks on every node, "
                             f"got {placement!r}")
        with self._one_at_a_time("place"):
            if placement != self.placement:
                self._teardown(ranks_only=True)  # the nodes and the launcher stay
            self._placement = placement
        return self

    def set_link(self, link_bps: float) -> "LiveRanks":
        """A new speed for the link between nodes; running ranks keep running."""
        if not self.nodes:
            raise ValueError("set_link() needs emulated nodes: LiveRanks(..., nodes=n)")
        link_bps = emulated.check_link_bps(link_bps)
        with self._one_at_a_time("set_link"):
            self.link_bps, self.link_note = link_bps, "set by the reader"
            if self._clusters:
                self._clusters[0].set_link(link_bps)
        return self

    @property
    def cluster(self):
        """The emulated nodes the ranks run on now (None before they start, or when flat)."""
        return self._clusters[0] if self._clusters else None

    def wire_bytes(self, resent: bool = True) -> int:
        """Bytes that crossed between nodes so far (every uplink's shaper counted what its node
        sent, headers included); 0 before the ranks start. Take differences around a call.
        resent=False: less the segments TCP sent a second time (each a full frame), which a busy
        machine adds at random: one pass of the data, what a formula plus headers accounts for."""
        if not self.cluster:
            return 0
        sent = sum(self.cluster.wire_bytes())
        if resent:
            return sent
        return sent - emulated.FULL_FRAME_BYTES * sum(self.cluster.retransmitted_segments())

    def _make_cluster(self) -> None:
        if self.link_bps is None:
            loopback = loopback_bandwidth()
            self.link_bps = min(max(8 * loopback / emulated.DEFAULT_LINK_RATIO,
                                    emulated.MIN_LINK_BPS), emulated.MAX_LINK_BPS)
            self.link_note = (f"this machine's loopback all-reduce bandwidth "
                              f"{loopback / 1e9:.2f} GB/s (measured) / "
                              f"{emulated.DEFAULT_LINK_RATIO}")
        self._clusters.append(emulated.EmulatedCluster(self.nodes, self.link_bps))
        if self._told_link == self.link_bps:  # said once per link, not at every restart
            return
        self._told_link = self.link_bps
        _notice(f"{self.nodes} emulated nodes × {self._world_size // self.nodes} ranks, "
                f"link {emulated.format_link(self.link_bps)}: {self.link_note}")

    def run(self, fn: Callable, *args, **kwargs) -> list:
        """`[fn(r, world_size, *args, **kwargs) for r in ranks]`, each on its own rank."""
        check_rank_function(fn)
        payload = pack(fn, args, kwargs)  # what cannot be sent fails here, before any start
        what = "run " + _name(fn)
        with self._one_at_a_time("run"):
            self._last_used = next(_CLOCK)
            try:
                if self._dirty:  # an earlier call was cut short: its ranks' state is unknown
                    self._teardown()
                self._restart_if_stale()
                self._dirty = True
                self._ensure_group()
                replies = self._exchange(self._ranks[:self._world_size], "run", (payload,), what)
                self._dirty = False
                self._reclaim_group([group for _, group in replies], _name(fn))
            except BaseException:
                # An error on a rank, a timeout or an interrupt may leave ranks blocked in a
                # collective: tear all of them down; the next call starts afresh.
                self._teardown()
                raise
        return [_unpickle(rank, data, what) for rank, (data, _) in enumerate(replies)]

    def _reclaim_group(self, groups: list[str | None], name: str) -> None:
        """After a call whose function destroyed the lab's default process group (the last
        line of every mp.spawn tutorial) or replaced it with its own on some rank: the next
        call forms the lab's group again first, so it neither fails nor runs in the wrong
        group. One line says so (not for `spawn`: its ranks end with the call)."""
        changed = sorted({g for g in groups if g})
        if not changed:
            return
        self._group_size = 0  # _ensure_group leaves whatever group is left and forms the lab's
        if not self._one_call:
            where = ", ".join(str(r) for r, g in enumerate(groups) if g)
            _notice(f"{name} {' and '.join(changed)} the default process group (rank(s) {where}); "
                    "the next call forms the lab's group again and runs in it")

    def _restart_if_stale(self) -> None:
        """Ranks keep the modules they imported: when one of the reader's or the project's
        module files they loaded changed on disk, stop them all (the next start imports the
        file as it is now), so no rank runs old code and all run the same."""
        changed = changed_files(self._module_files)
        if changed and self._ranks:
            more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
            _notice(f"{shown_path(changed[0])}{more} changed on disk since the ranks started; "
                    "starting fresh ranks so that every rank runs the code as it is now")
            self._teardown()

    def close(self) -> None:
        """Stop every rank and remove the private folder; the next `run` starts afresh."""
        with self._one_at_a_time("close"):
            self._teardown()

    @contextlib.contextmanager
    def _one_at_a_time(self, what: str):
        """The lock that serialises calls from several threads. The same thread coming back
        in while it is inside a call can only be a signal handler (or a finalizer) that
        interrupted that call: refused with one error, before it touches the ranks. (The
        lock's own record of its owner decides: a flag of ours could be left set by an
        interrupt landing in the very line that clears it.)"""
        if self._lock._is_owned():  # an RLock this thread holds: it is inside a call
            raise RuntimeError(
                f"LiveRanks.{what}() was called while this thread is inside "
                f"LiveRanks.{self._inside}() of the same object (from a signal handler?); "
                "calls on one LiveRanks cannot nest: call it after that one returns")
        with self._lock:
            self._inside = what  # for that message only
            yield

    def __enter__(self) -> "LiveRanks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        alive = sum(r.alive() for r in list(self._ranks))
        where = ""
        if self.nodes:
            link = emulated.format_link(self.link_bps) if self.link_bps else "measured on start"
            where = f", nodes={self.placement}, link={link}"
        return (f"LiveRanks(world_size={self._world_size}, backend={self.backend!r}, "
                f"processes={alive}{where})")

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in list(self._ranks)]

    # -- internals ------------------------------------------------------------------------

    def _teardown(self, ranks_only: bool = False) -> None:
        """Kill, reap, remove the folder, with interrupts held back: whatever happens the
        object is left ready for the next call. `ranks_only`: the ranks go, and the launcher,
        the folder and the emulated nodes stay for the next ones (ranks that only move to
        other nodes: a new launcher would import torch again, about 2 s on 2 cores)."""
        with sigint_deferred():
            self._group_size = 0
            for index, still in sorted(left_behind(self._ranks).items()):
                _notice(f"rank {index} had exited before it could be stopped with the processes "
                        f"it started; still running: {', '.join(still)}")
            if ranks_only:
                kill_all(self._ranks, [], [])
            else:
                kill_all(self._ranks, self._folders, self._launchers, self._clusters)
            self._module_files.clear()
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
        self._exchange(self._ranks[:n], "init",
                       (n, store, self.backend, self.timeout, self.check_collectives),
                       "init_process_group")
        self._group_size = n

    def _replace_dead(self) -> None:
        """A rank that died while idle (killed, OOM, its creating thread's PDEATHSIG) broke
        the process group: say which, then start every rank afresh."""
        dead = [r for r in self._ranks if not r.drain()]
        if dead:
            which = ", ".join(f"rank {r.index} ({describe_exit(r.exit_code())})" for r in dead)
            if self._launchers and not self._launchers[0].alive():
                code = self._launchers[0].process.returncode
                which = f"the ranks' launcher ({describe_exit(code)}), and with it every rank,"
            _notice(f"{which} had exited while idle; starting fresh ranks")
            self._teardown()

    def _start(self, missing: int) -> None:
        if missing <= 0:
            return
        _make_room(self, missing)
        _install_exit_handlers()
        env = pin_transports(dict(os.environ), self.multi_node)
        new = []
        if self.nodes and not self._clusters and self.link_bps is None:
            loopback_bandwidth()  # measured before anything of ours exists: interruptible
        with sigint_deferred():  # every started process is recorded before an interrupt lands
            if self.nodes and not self._clusters:
                self._make_cluster()
            if not self._folders:
                self._folders.append(private_folder())
            if FORK_RANKS and not self._launchers:
                self._launchers.append(Launcher(env, CLUSTER_PRELOAD if self.nodes else ()))
        launcher = self._launchers[0] if self._launchers else None
        if launcher is not None:
            launcher.wait_ready(_START_S)  # importing torch: an interrupt may land here
        with sigint_deferred():
            for index in range(len(self._ranks), len(self._ranks) + missing):
                namespaces, rank_env = (), env
                if self._clusters:  # its node's namespace, its transports on the uplink
                    namespaces = self._clusters[0].node(self.placement[index]).namespaces
                    rank_env = dict(env, **{v: emulated.UPLINK for v in TRANSPORT_VARIABLES})
                new.append(RankProcess(index, self._folders[0], rank_env, launcher, namespaces))
                self._ranks.append(new[-1])
        self._await(new, 0, "start", _START_S)

    def _exchange(self, ranks: list[RankProcess], kind: str, args: tuple, what: str) -> list:
        request = next(self._requests)
        for rank in ranks:
            rank.drain()
            try:
                rank.conn.send((request, kind, args))
            except OSError:
                raise self._died(rank, what) from None
        wait = None if self.timeout is None else self.timeout + _GRACE_S
        return self._await(ranks, request, what, wait)

    def _await(self, ranks: list[RankProcess], request: int, what: str,
               seconds: float | None) -> list:
        """Each rank's reply to `request`, in rank order; replies to older requests are
        dropped. Raises as soon as one rank fails, dies, or the time is up."""
        replies: dict[int, tuple] = {}
        pending = {rank.conn: rank for rank in ranks}
        deadline = math.inf if seconds is None else time.monotonic() + seconds
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out(ranks, pending, what, seconds)
            for conn in mpc.wait(list(pending), timeout=min(left, POLL_S)):
                rank = pending[conn]
                try:
                    reply = rank.receive()
                except (EOFError, OSError):
                    raise self._died(rank, what) from None
                for path, stamp in reply[5].items():  # the first stays, so a later edit shows
                    self._module_files.setdefault(path, stamp)
                if reply[0] != request:
                    continue  # stale: the answer to a request that was given up
                del pending[conn]
                replies[rank.index] = reply
                if reply[1] != "ok":  # "error", or "timeout": see worker._status
                    self._show(replies)
                    # A rank that died takes down the collectives it was in, so its peers
                    # fail too, and their errors may be read first: name the dead rank (the
                    # cause). Its pipe closed as it exited, before a peer could notice.
                    dead = _dead_peer(rank, reply[1], pending)
                    if dead is not None:
                        raise self._died(dead, what)
                    raise self._failed(rank, reply, ranks, replies, pending)
            for rank in list(pending.values()):  # dead, but its pipe held open by a child
                if not rank.alive() and not rank.conn.poll():
                    raise self._died(rank, what)
        self._show(replies)
        return [replies[r.index][2] for r in ranks]

    def _died(self, rank: RankProcess, what: str) -> RankError:
        code = rank.exit_code()  # reaped before it is read: never "exit code None"
        said = rank.stderr_tail()
        said = f"; its last words on stderr:\n{said}" if said else ""
        return RankError(rank.index, rank.op or what,
                         f"rank {rank.index} died ({describe_exit(code)}){said}")

    def _failed(self, rank: RankProcess, reply: tuple, ranks: list[RankProcess],
                replies: dict, pending: dict) -> RankError:
        if reply[1] == "timeout":  # the rank's own flag, with the seconds it was allowed
            tb, limit = reply[2]
            others = _what_each_did(ranks, replies, pending)
            del others[rank.index]
            return RankTimeoutError(rank.index, rank.op, with_cell_lines(tb), limit, others)
        return RankError(rank.index, rank.op, with_cell_lines(reply[2]))

    def _timed_out(self, ranks: list[RankProcess], pending: dict, what: str,
                   waited: float) -> RankTimeoutError:
        stuck = min(pending.values(), key=lambda r: r.index)
        others = _what_each_did(ranks, {}, pending)
        del others[stuck.index]
        # A rank in no collective is running Python code; one starting or forming the group
        # is inside that step.
        doing = stuck.op or (None if what.startswith("run ") else what)
        return RankTimeoutError(stuck.index, doing, "(no reply from the rank)", self.timeout,
                                others, waited=waited)

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


def _dead_peer(failed: RankProcess, status: str, pending: dict) -> RankProcess | None:
    """A rank of `pending` that died. When `failed` raised inside a collective (not a
    timeout), a peer's death is the likely cause, and a rank that gloo aborts takes a moment
    to exit: wait up to _DEATH_S for that, or until every pending rank has answered."""
    wait_until = time.monotonic() + (_DEATH_S if failed.op and status == "error" else 0.0)
    answered: set[int] = set()
    while True:
        for rank in pending.values():
            with contextlib.suppress(EOFError, OSError):
                if rank.conn.poll():
                    answered.add(rank.index)
            if not rank.drain():
                return rank
        if time.monotonic() >= wait_until or len(answered) == len(pending):
            return None
        time.sleep(0.05)


def _what_each_did(ranks: list[RankProcess], replies: dict, pending: dict) -> dict:
    """{rank: "returned", "timed out", the collective it is inside, or None (Python code)}."""
    found = {}
    for rank in ranks:
        if rank.conn in pending:
            found[rank.index] = rank.op
        elif rank.index in replies:
            found[rank.index] = {"ok": "returned", "timeout": "timed out"}.get(
                replies[rank.index][1], "failed")
    return found


def _unpickle(rank: int, frames: list, what: str):
    try:
        return loads_frames(frames)
    except Exception as e:  # e.g. a class the rank could import and the notebook cannot
        raise RankError(rank, what, f"the result of rank {rank} could not be unpickled in this "
                        f"process: {type(e).__name__}: {e}") from e


def _name(fn: Callable) -> str:
    target = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(target, "__qualname__", repr(fn))


_LOOPBACK_BPS: list[float] = []  # bytes per second, measured once per process


def loopback_bandwidth() -> float:
    """Bytes per second of a 2-rank gloo all-reduce of 8 MiB over loopback (nccl-tests' busbw,
    median of 5), measured once per process: the fast level the default link is set against."""
    if not _LOOPBACK_BPS:
        _LOOPBACK_BPS.append(spawn(emulated.loopback_busbw, 2, backend="gloo")[0])
    return _LOOPBACK_BPS[0]


def spawn(fn: Callable, world_size: int, *args, backend: str = "auto",
          timeout: float | None = 60, multi_node: bool = False, check_collectives: bool = False,
          nodes: int | None = None, link_bps: float | None = None, **kwargs) -> list:
    """Start `world_size` fresh processes, run `fn(rank, world_size, *args, **kwargs)` on each
    inside a process group, tear everything down, and return the results in rank order.
    The keywords are LiveRanks'."""
    check_rank_function(fn)
    with LiveRanks(world_size, backend=backend, timeout=timeout, multi_node=multi_node,
                   check_collectives=check_collectives, nodes=nodes, link_bps=link_bps) as ranks:
        ranks._one_call = True
        return ranks.run(fn, *args, **kwargs)
