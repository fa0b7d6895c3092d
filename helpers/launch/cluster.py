"""A cluster on one Linux machine: nodes as network namespaces, joined by a shaped link.

A real cluster has two network levels: NVLink inside a node, InfiniBand between nodes (about
9–18× slower per GPU). One machine has only loopback. Linux builds the second level from its
own parts, and this module does just that, nothing more (torch-free):

* each node is a network namespace of its own, with its own loopback: the ranks of one node
  talk over it (the fast level), as GPUs of one node talk over NVLink;
* a "switch" namespace holds a bridge, and each node has one uplink (a veth pair) into it:
  every node gets its own link bandwidth into a non-blocking switch, as each node of a
  fat-tree cluster has its own NICs. (Pairwise links between nodes would give n−1 links per
  node, a bandwidth that grows with the node count, which no cluster has.)
* the kernel's token-bucket filter (`tc ... tbf`) shapes each uplink to `link_bps` bits per
  second in both directions (the node's end shapes what it sends, the switch's end what it
  receives), and counts every byte that crossed: `wire_bytes`.
* addresses come from the benchmarking range 198.18.0.0/15 (RFC 2544), node i at
  198.18.0.(i+1), inside namespaces made here and linked to nothing else: nothing outside can
  reach them, and they reach nothing outside.

What it cannot do: add latency. `netem` (the qdisc that delays packets) is missing from many
kernels, this one's included, so the slow level differs from the fast one in bandwidth only;
its α is loopback's plus whatever the shaping adds.

A rank joins its node with `join` (libc's setns: Python 3.11 has no `os.setns`) before it
opens a socket. Needs iproute2, and one of two ways to make namespaces:

* as root, named namespaces (`ip netns add`). Names carry the owner's pid; `remove_stale`
  removes only those whose owner is dead, so test suites running side by side leave each
  other's clusters alone.
* as an ordinary user, where the kernel allows user namespaces: `unshare -Urn` makes a user
  namespace (in which this user is root) with the switch's network namespace, and one
  `unshare -n` per node makes the nodes' inside it. No name can be given there (`ip netns
  add` needs root outside), so the owner holds each namespace by an open file descriptor:
  the kernel frees them, links and qdiscs included, when the owner closes them or dies, even
  by SIGKILL, and nothing can go stale. Commands run inside with `nsenter`, and a rank joins
  the user namespace first, then its node's.

`missing()` says in one line what is absent (no Linux, no iproute2, neither way works), and
the caller keeps the flat network.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass

from helpers.checks import check_int

MAX_NODES = 8
MAX_RANKS_PER_NODE = 8
# Link speeds tbf shapes well here: below 1 Mbit/s a 1 MiB collective takes seconds; above
# 100 Gbit/s the link is faster than this machine's loopback, and no longer the slow level.
MIN_LINK_BPS = 1e6
MAX_LINK_BPS = 100e9
# Real clusters: NVLink 4 gives an H100 900 GB/s (both directions together), its share of
# the node's InfiniBand NDR NICs 400 Gbit/s = 50 GB/s: 9× per direction, 18× both ways
# (NVIDIA's H100 and ConnectX-7 data sheets). The default link is this much slower than loopback.
DEFAULT_LINK_RATIO = 12
BURST_S = 0.0005            # tbf's burst: this much of the link's time, at least ...
BURST_MIN_BYTES = 65536     # ... this many bytes (see Cluster._shape)
# A resent segment as the shaper counts it: a full one (MSS 1448 B on the uplinks' 1500 B MTU,
# TCP timestamps on) with its Ethernet, IPv4 and TCP headers (14 + 20 + 32 B).
FULL_FRAME_BYTES = 1514
NETWORK = "198.18.0"        # node i is NETWORK.(i+1)/24
UPLINK = "uplink"           # the node's end of its link, the same name in every node
_PREFIX = "plab"
_NAME = re.compile(rf"^{_PREFIX}(\d+)c(\d+)(?:n\d+|sw)$")
_SERIAL = itertools.count(1)
_NETNS_DIR = "/run/netns"   # where `ip netns add` mounts a named namespace
# Every open cluster of this process, closed at interpreter exit and by live.py's SIGTERM/SIGHUP
# handler (`close_all`).
_OPEN: "weakref.WeakSet[EmulatedCluster]" = weakref.WeakSet()


def check_link_bps(link_bps) -> float:
    """Bits per second of the link between nodes, in [MIN_LINK_BPS, MAX_LINK_BPS]."""
    ok = (isinstance(link_bps, (int, float)) and not isinstance(link_bps, bool)
          and MIN_LINK_BPS <= link_bps <= MAX_LINK_BPS)
    if not ok:
        raise ValueError(f"link_bps must be bits per second in [{MIN_LINK_BPS:.0e}, "
                         f"{MAX_LINK_BPS:.0e}] (1 Mbit/s to 100 Gbit/s), got {link_bps!r}")
    return float(link_bps)


def check_nodes(nodes, world_size: int) -> int:
    """2 … MAX_NODES nodes that share `world_size` ranks evenly, at most MAX_RANKS_PER_NODE each."""
    nodes = check_int("nodes", nodes, 2, MAX_NODES)
    if world_size % nodes:
        raise ValueError(f"nodes must divide world_size={world_size} (every node holds as many "
                         f"ranks), got nodes={nodes}")
    check_int("ranks per node (world_size / nodes)", world_size // nodes, 1, MAX_RANKS_PER_NODE)
    return nodes


def format_link(link_bps: float) -> str:
    """'530 Mbit/s (66 MB/s)': the network's unit, and the course's bytes beside it."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if link_bps >= scale:
            return f"{link_bps / scale:.3g} {unit} ({link_bps / 8e6:.3g} MB/s)"
    return f"{link_bps:.3g} bit/s"


