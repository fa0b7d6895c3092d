"""torchrun across emulated nodes: one torchrun agent in each node of an `EmulatedCluster`.

    python -m helpers.run --nodes 2 --nproc-per-node 2 --link-mbit 500 train3d --data 2 --pipeline 2

is, on one machine, what a two-node job is on two: the launcher makes the nodes
(helpers.launch.cluster: network namespaces whose uplinks are shaped to the link speed) and
starts, inside node i's namespace,

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=198.18.0.1:29400
             --rdzv-id=plab<pid> --rdzv-conf=is_host=0 --local-addr=198.18.0.(i+1)
             --max-restarts=0 -m helpers.run train3d --data 2 --pipeline 2

with GLOO_SOCKET_IFNAME (and TP_ and NCCL_SOCKET_IFNAME) set to the node's uplink. Ranks of one
node then talk over its loopback, ranks of different nodes over the shaped link, and the
link's shapers count the bytes that crossed (`wire_bytes`), printed at the end.

Why it is built this way:
* The agents join their node with setns in the child, before exec (`cluster.join`), so each
  agent's pid is torchrun's own and it can be told to stop.
* The rendezvous store is a process of its own on node 0, as etcd is on a real cluster, and
  every agent only connects to it (`is_host=0`). An agent that hosts it (torchrun's way)
  ends as soon as its ranks do, and an agent still closing the rendezvous then fails on a
  closed connection (a C++ stack trace and a warning, in a run that succeeded); this store
  outlives every agent. It listens on every interface of node 0's namespace, which are its
  loopback and its uplink into the lab's switch: nothing outside the lab's namespaces can
  reach it.
* `--local-addr` is the node's address. torchrun hands the workers the address of the node
  that became rank 0 as MASTER_ADDR; its default, the host's name, resolves to an address
  no node can reach. The rendezvous orders the nodes by that address, so node i holds
  ranks i·k … i·k + k − 1 (up to 198.18.0.9, one digit: MAX_NODES is 8).
* Output: each agent's (and its ranks') lines, prefixed by the node, as they come. A Python
  traceback is shown as its last line only (the exception), so a failure reads as one line
  per process; nothing after the launcher began stopping the agents is shown.
* Every exit removes the nodes: normal, a failed agent, Ctrl-C, SIGTERM or SIGHUP. When one
  agent fails, the others get GRACE_S to finish, then SIGTERM (torchrun ends its ranks on
  it), then after STOP_S every process still inside a node's namespace gets SIGKILL: that
  includes ranks that started sessions of their own, which no process group reaches. (One
  that ended well gives the others DONE_S: they are only closing down.)

Exit status: torchrun's (the first agent that failed, else 0); 2 for a bad argument (said in
one line before anything is made, see helpers.launch.torchrun); 3 when this machine cannot
make the nodes (`cluster.missing()` says why in one line); 128 + the signal's number when
interrupted (130 for Ctrl-C, 143 for SIGTERM).
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time

from helpers.launch import cluster as emulated
from helpers.launch.host import TRANSPORT_VARIABLES, threads_per_rank
from helpers.launch.process import private_folder

PROG = "python -m helpers.run"
# Each cluster is a set of network namespaces of its own, so the rendezvous port cannot clash
# with another run's, another test suite's or anything of the host's: torchrun's default.
RDZV_PORT = 29400
# After one agent failed: how long the others may take to notice and end on their own. Their
# ranks notice at their next collective (gloo's connection to the failed one is closed), and
# torchrun looks at its ranks every 0.1 s; a rank that trains on with a rank whose agent died
# (its session is its own) notices nothing, and waits out the whole grace.
GRACE_S = 2.0
# After one agent ended well: how long the others may take to close down (see _Agents.wait).
DONE_S = 60.0
# After SIGTERM: how long torchrun may take to end its ranks before everything left is killed.
STOP_S = 5.0
# How often the launcher looks at its agents while it waits for output.
POLL_S = 0.2
CANNOT_EMULATE = 3
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                 if hasattr(signal, name))
# Repo root: the agents' ranks import helpers from it, wherever the launcher was started.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Stopped(BaseException):
    """A signal asked the launcher to stop (a BaseException, like KeyboardInterrupt, so that
    no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def agent_command(cluster: emulated.EmulatedCluster, index: int, nproc_per_node: int,
                  run_id: str, log_dir: str, command: list[str]) -> list[str]:
    """torchrun's command line for node `index`'s agent, running `helpers.run COMMAND …`.
    `log_dir`: where torchrun keeps its per-run folders (by default a new one under /tmp
    each run, which it never removes)."""
    node = cluster.node(index)
    host = cluster.node(0).address
    return [sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={cluster.nodes}", f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{RDZV_PORT}", f"--rdzv-id={run_id}",
            "--rdzv-conf=is_host=0", f"--local-addr={node.address}", f"--log-dir={log_dir}",
            "--max-restarts=0", "-m", "helpers.run", *command]


def agent_env(environ: dict, world_size: int) -> dict:
    """The agents' environment: transports on the uplink, one share of the cores per rank,
    unbuffered output (the launcher relays it as it comes), helpers importable."""
    env = dict(environ, PYTHONUNBUFFERED="1")
    env.update({name: emulated.UPLINK for name in TRANSPORT_VARIABLES})
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(world_size)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (_ROOT, environ.get("PYTHONPATH"))))
    return env


