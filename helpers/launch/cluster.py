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
opens a socket. Names carry the owner's pid; `remove_stale` removes only those whose owner is
dead, so test suites running side by side leave each other's clusters alone. Needs root (or
CAP_SYS_ADMIN) and iproute2; `missing()` says in one line what is absent, and the caller
keeps the flat network.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
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
NETWORK = "198.18.0"        # node i is NETWORK.(i+1)/24
UPLINK = "uplink"           # the node's end of its link, the same name in every node
_PREFIX = "plab"
_NAME = re.compile(rf"^{_PREFIX}(\d+)c(\d+)(?:n\d+|sw)$")
_SERIAL = itertools.count(1)
_CLONE_NEWNET = 0x40000000
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
    if os.geteuid() != 0:
        return "emulated nodes need root (named network namespaces: `ip netns add`)"
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _run(*args: str) -> str:
    done = subprocess.run([_tool(args[0]), *args[1:]], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=30)
    if done.returncode:
        raise OSError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _shaper_count(netns: str, dev: str, field: str) -> int:
    """One counter ("bytes", "drops", ...) of the tbf shaper on `dev` in `netns` (`tc -s -j`)."""
    stats = json.loads(_run("tc", "-s", "-j", "-n", netns, "qdisc", "show", "dev", dev))
    return sum(int(q.get(field, 0)) for q in stats if q.get("kind") == "tbf")


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


def join(netns_path: str) -> None:
    """Move the calling thread (a rank, before it starts any thread) into a node's namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(netns_path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns_path}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class NodeInfo:
    """Where one node is: its namespace and its address on the link."""
    index: int
    netns: str
    address: str

    @property
    def netns_path(self) -> str:
        return f"{_NETNS_DIR}/{self.netns}"


class EmulatedCluster:
    """`nodes` network namespaces, each with an uplink of `link_bps` into one switch.

    >>> with EmulatedCluster(2, 500e6) as cluster:
    ...     cluster.node(1).address          # '198.18.0.2'
    ...     cluster.wire_bytes()             # bytes each node sent over its uplink so far

    Made on construction (stale ones of dead owners are removed first), removed by `close`,
    by the context manager's exit and at interpreter exit; a failure half-way removes what was
    made and raises one OSError saying which command failed.
    """

    def __init__(self, nodes: int, link_bps: float):
        self.nodes = check_int("nodes", nodes, 2, MAX_NODES)
        self.link_bps = check_link_bps(link_bps)
        reason = missing()
        if reason:
            raise OSError(reason)
        remove_stale()
        base = f"{_PREFIX}{os.getpid()}c{next(_SERIAL)}"
        self.switch = f"{base}sw"
        self._nodes = tuple(NodeInfo(i, f"{base}n{i}", f"{NETWORK}.{i + 1}")
                            for i in range(nodes))
        self._made: list[str] = []
        self._lock = threading.Lock()
        _OPEN.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # The names of the namespaces, in the order they were made (a close removes them all).
    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "switch", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "switch", "up")
        for node in self._nodes:
            port = f"port{node.index}"
            self._add_namespace(node.netns)
            _run("ip", "link", "add", UPLINK, "netns", node.netns, "type", "veth",
                 "peer", "name", port, "netns", self.switch)
            _run("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", UPLINK)
            _run("ip", "-n", node.netns, "link", "set", UPLINK, "up")
            _run("ip", "-n", self.switch, "link", "set", port, "master", "switch")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
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
            _run("tc", "-n", netns, "qdisc", verb, "dev", dev, "root", "tbf",
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
        return [_shaper_count(node.netns, UPLINK, "bytes") for node in self._nodes]

    def drops(self) -> int:
        """Packets any shaper dropped (its queue was full): a sign of a link set too slow."""
        return sum(_shaper_count(netns, dev, "drops") for netns, dev in self._ends())

    def close(self) -> None:
        """Remove every namespace made (their links and qdiscs go with them); idempotent."""
        with self._lock:
            while self._made:
                name = self._made.pop()
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    _run("ip", "netns", "del", name)

    @property
    def closed(self) -> bool:
        return not self._made

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