def missing() -> str | None:
    """What this machine lacks for emulated nodes, in one line; None when nothing is."""
    if not sys.platform.startswith("linux"):
        return f"emulated nodes need Linux network namespaces; this is {sys.platform}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"emulated nodes need iproute2's `{tool}` (apt-get install iproute2)"
    if shutil.which("nsenter") is None:
        return "emulated nodes need util-linux's `nsenter` (apt-get install util-linux)"
    if os.geteuid() == 0:
        return None
    return _user_namespaces_refused()


@functools.lru_cache(maxsize=None)
def _user_namespaces_refused() -> str | None:
    """Not root: None where this user can make a user namespace and, inside it, a veth pair
    shaped by tbf (what EmulatedCluster does); otherwise why not, in one line. Asked once
    per process (about 10 ms)."""
    if shutil.which("unshare") is None:
        return "emulated nodes need root, or util-linux's `unshare` for an ordinary user's"
    probe = (f"{_tool('ip')} link add probe0 type veth peer name probe1 && "
             f"{_tool('tc')} qdisc add dev probe0 root tbf rate 1mbit burst 65536 latency 200ms")
    try:
        done = subprocess.run(["unshare", "-Urn", "sh", "-c", probe], capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        done = subprocess.CompletedProcess([], 1, "", str(error))
    if done.returncode == 0:
        return None
    why = (done.stderr.strip().splitlines() or [f"status {done.returncode}"])[-1]
    return (f"emulated nodes need root, or user namespaces for an ordinary user, which were "
            f"refused here (`unshare -Urn`: {why})")


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _run(*args: str) -> str:
    done = subprocess.run([_tool(args[0]), *args[1:]], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=30)
    if done.returncode:
        raise OSError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _hold(command: list[str]) -> subprocess.Popen:
    """Start a process that makes a namespace and holds it until its stdin closes; once it
    said "ready". Its own session: a Ctrl-C at a terminal is not its to receive."""
    proc = subprocess.Popen([_tool(command[0]), *command[1:]], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()  # "ready", or nothing once it failed
        if line.strip() != b"ready":
            proc.wait(timeout=30)
            why = proc.stderr.read().decode(errors="replace").strip() or proc.returncode
            raise OSError(f"`{' '.join(command[:-3])}` failed: {why}")
    except BaseException:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def our_namespaces() -> list[str]:
    """Every namespace this module made, by any process, live or stale."""
    if missing():
        return []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return [line.split()[0] for line in _run("ip", "netns", "list").splitlines()
                if line.strip() and _NAME.match(line.split()[0])]
    return []


def remove_stale() -> list[str]:
    """Remove the namespaces (and with them their links and qdiscs) whose owner is dead."""
    removed = []
    for name in our_namespaces():
        if not _pid_alive(int(_NAME.match(name).group(1))):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _run("ip", "netns", "del", name)
                removed.append(name)
    return removed


def join(*paths: str) -> None:
    """Move the calling process (a rank, before it starts any thread: the kernel lets only a
    single-threaded process join a user namespace) into each namespace in turn: a node's
    `NodeInfo.namespaces`."""
    libc = ctypes.CDLL(None, use_errno=True)
    # Every path is opened first: once inside a user namespace, the owner's /proc entries
    # (the paths of `EmulatedCluster._keep`) are no longer this process's to open.
    fds = [os.open(path, os.O_RDONLY) for path in paths]
    try:
        for path, fd in zip(paths, fds):
            if libc.setns(fd, 0) != 0:  # 0: whatever kind of namespace `path` is
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {path}: {os.strerror(err)}")
    finally:
        for fd in fds:
            os.close(fd)


@dataclass(frozen=True)
class NodeInfo:
    """Where one node is: its namespace (a name as root; a label otherwise), the path that
    opens it, and its address on the link. As an ordinary user, the user namespace that
    owns it is joined first."""
    index: int
    netns: str
    address: str
    netns_path: str
    userns_path: str | None = None

    @property
    def namespaces(self) -> tuple[str, ...]:
        """What a process joins, in order, to be on this node (see `join`)."""
        return tuple(p for p in (self.userns_path, self.netns_path) if p)


# A process that holds a new namespace until its stdin closes: it says "ready" once it is in
# it (unshare and nsenter exec it there, so its pid is theirs).
_HOLD = ("sh", "-c", "echo ready; exec cat >/dev/null")


class EmulatedCluster:
    """`nodes` network namespaces, each with an uplink of `link_bps` into one switch.

    >>> with EmulatedCluster(2, 500e6) as cluster:
    ...     cluster.node(1).address          # '198.18.0.2'
    ...     cluster.wire_bytes()             # bytes each node sent over its uplink so far

    Made on construction (as root, stale ones of dead owners are removed first), removed by
    `close`, by the context manager's exit and at interpreter exit; a failure half-way
    removes what was made and raises one OSError saying which command failed.
    """

    def __init__(self, nodes: int, link_bps: float):
        self.nodes = check_int("nodes", nodes, 2, MAX_NODES)
        self.link_bps = check_link_bps(link_bps)
        reason = missing()
        if reason:
            raise OSError(reason)
        self.named = os.geteuid() == 0  # root: `ip netns add`; otherwise a user namespace
        if self.named:
            remove_stale()
        base = f"{_PREFIX}{os.getpid()}c{next(_SERIAL)}"
        self.switch = f"{base}sw"
        self._made: list[str] = []      # named namespaces (root), removed by close
        self._fds: list[int] = []       # namespaces held open (ordinary user), closed by close
        self._where: dict[str, tuple[str, ...]] = {}  # a namespace's name: the paths into it
        self._nodes: tuple[NodeInfo, ...] = ()
        self._lock = threading.Lock()
        _OPEN.add(self)
        try:
            if self.named:
                self._build_named(base)
            else:
                self._build_in_user_namespace(base)
        except BaseException:
            self.close()
            raise

    def run_in(self, netns: str, *command: str) -> str:
        """Run `command` (ip, tc, or cat of a /proc file) inside the namespace called `netns`
        (the switch's, or a node's `NodeInfo.netns`); what it printed. E.g.
        `run_in(cluster.node(0).netns, "tc", "-s", "qdisc")` shows node 0's shaper and its
        counters."""
        where = self._where[netns]
        enter = [f"--user={where[0]}", "--preserve-credentials"] if len(where) == 2 else []
        return _run("nsenter", *enter, f"--net={where[-1]}", _tool(command[0]), *command[1:])

    def _build_named(self, base: str) -> None:
        names = [f"{base}n{i}" for i in range(self.nodes)]
        for name in [self.switch] + names:
            _run("ip", "netns", "add", name)
            self._made.append(name)
            self._where[name] = (f"{_NETNS_DIR}/{name}",)
        self._nodes = tuple(NodeInfo(i, name, f"{NETWORK}.{i + 1}", *self._where[name])
                            for i, name in enumerate(names))
        self._link({node.netns: node.netns for node in self._nodes})  # `ip … netns NAME`

    def _build_in_user_namespace(self, base: str) -> None:
        holders = []
        try:
            switch = _hold(["unshare", "-Urn", *_HOLD])
            holders.append(switch)
            user = self._keep(f"/proc/{switch.pid}/ns/user")
            self._where[self.switch] = (user, self._keep(f"/proc/{switch.pid}/ns/net"))
            nodes, refs = [], {}
            for i in range(self.nodes):
                holder = _hold(["nsenter", f"--user={user}", "--preserve-credentials",
                                "unshare", "-n", *_HOLD])
                holders.append(holder)
                name = f"{base}n{i}"
                net = self._keep(f"/proc/{holder.pid}/ns/net")
                self._where[name] = (user, net)
                refs[name] = str(holder.pid)  # `ip … netns PID`, while it holds it
                nodes.append(NodeInfo(i, name, f"{NETWORK}.{i + 1}", net, user))
            self._nodes = tuple(nodes)
            self._link(refs)
        finally:
            for holder in holders:  # the open descriptors hold the namespaces from now on
                holder.stdin.close()
                holder.wait()

    def _keep(self, path: str) -> str:
        """Hold the namespace at `path` open; the path through which any process of this
        user opens it, while this process holds it."""
        fd = os.open(path, os.O_RDONLY)
        self._fds.append(fd)
        return f"/proc/{os.getpid()}/fd/{fd}"

    def _link(self, refs: dict[str, str]) -> None:
        """The switch, every node's uplink into it, and the shapers. `refs`: how `ip` names
        each node's namespace (a name, or the pid of a process in it)."""
        for name in self._where:
            self.run_in(name, "ip", "link", "set", "lo", "up")
        self.run_in(self.switch, "ip", "link", "add", "switch", "type", "bridge")
        self.run_in(self.switch, "ip", "link", "set", "switch", "up")
        for node in self._nodes:
            port = f"port{node.index}"
            self.run_in(self.switch, "ip", "link", "add", port, "type", "veth",
                     "peer", "name", UPLINK, "netns", refs[node.netns])
            self.run_in(node.netns, "ip", "addr", "add", f"{node.address}/24", "dev", UPLINK)
            self.run_in(node.netns, "ip", "link", "set", UPLINK, "up")
            self.run_in(self.switch, "ip", "link", "set", port, "master", "switch")
            self.run_in(self.switch, "ip", "link", "set", port, "up")
        self._shape("add")

    def _ends(self):
        """Both ends of every uplink: (namespace, device)."""
        for node in self._nodes:
            yield node.netns, UPLINK
            yield self.switch, f"port{node.index}"

    def _shape(self, verb: str) -> None:
        # burst: the bytes that may pass faster than the link after it was idle. A wire has
        # none, so keep it small: half a millisecond of the link, at least 64 KiB (a segment
        # the kernel hands tbf whole can be that large). With 4 ms of burst (272 KB at
        # 540 Mbit/s) a pipeline hop of 128 KiB that followed some compute crossed at nearly
        # loopback speed, where back-to-back transfers ran at the link's rate. Smaller than
        # 64 KiB, back-to-back small messages wait for the shaper's timer on busy cores, and
        # the link's α–β fit missed its own sweep by 10-50 %. The queue holds 200 ms, so
        # that TCP's bursts wait instead of being dropped.
        burst = max(BURST_MIN_BYTES, int(self.link_bps / 8 * BURST_S))
        for netns, dev in self._ends():
            self.run_in(netns, "tc", "qdisc", verb, "dev", dev, "root", "tbf",
                 "rate", f"{int(self.link_bps)}bit", "burst", str(burst), "latency", "200ms")

    def set_link(self, link_bps: float) -> None:
        """A new speed for every uplink, in place: ranks keep running (their counters restart)."""
        link_bps = check_link_bps(link_bps)
        with self._lock:
            self.link_bps = link_bps
            self._shape("change")

    def node(self, index: int) -> NodeInfo:
        return self._nodes[check_int("node", index, 0, self.nodes - 1)]

    @property
    def node_infos(self) -> tuple[NodeInfo, ...]:
        return self._nodes

    def wire_bytes(self) -> list[int]:
        """Bytes (with their Ethernet, IP and TCP headers) each node sent over its uplink since
        the link was made or last changed, as the kernel's shaper counted them."""
        return [self._shaper_count(node.netns, UPLINK, "bytes") for node in self._nodes]

    def retransmitted_segments(self) -> list[int]:
        """TCP segments each node sent a second time since it was made (the kernel's
        RetransSegs in the node's namespace). On a busy machine an acknowledgement can come
        late through the shaper's queue, TCP sends the segment again, and the shaper counts
        it twice: `wire_bytes` then holds more than one pass of the data."""
        counts = []
        for node in self._nodes:
            rows = [line.split() for line in self.run_in(node.netns, "cat", "/proc/net/snmp").splitlines()
                    if line.startswith("Tcp:")]
            counts.append(int(rows[1][rows[0].index("RetransSegs")]))
        return counts

    def drops(self) -> int:
        """Packets any shaper dropped (its queue was full): a sign of a link set too slow."""
        return sum(self._shaper_count(netns, dev, "drops") for netns, dev in self._ends())

    def _shaper_count(self, netns: str, dev: str, field: str) -> int:
        """One counter ("bytes", "drops", ...) of the tbf shaper on `dev` in `netns`."""
        stats = json.loads(self.run_in(netns, "tc", "-s", "-j", "qdisc", "show", "dev", dev))
        return sum(int(q.get(field, 0)) for q in stats if q.get("kind") == "tbf")

    def close(self) -> None:
        """Remove every namespace made (their links and qdiscs go with them) or let go of
        them (the kernel frees each once no process is left inside); idempotent."""
        with self._lock:
            while self._made:
                name = self._made.pop()
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    _run("ip", "netns", "del", name)
            while self._fds:
                with contextlib.suppress(OSError):
                    os.close(self._fds.pop())

    @property
    def closed(self) -> bool:
        return not self._made and not self._fds

    def __enter__(self) -> "EmulatedCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"link {format_link(self.link_bps)}"
        return f"EmulatedCluster(nodes={self.nodes}, {state})"


def close_all() -> None:
    """Close every cluster this process made (at exit, and on SIGTERM/SIGHUP via live.py)."""
    for cluster in list(_OPEN):
        cluster.close()


atexit.register(close_all)


# -- rank functions (they import torch when they run, on a rank) -----------------------------

def loopback_busbw(rank: int, world_size: int, nbytes: int = 8 * 1024**2, iters: int = 5) -> float:
    """Rank function: the bus bandwidth (bytes/s) of an all-reduce of `nbytes`, median of
    `iters` after one warm-up."""
    import statistics
    import time

    import torch
    import torch.distributed as dist
    x = torch.ones(nbytes // 4)
    dist.all_reduce(x)
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    seconds = torch.tensor([statistics.median(times)])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # every rank returns the same number
    return 2 * (world_size - 1) / world_size * nbytes / float(seconds)


@dataclass(frozen=True)
class Whereabouts:
    """Where a rank runs: its network namespace (the inode of /proc/self/ns/net) and the
    address its transports bind to."""
    rank: int
    netns_inode: int
    address: str


def whereabouts(rank: int, world_size: int) -> Whereabouts:
    """Rank function: which namespace this rank is in, and the address gloo binds to."""
    import socket
    import struct
    try:
        import fcntl
        name = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        address = socket.inet_ntoa(packed[20:24])  # SIOCGIFADDR
    except OSError:
        address = "127.0.0.1"
    return Whereabouts(rank, os.stat("/proc/self/ns/net").st_ino, address)
