"""torchrun across emulated nodes (`python -m helpers.run --nodes N ...`, helpers.launch.nodes):
one agent per network namespace, ranks on both sides of the shaped link. Checked: the results
(one process's loss, the collective's definition), where the agents and ranks ran, the bytes
the link's shapers counted against what must cross, one-line errors, and that nothing is left
behind after a run, a bad command line or an interrupt."""
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from helpers.configs import TRANSFORMER
from helpers.cost.parallel3d import activation_bytes
from helpers.launch import cluster, nodes
from helpers.layout import Layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSING = cluster.missing()
needs_namespaces = pytest.mark.skipif(
    MISSING is not None, reason=f"emulated nodes cannot be made here: {MISSING}")
LINK = ("--link-mbit", "500")  # given, so that no run measures loopback first
AGENT = re.compile(r"node (\d+): torchrun agent pid (\d+) in network namespace (\S+) "
                   r"\(inode (\d+)\) at (\S+)$")


def launch(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "helpers.run", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the launcher ran past {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def agents(out: str) -> dict[int, dict]:
    """What the launcher said of each node's agent: pid, namespace name and inode, address."""
    found = {}
    for line in out.splitlines():
        match = AGENT.search(line)
        if match:
            node, pid, name, inode, address = match.groups()
            found[int(node)] = dict(pid=int(pid), netns=name, inode=int(inode), address=address)
    return found


def ranks_by_namespace(out: str) -> dict[int, tuple[str, list[int]]]:
    """Rank 0's `network:` line: namespace inode -> (address, ranks)."""
    line = next(line for line in out.splitlines() if "  network: " in line)
    return {int(inode): (address, [int(r) for r in ranks.split()])
            for ranks, inode, address in re.findall(r"ranks? ([\d ]+) in namespace (\d+) at (\S+)",
                                                    line)}


def wire_bytes(out: str) -> list[int]:
    line = next(line for line in out.splitlines() if "bytes sent over the uplinks" in line)
    return [int(b.replace(",", "")) for b in re.findall(r"node \d+ ([\d,]+)", line)]


def processes_of(run_id: str) -> list[int]:
    """Processes whose command line (the agents, the store) or environment (the ranks:
    torchrun's TORCHELASTIC_RUN_ID) names the run."""
    needle = run_id.encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as f:
                    text = f.read()
            except OSError:
                continue
            if re.search(re.escape(needle) + rb"(\0|$)", text):
                found.append(int(pid))
                break
    return found


def namespaces_of(launcher_pid: int) -> list[str]:
    return [name for name in cluster.our_namespaces() if name.startswith(f"plab{launcher_pid}c")]


def assert_nothing_left(launcher_pid: int) -> None:
    assert namespaces_of(launcher_pid) == []
    assert processes_of(f"plab{launcher_pid}") == []
    # torchrun's log folders live in the launcher's private folder, and go with it
    tmp = tempfile.gettempdir()
    assert glob.glob(os.path.join(tmp, f"plab-ranks-{launcher_pid}-*")) == []
    assert glob.glob(os.path.join(tmp, "torchelastic_*", f"plab{launcher_pid}_*")) == []


@needs_namespaces
def test_train3d_across_two_nodes_matches_one_process_and_crosses_the_link():
    from helpers.labs.parallel3d import reference_3d
    d, t, p, m = 2, 1, 2, 1  # DP inside each node, the pipeline across the link
    proc = launch("--nodes", "2", "--nproc-per-node", "2", *LINK, "train3d",
                  "--data", str(d), "--tensor", str(t), "--pipeline", str(p))
    status, out, err = finish(proc)
    assert status == 0, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err

    # one process's loss
    loss = float(re.search(r"\[node 0\]   step 0: loss (\S+)", out).group(1))
    assert loss == pytest.approx(reference_3d().loss, rel=1e-5)

    # the agents in two namespaces, neither this process's; the ranks with them, on the uplinks
    found = agents(out)
    assert sorted(found) == [0, 1]
    here = os.stat("/proc/self/ns/net").st_ino
    inodes = [found[0]["inode"], found[1]["inode"]]
    assert len(set(inodes)) == 2 and here not in inodes
    assert ranks_by_namespace(out) == {inodes[0]: ("198.18.0.1", [0, 1]),
                                       inodes[1]: ("198.18.0.2", [2, 3])}

    # every micro-batch's activation went from stage 0 (node 0) to stage 1 (node 1), and its
    # gradient back: each node sent at least d·m activations over its shaped uplink
    must_cross = d * m * activation_bytes(Layout(d, t, p, m), TRANSFORMER)
    sent = wire_bytes(out)
    assert len(sent) == 2 and min(sent) >= must_cross, (sent, must_cross)

    assert_nothing_left(proc.pid)


@needs_namespaces
def test_the_collectives_demo_across_two_nodes_is_correct_and_crosses_the_link():
    length = 2**18  # 1 MiB of float32 per rank: far above the rendezvous' few kB on the link
    proc = launch("--nodes", "2", *LINK, "collectives", "all_reduce", str(length))
    status, out, err = finish(proc)
    assert status == 0, out[-3000:] + err[-3000:]
    assert "[node 0] collectives on 2 ranks (gloo):" in out.splitlines()
    assert "[node 0]   against expected(): equal on every rank" in out.splitlines()
    found = agents(out)
    assert ranks_by_namespace(out) == {found[0]["inode"]: ("198.18.0.1", [0]),
                                       found[1]["inode"]: ("198.18.0.2", [1])}
    # Each node's result needs the other's whole tensor: each sent at least 4·length bytes.
    assert min(wire_bytes(out)) >= 4 * length
    assert_nothing_left(proc.pid)


def _wait_for(what, seconds: float = 120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.1)
    pytest.fail("the launcher never got there")


@needs_namespaces
@pytest.mark.parametrize("signum, when", [(signal.SIGTERM, "ranks running"),
                                          (signal.SIGINT, "agents starting")])
def test_an_interrupted_run_leaves_nothing_behind(signum, when):
    proc = launch("--nodes", "2", *LINK, "train3d", "--pipeline", "2", "--steps", "1000")
    run_id = f"plab{proc.pid}"
    if when == "ranks running":
        _wait_for(lambda: _ranks(run_id))
    else:
        _wait_for(lambda: [pid for pid in processes_of(run_id)
                           if b"torch.distributed.run" in _cmdline(pid)])
    proc.send_signal(signum)
    status, out, err = finish(proc, timeout=60)
    assert status == 128 + signum
    assert err.strip().splitlines()[-1] == (f"python -m helpers.run: stopped by "
                                            f"{signal.Signals(signum).name}; nothing of the run "
                                            "is left")
    assert "Traceback" not in out + err
    assert_nothing_left(proc.pid)


@needs_namespaces
def test_when_an_agent_dies_the_other_is_stopped_and_the_orphaned_rank_killed():
    proc = launch("--nodes", "2", *LINK, "train3d", "--pipeline", "2", "--steps", "1000")
    run_id = f"plab{proc.pid}"
    _wait_for(lambda: _ranks(run_id))
    agent_1 = _wait_for(lambda: [pid for pid in processes_of(run_id)
                                 if b"--local-addr=198.18.0.2" in _cmdline(pid)])[0]
    os.kill(agent_1, signal.SIGKILL)  # its rank, in a session of its own, trains on with rank 0
    status, out, err = finish(proc, timeout=120)  # 1000 steps would take minutes
    assert status == 128 + signal.SIGKILL
    assert ("python -m helpers.run: node 1's torchrun was killed by SIGKILL; stopping node 0's"
            in out.splitlines()), out
    assert err.strip().splitlines()[-1] == "python -m helpers.run: torchrun failed with status 137"
    assert "Traceback" not in out + err
    assert_nothing_left(proc.pid)


def _ranks(run_id: str) -> list[int]:
    """The run's ranks: torchrun's run id in their environment; not an agent, not the store."""
    return [pid for pid in processes_of(run_id)
            if b"torch.distributed.run" not in _cmdline(pid) and b"TCPStore" not in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.mark.parametrize("args, message", [
    (("--nodes", "9", "allreduce"), "--nodes must be between 2 and 8, got 9"),
    (("--nodes", "2", "--nproc-per-node", "0", "allreduce"),
     "--nproc-per-node must be between 1 and 8, got 0"),
    (("--nodes", "2", "--link-mbit", "0.5", "allreduce"),
     "--link-mbit must be >= 1 and <= 100000 Mbit/s, got 0.5"),
    (("--link-mbit", "500", "allreduce"), "--link-mbit needs --nodes N"),
    (("--nodes", "2", "--nproc-per-node", "2", "train3d", "--data", "2"),
     "--data · --tensor · --pipeline must be --nodes · --nproc-per-node = 4 ranks, "
     "got 2·1·1 = 2"),
    (("--nodes", "2", "allreduce", "extra"), "allreduce's arguments must be none, got extra"),
])
def test_a_bad_command_line_is_one_line_before_anything_is_made(args, message):
    proc = launch(*args)
    status, out, err = finish(proc, timeout=60)
    assert status == 2
    assert out == ""
    assert len(err.splitlines()) == 1 and message in err, err
    assert namespaces_of(proc.pid) == []


def test_a_machine_without_namespaces_is_one_line_and_status_3(monkeypatch, capsys):
    # In this process: the launcher's own answer to what cluster.missing() reports.
    monkeypatch.setattr(cluster, "missing", lambda: "emulated nodes need root (test)")
    assert nodes.run_on_nodes(2, 1, 500e6, ["allreduce"]) == nodes.CANNOT_EMULATE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("python -m helpers.run: cannot emulate nodes here: emulated nodes "
                            "need root (test)\n")
    assert namespaces_of(os.getpid()) == []


def test_nodes_is_refused_inside_a_torchrun_job():
    env = dict(os.environ, RANK="0", LOCAL_RANK="0")
    done = subprocess.run([sys.executable, "-m", "helpers.run", "--nodes", "2", "allreduce"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("python -m helpers.run: error: --nodes starts torchrun itself: leave it "
                           "out of a command torchrun runs\n")


def test_the_relay_prefixes_each_line_and_shows_a_traceback_as_its_exception(capsys):
    relay = nodes._Relay("[node 1] ", sys.stdout)
    relay.feed(b"[rank3]: Traceback (most recent call last):\n"
               b"[rank3]:   File \"x.py\", line 1, in <module>\n"
               b"[rank3]:     f()\n[rank3]: KeyError: 'a'\n\n"
               b"During handling of the above exception, another exception occurred:\n\n"
               b"Traceback (most recent call last):\n  File \"y.py\", line 2, in g\n"
               b"RuntimeError: gloo: connection closed\nstep 0: loss 6.9")  # no newline yet
    assert capsys.readouterr().out == ("[node 1] [rank3]: KeyError: 'a'\n"
                                       "[node 1] RuntimeError: gloo: connection closed\n")
    relay.flush()
    assert capsys.readouterr().out == "[node 1] step 0: loss 6.9\n"
