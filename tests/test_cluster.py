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

def _qdiscs(netns: str, dev: str) -> list[dict]:
    out = subprocess.run(["tc", "-j", "-n", netns, "qdisc", "show", "dev", dev],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@needs_namespaces
def test_cluster_is_made_shaped_at_both_ends_and_removed():
    with cluster.EmulatedCluster(3, 200e6) as c:
        names = mine()
        assert sorted(names) == sorted([c.switch] + [n.netns for n in c.node_infos])
        assert [n.address for n in c.node_infos] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        for netns, dev in c._ends():
            (tbf,) = [q for q in _qdiscs(netns, dev) if q["kind"] == "tbf"]
            assert tbf["options"]["rate"] == 200e6 / 8  # tc reports bytes per second
        c.set_link(50e6)
        (tbf,) = [q for q in _qdiscs(c.switch, "port2") if q["kind"] == "tbf"]
        assert tbf["options"]["rate"] == 50e6 / 8
        # Nothing outside reaches in: the node's only link is the uplink into the switch.
        links = subprocess.run(["ip", "-n", c.node(0).netns, "-j", "link"], capture_output=True,
                               text=True, check=True).stdout
        assert sorted(link["ifname"] for link in json.loads(links)) == ["lo", cluster.UPLINK]
    assert mine() == [] and c.closed


@needs_namespaces
def test_stale_namespaces_of_a_dead_owner_are_removed_and_a_live_owners_kept():
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
        ranks.run(whereabouts)
        print(ranks.cluster.switch, *ranks.pids, flush=True)
        time.sleep(60)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        switch, *pids = owner.stdout.readline().split()
        assert switch in cluster.our_namespaces()
        owner.send_signal(signum)
        assert owner.wait(timeout=30) == -signum
        assert switch not in cluster.our_namespaces()
        for pid in map(int, pids):
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        owner.kill()
        owner.wait()


def test_without_root_one_line_says_so_and_the_ranks_run_flat(tmp_path):
    """Not root: the ranks still run, on loopback, after one line. `unshare --user` makes this
    process an ordinary user (uid 65534, no capabilities outside its own user namespace)
    that can still read the checkout, which `setpriv` to nobody could not where the
    interpreter lives in root's home."""
    script = ("import os\n"
              "from helpers.ranks import LiveRanks\n"
              "from helpers.launch.cluster import whereabouts\n"
              "with LiveRanks(2, nodes=2) as ranks:\n"
              "    print(os.geteuid(), [w.address for w in ranks.run(whereabouts)], ranks.placement)\n")
    try:
        done = subprocess.run(["unshare", "--user", sys.executable, "-c", script],
                              cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("util-linux's unshare is missing")
    if "unshare failed" in done.stderr:
        pytest.skip(f"this kernel refuses user namespaces: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "65534 ['127.0.0.1', '127.0.0.1'] None"
    notices = [line for line in done.stderr.splitlines() if line.startswith("helpers.ranks:")]
    assert notices == ["helpers.ranks: emulated nodes need root (named network namespaces: "
                       "`ip netns add`); the 2 ranks run on the flat network"]
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

    ranks.place((0, 1, 0, 1))  # now every hop of the ring crosses
    where = ranks.run(cluster.whereabouts)
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
        (tbf,) = [q for q in _qdiscs(ranks.cluster.node(0).netns, cluster.UPLINK)
                  if q["kind"] == "tbf"]
        assert tbf["options"]["rate"] == 100e6 / 8
    finally:
        ranks.set_link(LINK)


def test_a_failed_call_removes_the_nodes_and_the_next_call_makes_them_again(ranks):
    ranks.run(cluster.whereabouts)
    first = ranks.cluster.switch
    with pytest.raises(Exception, match="rank 1 fails on purpose"):
        ranks.run(fail_on_rank_1)
    assert first not in cluster.our_namespaces() and ranks.cluster is None
    assert ranks.run(all_reduce_ones, 1024) == [4.0] * 4
    assert ranks.cluster.switch != first


def test_resize_keeps_nodes_whole(ranks):
    with pytest.raises(ValueError, match="nodes must divide world_size=3"):
        ranks.resize(3)
    ranks.resize(2)
    assert ranks.placement == (0, 1)
    assert [w.address for w in ranks.run(cluster.whereabouts)] == ["198.18.0.1", "198.18.0.2"]
