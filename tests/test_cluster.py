"""Emulated nodes (helpers.launch.cluster) and LiveRanks on them: real namespaces, real tc.

Every check here reads the kernel's own state (`ip netns`, `tc -s`, /proc/<pid>/ns/net) or
the bytes its shapers counted, never a time."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from helpers.launch import cluster
from helpers.ranks import LiveRanks

MISSING = cluster.missing()
needs_namespaces = pytest.mark.skipif(MISSING is not None, reason=f"{MISSING}")
LINK = 1e9  # fast enough that a test's few MiB cross in milliseconds


def mine() -> list[str]:
    """The namespaces of this test process."""
    return [n for n in cluster.our_namespaces() if n.startswith(f"plab{os.getpid()}c")]


def all_reduce_ones(rank: int, world_size: int, nbytes: int) -> float:
    x = torch.ones(nbytes // 4)
    dist.all_reduce(x)
    return float(x[0])


def fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


# -- bad input: one error naming the argument, nothing made ----------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(nodes=3), "nodes must divide world_size=4"),
    (dict(nodes=1), "nodes must be"),
    (dict(nodes=16), "nodes must be"),
    (dict(nodes=2, link_bps=0), "link_bps must be bits per second in [1e+06, 1e+11]"),
    (dict(nodes=2, link_bps=True), "link_bps must be"),
    (dict(link_bps=1e9), "link_bps needs nodes=n"),
    (dict(nodes=2.0), "nodes must be"),
])
def test_bad_cluster_arguments_are_named_before_anything_is_made(kwargs, words):
    before = cluster.our_namespaces()
    with pytest.raises((ValueError, TypeError)) as info:
        LiveRanks(4, **kwargs)
    assert words in str(info.value)
    assert cluster.our_namespaces() == before


def test_placement_is_checked():
    if MISSING:
        pytest.skip(MISSING)
    ranks = LiveRanks(4, nodes=2, link_bps=LINK)
    for bad in [(0, 0, 0, 1), (0, 1, 2, 0), (0, 1), (0, 1, 0, True)]:
        with pytest.raises(ValueError, match="placement must give each of the 4 ranks a node"):
            ranks.place(bad)
    assert ranks.placement == (0, 0, 1, 1)
    with pytest.raises(ValueError, match="place\\(\\) needs emulated nodes"):
        LiveRanks(2).place((0, 1))


# -- the cluster itself ---------------------------------------------------------------------

def _qdiscs(c: cluster.EmulatedCluster, netns: str, dev: str) -> list[dict]:
    return json.loads(c.run_in(netns, "tc", "-j", "qdisc", "show", "dev", dev))


def netns_inode_of(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


@needs_namespaces
def test_cluster_is_made_shaped_at_both_ends_and_removed():
    with cluster.EmulatedCluster(3, 200e6) as c:
        if c.named:  # root: named namespaces, this process's pid in their names
            assert sorted(mine()) == sorted([c.switch] + [n.netns for n in c.node_infos])
        else:        # an ordinary user: none named, each held open by this process
            assert mine() == [] and c.named is False
        inodes = {os.stat(n.netns_path).st_ino for n in c.node_infos}
        assert len(inodes) == 3 and os.stat("/proc/self/ns/net").st_ino not in inodes
        assert [n.address for n in c.node_infos] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        for netns, dev in c._ends():
            (tbf,) = [q for q in _qdiscs(c, netns, dev) if q["kind"] == "tbf"]
            assert tbf["options"]["rate"] == 200e6 / 8  # tc reports bytes per second
        c.set_link(50e6)
        (tbf,) = [q for q in _qdiscs(c, c.switch, "port2") if q["kind"] == "tbf"]
        assert tbf["options"]["rate"] == 50e6 / 8
        # Nothing outside reaches in: the node's only link is the uplink into the switch.
        links = json.loads(c.run_in(c.node(0).netns, "ip", "-j", "link"))
        assert sorted(link["ifname"] for link in links) == ["lo", cluster.UPLINK]
    assert mine() == [] and c.closed


@needs_namespaces
def test_stale_namespaces_of_a_dead_owner_are_removed_and_a_live_owners_kept():
    if os.geteuid() != 0:
        pytest.skip("only root's namespaces have names that can outlive their owner; an "
                    "ordinary user's die with it (test_an_ordinary_user_makes_nodes_…)")
    script = textwrap.dedent("""
        import sys, time
        from helpers.launch.cluster import EmulatedCluster
        c = EmulatedCluster(2, 1e8)
        print(c.switch, flush=True)
        time.sleep(60)
    """)
    owners = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
              for _ in range(2)]
    try:
        switches = [o.stdout.readline().strip() for o in owners]
        owners[0].kill()  # SIGKILL: no exit handler runs, its namespaces stay behind
        owners[0].wait()
        assert switches[0] in cluster.our_namespaces()
        removed = cluster.remove_stale()
        assert switches[0] in removed
        left = cluster.our_namespaces()
        assert switches[0] not in left and switches[1] in left  # a live owner's stay
    finally:
        for o in owners:
            o.kill()
            o.wait()
        cluster.remove_stale()


@needs_namespaces
def test_an_owner_ended_by_a_signal_removes_its_nodes_and_ranks():
    """SIGTERM (and SIGHUP, the same handler) end Python without atexit: live.py's handler
    kills the ranks and removes the nodes first."""
    signum = signal.SIGTERM
    script = textwrap.dedent("""
        import os, time
        from helpers.ranks import LiveRanks
        from helpers.launch.cluster import whereabouts
        ranks = LiveRanks(2, nodes=2, link_bps=1e9)
        inodes = [w.netns_inode for w in ranks.run(whereabouts)]
        print(ranks.cluster.switch, *inodes, *ranks.pids, flush=True)
        time.sleep(60)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        switch, *numbers = owner.stdout.readline().split()
        inodes, pids = set(map(int, numbers[:2])), list(map(int, numbers[2:]))
        named = os.geteuid() == 0  # an ordinary user's namespaces have no name to look for
        assert (switch in cluster.our_namespaces()) == named
        owner.send_signal(signum)
        assert owner.wait(timeout=30) == -signum
        assert switch not in cluster.our_namespaces()
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert [pid for pid in os.listdir("/proc")
                if pid.isdigit() and netns_inode_of(pid) in inodes] == []
    finally:
        owner.kill()
        owner.wait()