def netns_inode(pid: int | str) -> int | None:
    """The inode of a process's network namespace (None once it is gone)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def processes_in(netns_path: str) -> list[int]:
    """Every process in the namespace named by `netns_path` (none once it is gone)."""
    try:
        inode = os.stat(netns_path).st_ino
    except OSError:
        return []
    me = os.getpid()
    return [int(pid) for pid in os.listdir("/proc")
            if pid.isdigit() and int(pid) != me and netns_inode(pid) == inode]


# A line torch's TCPStore writes for every connection it accepts here: it looks the peer's
# address up by name, and the lab's addresses (198.18.0.x) have none. Harmless, and said once
# per rank; passed over.
_NOISE = ("The hostname of the client socket cannot be retrieved",)
# The lines between a chained exception's tracebacks.
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_RANK_PREFIX = re.compile(r"^\[(default)?rank\d+\]:\s?")


class _Relay:
    """An agent's output, line by line, prefixed by its node; a traceback as its last line."""

    def __init__(self, prefix: str, out):
        self.prefix, self.out = prefix, out
        self.partial = b""
        self.in_traceback = False

    def feed(self, data: bytes) -> None:
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            self._line(line.decode(errors="replace"))

    def flush(self) -> None:
        if self.partial:
            self._line(self.partial.decode(errors="replace"))
            self.partial = b""

    def _line(self, text: str) -> None:
        # torchrun's ranks prefix what they write to stderr with "[rank3]: "
        bare = _RANK_PREFIX.sub("", text, count=1)
        if bare.startswith("Traceback (most recent call last):"):
            self.in_traceback = True
            return
        if self.in_traceback and bare.startswith((" ", "\t")):
            return  # a frame: the launcher's rule is one line per error, no traceback
        self.in_traceback = False
        if not bare.strip() or bare.startswith(_CHAINED) or any(n in bare for n in _NOISE):
            return
        print(f"{self.prefix}{text}", file=self.out, flush=True)


# The rendezvous store, a process of its own on node 0 (see the module's docstring): it says
# "ready" once it listens, and ends when the launcher closes its stdin. Its last argument, the
# run's id, is unused: it names the run the store serves in `ps`, as the agents' --rdzv-id does.
_STORE = ("import sys\n"
          "from torch.distributed import TCPStore\n"
          "store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True,\n"
          "                 wait_for_workers=False, multi_tenant=True)\n"
          "print('ready', flush=True)\n"
          "sys.stdin.read()\n")
# How long the store may take to come up (it imports torch, on a machine that may be busy).
STORE_S = 120.0


