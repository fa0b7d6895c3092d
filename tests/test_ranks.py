"""helpers.ranks: real processes, real process groups; what a notebook user relies on."""
import ipaddress
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from helpers import ranks
from helpers.ranks import LiveRanks, RankError, RankTimeoutError, spawn
from tests import rank_fns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids, seconds=10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="module")
def live():
    with LiveRanks(2, timeout=20) as group:
        yield group


# -- results, output, threads ----------------------------------------------------------------

def test_spawn_returns_results_in_rank_order_and_leaves_nothing_running():
    results = spawn(rank_fns.identity, 3, value="x")
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["world_size"] for r in results} == {3}
    assert {r["value"] for r in results} == {"x"}
    assert {r["backend"] for r in results} == {"gloo"}
    assert len({r["pid"] for r in results}) == 3
    assert wait_dead([r["pid"] for r in results]) == []


def test_output_is_shown_once_per_rank_in_rank_order(live, capsys):
    live.resize(3)
    assert live.run(rank_fns.chatty) == [0, 1, 2]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"[rank {r}] line {i} from {r}" for r in range(3) for i in range(3)]


def test_threads_are_capped_so_ranks_share_the_cores(live):
    for n in (1, 2):
        live.resize(n)
        threads = {r["threads"] for r in live.run(rank_fns.identity)}
        assert threads == {max(1, ranks.cpu_cores() // n)}


def test_resize_reuses_processes(live):
    live.resize(3)
    pids3 = [r["pid"] for r in live.run(rank_fns.identity)]
    live.resize(2)
    got = live.run(rank_fns.identity)
    assert [r["pid"] for r in got] == pids3[:2]
    assert [r["world_size"] for r in got] == [2, 2]
    live.resize(3)
    assert [r["pid"] for r in live.run(rank_fns.identity)] == pids3


# -- loopback only ---------------------------------------------------------------------------

def listening_sockets(pids):
    """(address, pid) of every TCP/UDP socket these processes listen on, from `ss`."""
    out = subprocess.run(["ss", "-ltunpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        owners = " ".join(fields[6:])
        for pid in pids:
            if f"pid={pid}," in owners:
                local = fields[4]
                host = local.rsplit(":", 1)[0].strip("[]").split("%")[0]
                found.append((host, pid))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses Linux's `ss`")
def test_ranks_listen_on_loopback_only(live):
    live.resize(2)
    pids = [r["pid"] for r in live.run(rank_fns.identity)]
    sockets = listening_sockets(pids + [os.getpid()])
    assert sockets, "expected gloo to listen on some socket"
    for host, pid in sockets:
        assert host not in ("*", "0.0.0.0", "::"), f"pid {pid} listens on all interfaces"
        assert ipaddress.ip_address(host).is_loopback, f"pid {pid} listens on {host}"


# -- failures --------------------------------------------------------------------------------

def test_exception_on_a_rank_names_it_and_tears_all_ranks_down():
    with LiveRanks(3, timeout=20) as group:
        pids = [r["pid"] for r in group.run(rank_fns.identity)]
        with pytest.raises(RankError) as info:
            group.run(rank_fns.fail_on, 1)
        assert info.value.rank == 1
        assert "ValueError: boom on rank 1" in str(info.value)
        assert "rank_fns.py" in info.value.remote_traceback
        assert wait_dead(pids) == []
        # and the next call works, on fresh processes
        again = group.run(rank_fns.identity)
        assert [r["rank"] for r in again] == [0, 1, 2]
        assert not set(pids) & {r["pid"] for r in again}


def test_collective_whose_peer_never_joins_times_out_naming_the_operation():
    with LiveRanks(2, timeout=2) as group:
        started = time.monotonic()
        with pytest.raises(RankTimeoutError) as info:
            group.run(rank_fns.all_reduce_unless_last)
        assert time.monotonic() - started < 2 + ranks._GRACE_S + 30
        assert info.value.op == "all_reduce"
        assert "all_reduce" in str(info.value) and "rank 0" in str(info.value)
        assert "[1]" in str(info.value)  # rank 1 returned without joining
        assert isinstance(info.value, TimeoutError)
        assert group.run(rank_fns.identity)[1]["rank"] == 1


def test_a_rank_that_dies_is_reported_and_the_rest_are_torn_down():
    with LiveRanks(2, timeout=20) as group:
        pids = [r["pid"] for r in group.run(rank_fns.identity)]
        with pytest.raises(RankError) as info:
            group.run(rank_fns.exit_hard)
        assert info.value.rank == 0 and "exit code 3" in str(info.value)
        assert wait_dead(pids) == []


def test_keyboard_interrupt_kills_every_rank_and_the_next_call_works():
    with LiveRanks(2, timeout=60) as group:
        pids = [r["pid"] for r in group.run(rank_fns.identity)]
        # A real SIGINT, as Jupyter's interrupt button sends, not just a flag.
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            group.run(rank_fns.sleep, 30)
        assert wait_dead(pids) == []
        assert not {p.pid for p in multiprocessing.active_children()} & set(pids)
        assert [r["rank"] for r in group.run(rank_fns.identity)] == [0, 1]


def test_close_leaves_no_child_process():
    group = LiveRanks(2)
    pids = [r["pid"] for r in group.run(rank_fns.identity)]
    group.close()
    assert wait_dead(pids) == []
    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_ranks_die_with_the_kernel(how):
    """A kernel that exits (or is killed) takes its ranks with it: no orphans."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {ROOT!r})
        from helpers.ranks import LiveRanks
        from tests import rank_fns
        group = LiveRanks(2)
        print(" ".join(str(r["pid"]) for r in group.run(rank_fns.identity)), flush=True)
        if {how!r} == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)  # no close(), no atexit: the bluntest exit short of a kill
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2, done.stderr
    assert wait_dead(pids) == []


# -- bad arguments: one clear error, nothing started --------------------------------------------

def defined_in_a_cell(rank, world_size):
    return rank


defined_in_a_cell.__module__ = "__main__"  # what a function typed into a notebook looks like


@pytest.mark.parametrize("call, error, words", [
    (lambda: spawn(rank_fns.identity, 0), ValueError, "world_size must be between 1 and"),
    (lambda: spawn(rank_fns.identity, 10_000), ValueError, "world_size must be between 1 and"),
    (lambda: spawn(rank_fns.identity, "2"), TypeError, "world_size must be an int"),
    (lambda: spawn(42, 2), TypeError, "fn must be a callable"),
    (lambda: spawn(lambda r, w: r, 2), ValueError, "lambda"),
    (lambda: spawn(defined_in_a_cell, 2), ValueError, "notebook cell"),
    (lambda: spawn(rank_fns.identity, 2, backend="mpi"), ValueError, "backend must be one of"),
    (lambda: spawn(rank_fns.identity, 2, timeout=0), ValueError, "timeout must be"),
    (lambda: LiveRanks(2).resize(-1), ValueError, "world_size must be between 1 and"),
    (lambda: LiveRanks(2).run(print), ValueError, "must be a Python function"),
])
def test_bad_arguments_fail_before_any_process_starts(call, error, words):
    before = set(multiprocessing.active_children())
    with pytest.raises(error, match=words):
        call()
    assert set(multiprocessing.active_children()) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPUs")
def test_nccl_without_gpus_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank"):
        spawn(rank_fns.identity, 2, backend="nccl")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs for the NCCL path")
def test_auto_picks_nccl_with_one_gpu_per_rank():
    results = spawn(rank_fns.identity, 2)
    assert {r["backend"] for r in results} == {"nccl"}


def test_world_size_limit_follows_cores_and_memory():
    limit = ranks.max_cpu_world_size()
    assert 1 <= limit <= max(8, 8 * ranks.cpu_cores())
    with pytest.raises(ValueError, match=f"between 1 and {max(limit, ranks._cuda_device_count())}"):
        ranks.check_world_size(limit + max(1, ranks._cuda_device_count()) + 1)


def test_resize_keeps_the_backend_chosen_at_construction():
    group = LiveRanks(2)
    backend = group.backend
    assert group.resize(3).backend == backend and group.resize(1).backend == backend