def _as_ordinary_user(tmp_path, script: str, *mapping: str) -> subprocess.CompletedProcess:
    """Run `script` as a process that is not root: `unshare --user` puts it in a user
    namespace of its own without capabilities outside it. The interpreter may live in root's
    home, which `setpriv` to nobody could not read; here the files stay readable."""
    try:
        done = subprocess.run(["unshare", "--user", *mapping, sys.executable, "-c", script],
                              cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("util-linux's unshare is missing")
    if done.returncode and done.stderr.startswith("unshare:"):
        pytest.skip(f"this kernel refuses user namespaces: {done.stderr.strip()}")
    return done


def test_an_ordinary_user_makes_nodes_in_a_user_namespace_and_leaves_nothing(tmp_path):
    """Not root, with the uid mapped (as an ordinary user's is): the nodes are made inside a
    user namespace of this user's, the ranks join them, the link shapes and counts, and at
    the end the owner holds no namespace and no process is left in the nodes."""
    if MISSING:
        pytest.skip(MISSING)
    script = textwrap.dedent("""
        import json, os
        from helpers.ranks import LiveRanks
        from helpers.launch import cluster

        with LiveRanks(2, nodes=2, link_bps=1e9) as ranks:
            where = ranks.run(cluster.whereabouts)
            before, all_before = ranks.wire_bytes(resent=False), ranks.wire_bytes()
            ranks.run(cluster.loopback_busbw, 1024**2, iters=1)  # two all-reduces of 1 MiB
            crossed, all_crossed = ranks.wire_bytes(resent=False) - before, ranks.wire_bytes() - all_before
            resent = ranks.cluster.retransmitted_segments()
            named = ranks.cluster.named
        def kind(fd):  # what an open descriptor is ("net:[…]" for a namespace)
            try:
                return os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # the descriptor listdir itself used
                return ""
        held = [k for k in map(kind, os.listdir("/proc/self/fd")) if k.startswith(("net:", "user:"))]
        print(json.dumps(dict(uid=os.geteuid(), named=named, crossed=crossed, all_crossed=all_crossed,
                              resent=resent,
                              addresses=[w.address for w in where],
                              inodes=[w.netns_inode for w in where], held=held)))
    """)
    done = _as_ordinary_user(tmp_path, script, "--map-user=1000", "--map-group=1000")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    got = json.loads(done.stdout)
    assert (got["uid"], got["named"], got["held"]) == (1000, False, [])
    assert got["addresses"] == ["198.18.0.1", "198.18.0.2"]
    # Each all-reduce of the two-rank ring sends the whole buffer each way over the link;
    # headers add 5-13 % (segments TCP sent a second time taken out: a busy machine adds them).
    assert 2 * 2 * 1024**2 < got["crossed"] < 2 * 2 * 1024**2 * 1.15
    assert len(got["resent"]) == 2 and all(isinstance(n, int) and n >= 0 for n in got["resent"])
    assert got["crossed"] <= got["all_crossed"]
    nodes = set(got["inodes"])
    assert len(nodes) == 2 and os.stat("/proc/self/ns/net").st_ino not in nodes
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and netns_inode_of(pid) in nodes]
    assert left == []