class _Agents:
    """The store and the agents: started into their nodes, their output relayed, ended."""

    def __init__(self, cluster: emulated.EmulatedCluster, run_id: str, log_dir: str, out):
        self.cluster, self.run_id, self.log_dir, self.out = cluster, run_id, log_dir, out
        self.procs: list[subprocess.Popen] = []  # the agents, node by node
        self.store: subprocess.Popen | None = None
        self.relays: dict = {}                   # a node's index, or "store": its _Relay
        self.selector = selectors.DefaultSelector()
        self.quiet = False  # True once stopping began: what follows is the stop's echo
        self.first_failure: int | None = None

    def _spawn(self, index: int, command: list[str], env: dict, stdin) -> subprocess.Popen:
        paths = self.cluster.node(index).namespaces
        return subprocess.Popen(command, env=env, cwd=_ROOT, stdin=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True,  # a Ctrl-C is the launcher's to pass on
                                preexec_fn=lambda: _enter(paths))

    def _watch(self, proc: subprocess.Popen, key, prefix: str) -> None:
        self.relays[key] = _Relay(prefix, self.out)
        os.set_blocking(proc.stdout.fileno(), False)
        self.selector.register(proc.stdout, selectors.EVENT_READ, key)

    def start_store(self, env: dict) -> subprocess.Popen:
        """The rendezvous store on node 0, listening once this returns; OSError if it cannot."""
        node = self.cluster.node(0)
        with _signals_held():
            self.store = self._spawn(0, [sys.executable, "-c", _STORE, node.address,
                                         str(RDZV_PORT), self.run_id], env, subprocess.PIPE)
        why = _await_line(self.store.stdout, "ready", STORE_S)
        if why is not None:
            raise OSError(f"the rendezvous store on node 0 did not start: {why or 'no answer'}")
        self._watch(self.store, "store", "[node 0 store] ")
        return self.store

    def start(self, index: int, nproc_per_node: int, command: list[str],
              env: dict) -> subprocess.Popen:
        """Node `index`'s agent, running `helpers.run COMMAND …` on its ranks."""
        command = agent_command(self.cluster, index, nproc_per_node, self.run_id, self.log_dir,
                                command)
        with _signals_held():
            proc = self._spawn(index, command, env, subprocess.DEVNULL)
            self.procs.append(proc)
        self._watch(proc, index, f"[node {index}] ")
        return proc

    def relay(self, timeout: float) -> None:
        """Pass on what was written within `timeout` seconds."""
        if not self.selector.get_map():
            time.sleep(timeout)
            return
        for key, _ in self.selector.select(timeout):
            self._read(key.fileobj, key.data)

    def _read(self, pipe, key) -> None:
        try:
            data = os.read(pipe.fileno(), 65536)
        except BlockingIOError:
            return
        if data:
            if not self.quiet:
                self.relays[key].feed(data)
            return
        self.selector.unregister(pipe)  # end of output: every process that held it closed it
        if not self.quiet:
            self.relays[key].flush()

    def _reading(self) -> bool:
        """Whether an agent's output may still come (its ranks hold it too)."""
        return any(key.data != "store" for key in self.selector.get_map().values())

    def running(self) -> list[int]:
        return [i for i, proc in enumerate(self.procs) if proc.poll() is None]

    def failed(self) -> int | None:
        """The node whose agent was seen to fail first, or None."""
        if self.first_failure is None:
            self.first_failure = next((i for i, proc in enumerate(self.procs)
                                       if proc.poll() not in (None, 0)), None)
        return self.first_failure

    def wait(self) -> int:
        """Relay output until every agent ended and its output is read; torchrun's status.
        One agent failing gives the others GRACE_S to end on their own, then they are
        stopped. One ending well gives the others DONE_S: torchrun's exit barrier let it end
        only once every node's ranks were done, so the others are only closing down (slowly,
        on a busy machine). The same holds for a process that keeps an ended agent's output
        open."""
        deadline, failed = None, None
        while self.running() or self._reading():
            self.relay(POLL_S)
            now = time.monotonic()
            if failed is None and self.failed() is not None:
                failed = self.failed()
                deadline = min(deadline or math.inf, now + GRACE_S)
            elif deadline is None and len(self.running()) < len(self.procs):
                deadline = now + DONE_S
            if deadline is not None and now > deadline:
                if self.running():
                    others = ", ".join(f"node {i}" for i in self.running())
                    why = (f"node {failed}'s torchrun {_ended(self.procs[failed].returncode)}"
                           if failed is not None else f"the others ended {DONE_S:.0f} s ago")
                    _say(f"{why}; stopping {others}'s", self.out)
                self.stop()
                break
        failed = self.failed()
        if failed is None:
            return 0
        status = self.procs[failed].returncode
        return status if status > 0 else 128 - status  # killed by a signal: as a shell says it

    def stop(self) -> None:
        """End the agents, the store and every process inside the nodes, within about
        STOP_S + 1 s."""
        self.quiet = True
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)  # torchrun passes it to its ranks
        deadline = time.monotonic() + STOP_S
        while self.running() and time.monotonic() < deadline:
            self.relay(POLL_S)  # read on: an agent blocked on a full pipe would never end
        if self.store is not None:
            self.store.stdin.close()  # the store's cue; it outlived every agent that used it
        self._kill_what_is_left()

    def _kill_what_is_left(self) -> None:
        """SIGKILL every process still inside a node (a rank in a session of its own, one
        whose agent ended first, a store slow to end), then reap ours."""
        for _ in range(100):  # a process may fork while it is being killed: look again
            left = [pid for node in self.cluster.node_infos
                    for pid in processes_in(node.netns_path)]
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        for proc in self.procs + [self.store] * (self.store is not None):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_S)

    def close(self) -> None:
        """Close every pipe (after `stop`); idempotent."""
        for proc in self.procs + [self.store] * (self.store is not None):
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None and not pipe.closed:
                    with contextlib.suppress(KeyError, ValueError):
                        self.selector.unregister(pipe)
                    pipe.close()
        self.selector.close()