def test_where_the_kernel_refuses_one_line_says_so_and_the_ranks_run_flat(tmp_path):
    """Not root, and no user namespace of its own to be had (here: a uid left unmapped, which
    may not make one): one line says so as the ranks are asked for, and they are the flat
    network's (LiveRanks without nodes, tested everywhere else)."""
    script = ("import os\n"
              "from helpers.ranks import LiveRanks\n"
              "ranks = LiveRanks(2, nodes=2)\n"
              "print(os.geteuid(), ranks.nodes, ranks.placement, ranks.link_bps)\n")
    done = _as_ordinary_user(tmp_path, script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "65534 None None None"
    notices = [line for line in done.stderr.splitlines() if line.startswith("helpers.ranks:")]
    assert len(notices) == 1
    assert notices[0].startswith("helpers.ranks: emulated nodes need root, or user namespaces "
                                 "for an ordinary user, which were refused here (`unshare -Urn`: ")
    assert notices[0].endswith("); the 2 ranks run on the flat network")
    assert "Traceback" not in done.stderr


# -- LiveRanks on emulated nodes (one set of ranks, used in turn) -----------------------------

@pytest.fixture(scope="module")
def ranks():
    if MISSING:
        pytest.skip(MISSING)
    live = LiveRanks(4, nodes=2, link_bps=LINK)
    yield live
    live.close()
    assert mine() == []


def test_ranks_sit_on_their_nodes_and_cross_bytes_only_between_nodes(ranks):
    nbytes = 1024**2
    ranks.place((0, 0, 1, 1))
    here = os.stat("/proc/self/ns/net").st_ino
    where = ranks.run(cluster.whereabouts)
    assert [w.address for w in where] == ["198.18.0.1"] * 2 + ["198.18.0.2"] * 2
    assert where[0].netns_inode == where[1].netns_inode != where[2].netns_inode
    assert here not in {w.netns_inode for w in where}
    assert "nodes=(0, 0, 1, 1)" in repr(ranks)

    # The ring 0→1→2→3→0 crosses the link twice: ranks 1 and 3 each send their whole
    # 2(n−1)/n share, 1.5 × the buffer, over it. Headers add 5 % on a 1500-byte MTU, and the
    # receivers' acknowledgements cross too (a shaped flow's segments are not merged): 5–13 %.
    before = ranks.wire_bytes()
    assert ranks.run(all_reduce_ones, nbytes) == [4.0] * 4
    consecutive = ranks.wire_bytes() - before
    assert 2 * 1.5 * nbytes < consecutive < 2 * 1.5 * nbytes * 1.15

    nodes_before, pids_before = ranks.cluster, ranks.pids
    ranks.place((0, 1, 0, 1))  # now every hop of the ring crosses
    where = ranks.run(cluster.whereabouts)
    # fresh ranks on the same nodes (moving ranks keeps the nodes and the launcher)
    assert ranks.cluster is nodes_before and not set(ranks.pids) & set(pids_before)
    assert [w.address for w in where] == ["198.18.0.1", "198.18.0.2"] * 2
    before = ranks.wire_bytes()
    assert ranks.run(all_reduce_ones, nbytes) == [4.0] * 4
    interleaved = ranks.wire_bytes() - before
    assert 4 * 1.5 * nbytes < interleaved < 4 * 1.5 * nbytes * 1.15
    assert ranks.cluster.drops() == 0


def test_set_link_reshapes_running_ranks(ranks):
    ranks.run(cluster.whereabouts)
    pids = ranks.pids
    ranks.set_link(100e6)
    try:
        assert ranks.pids == pids  # the same ranks, a slower link
        (tbf,) = [q for q in _qdiscs(ranks.cluster, ranks.cluster.node(0).netns, cluster.UPLINK)
                  if q["kind"] == "tbf"]
        assert tbf["options"]["rate"] == 100e6 / 8
    finally:
        ranks.set_link(LINK)


def test_a_failed_call_removes_the_nodes_and_the_next_call_makes_them_again(ranks):
    ranks.run(cluster.whereabouts)
    first = ranks.cluster
    with pytest.raises(Exception, match="rank 1 fails on purpose"):
        ranks.run(fail_on_rank_1)
    assert first.closed and first.switch not in cluster.our_namespaces()
    assert ranks.cluster is None
    assert ranks.run(all_reduce_ones, 1024) == [4.0] * 4
    assert ranks.cluster.switch != first.switch


def test_resize_keeps_nodes_whole(ranks):
    with pytest.raises(ValueError, match="nodes must divide world_size=3"):
        ranks.resize(3)
    ranks.resize(2)
    assert ranks.placement == (0, 1)
    assert [w.address for w in ranks.run(cluster.whereabouts)] == ["198.18.0.1", "198.18.0.2"]