def _await_line(pipe, expected: str, seconds: float) -> str | None:
    """None once a process wrote the line `expected`; otherwise (it ended, or `seconds`
    passed) the last line it wrote, which says why, or ''."""
    data, deadline = b"", time.monotonic() + seconds
    with selectors.DefaultSelector() as selector:
        selector.register(pipe, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            chunk = os.read(pipe.fileno(), 65536) if selector.select(POLL_S) else None
            data += chunk or b""
            lines = data.decode(errors="replace").splitlines()
            if expected in (line.strip() for line in lines):
                return None
            if chunk == b"":  # it ended
                break
    lines = [line for line in data.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _enter(paths: tuple[str, ...]) -> None:
    """In the agent's child process, before exec: no signal held back any more (the
    launcher holds them while it starts agents, and exec would keep the mask), then into the
    node's namespace."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    emulated.join(*paths)


def _ended(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"ended with status {returncode}"


def _say(text: str, out) -> None:
    print(f"{PROG}: {text}", file=out, flush=True)


class _Signals:
    """SIGINT, SIGTERM and SIGHUP raise Stopped, until `clean_up` begins: from then on they
    are passed over, so that a second Ctrl-C cannot cut the clean-up short. The previous
    handlers come back at `restore`. A signal ignored when the launcher started stays
    ignored; only the main thread may set handlers (elsewhere the defaults stay)."""

    def __init__(self):
        self.cleaning = False
        self.previous = {}
        with contextlib.suppress(ValueError):
            for signum in _SIGNALS:
                if signal.getsignal(signum) != signal.SIG_IGN:  # nohup, a shell's `&`: kept
                    self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        if not self.cleaning:
            raise Stopped(signum)

    def clean_up(self) -> None:
        self.cleaning = True

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def _signals_held():
    """Signals wait until the block ends: what is made inside it is recorded before a
    Stopped can leave it half-done."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _default_link_bps(out) -> float:
    """The link LiveRanks would choose: loopback's measured all-reduce bandwidth / the ratio."""
    from helpers.launch.live import loopback_bandwidth
    loopback = loopback_bandwidth()
    link_bps = min(max(8 * loopback / emulated.DEFAULT_LINK_RATIO, emulated.MIN_LINK_BPS),
                   emulated.MAX_LINK_BPS)
    _say(f"link {emulated.format_link(link_bps)}: this machine's loopback all-reduce bandwidth "
         f"{loopback / 1e9:.2f} GB/s (measured) / {emulated.DEFAULT_LINK_RATIO}", out)
    return link_bps


def run_on_nodes(nodes: int, nproc_per_node: int, link_bps: float | None,
                 command: list[str], out=None) -> int:
    """Run `helpers.run COMMAND …` under torchrun on `nodes` emulated nodes of
    `nproc_per_node` ranks each; the exit status (see the module's docstring). The arguments
    are checked by the caller (helpers.launch.torchrun), before this starts anything."""
    out = out or sys.stdout
    reason = emulated.missing()
    if reason:
        _say(f"cannot emulate nodes here: {reason}", sys.stderr)
        return CANNOT_EMULATE
    cluster = agents = stopped = None
    folders: list[str] = []
    signals = _Signals()
    try:
        if link_bps is None:
            link_bps = _default_link_bps(out)  # before anything of ours exists
        with _signals_held():
            folders.append(private_folder())  # torchrun's logs: removed with the nodes
            cluster = emulated.EmulatedCluster(nodes, link_bps)
            agents = _Agents(cluster, f"plab{os.getpid()}", folders[0], out)
        _say(f"{nodes} emulated nodes × {nproc_per_node} ranks, link "
             f"{emulated.format_link(link_bps)}", out)
        env = agent_env(os.environ, nodes * nproc_per_node)
        agents.start_store(env)
        for i in range(nodes):
            proc = agents.start(i, nproc_per_node, command, env)
            node = cluster.node(i)
            _say(f"node {i}: torchrun agent pid {proc.pid} in network namespace "
                 f"{node.netns} (inode {netns_inode(proc.pid)}) at {node.address}", out)
        status = agents.wait()
        sent = cluster.wire_bytes()
        _say("bytes sent over the uplinks (the shapers' counters, headers included): "
             + ", ".join(f"node {i} {b:,}" for i, b in enumerate(sent))
             + f"; total {sum(sent):,}", out)
        if status:
            _say(f"torchrun failed with status {status}", sys.stderr)
        return status
    except Stopped as stop:
        stopped = stop.signum
        return 128 + stopped
    except KeyboardInterrupt:  # held back by LiveRanks while it measured loopback, then raised
        stopped = signal.SIGINT
        return 128 + stopped
    except OSError as error:  # a command of the cluster's, or an agent that cannot start
        _say(f"error: {error}", sys.stderr)
        return 1
    finally:
        signals.clean_up()
        try:
            if agents is not None:
                agents.stop()
                agents.close()
            if cluster is not None:
                cluster.close()
            for folder in folders:
                shutil.rmtree(folder, ignore_errors=True)
        finally:
            signals.restore()
        if stopped is not None:
            _say(f"stopped by {signal.Signals(stopped).name}; nothing of the run is left",
                 sys.stderr)
