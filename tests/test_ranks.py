"""helpers.ranks: real processes, real process groups; what a notebook user relies on."""
import dataclasses
import datetime
import functools
import ipaddress
import linecache
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from unittest.mock import ANY

import pytest
import torch
import torch.distributed as dist

from helpers import ranks
from helpers.launch import host, process, shipping
from helpers.launch import live as launch_live
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


@pytest.fixture
def interruptible():
    """SIGINT raising KeyboardInterrupt, as in a Jupyter kernel, whatever the test runner
    inherited: a shell starts background jobs (and `nohup`) with SIGINT ignored, and Python
    then never installs its handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def wait_dead(pids, seconds=10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def processes() -> dict[int, int]:
    """Every live process: its parent's pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[0] != "Z":
                found[int(entry)] = int(fields[1])
    return found


def parent(pid: int) -> int:
    return processes()[pid]


def my_descendants() -> set[int]:
    """Live processes below this test process: its launchers and their ranks (not
    multiprocessing ones, so `multiprocessing.active_children()` does not list them)."""
    tree, found, todo = processes(), set(), [os.getpid()]
    while todo:
        top = todo.pop()
        below = {pid for pid, ppid in tree.items() if ppid == top}
        found |= below
        todo += below
    return found


def private_folders(pid=None) -> set[str]:
    prefix = f"plab-ranks-{os.getpid() if pid is None else pid}-"
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefix)}


@pytest.fixture(scope="module")
def live():
    with LiveRanks(2, timeout=20) as group:
        yield group


# -- results, output, threads ----------------------------------------------------------------

def test_ranks_are_outside_the_kernels_process_group():
    # ipykernel's shutdown signals the children in its own process group and waits until they
    # are gone; a killed rank nobody reaps would keep it waiting (29 s a restart, before).
    with LiveRanks(2) as live:
        live.run(rank_fns.identity)
        assert all(os.getpgid(pid) != os.getpgrp() for pid in live.pids)


# -- the launcher: ranks forked from a process that imported torch once -----------------------

def test_ranks_are_forked_from_one_launcher_that_ends_with_them():
    with LiveRanks(3) as group:
        pids = [r["pid"] for r in group.run(rank_fns.identity)]
        [launcher] = group._launchers
        assert parent(launcher.process.pid) == os.getpid()
        assert {parent(pid) for pid in pids} == {launcher.process.pid}
        assert my_descendants() >= {launcher.process.pid, *pids}
    assert wait_dead([launcher.process.pid, *pids]) == []
    assert group._launchers == []


def test_a_rank_forked_later_sees_the_directory_and_environment_of_its_start(
        monkeypatch, tmp_path):
    with LiveRanks(1) as group:
        group.run(rank_fns.identity)  # the launcher starts here, in the old directory
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("PLAB_PROBE", "set after the launcher started")
        late = group.resize(2).run(rank_fns.where, ["PLAB_PROBE"])[1]
    assert late["cwd"] == str(tmp_path)
    assert late["env"] == {"PLAB_PROBE": "set after the launcher started"}
    assert late["path"] == [p for p in sys.path if isinstance(p, str)]


def test_a_killed_launcher_takes_its_ranks_and_the_next_call_starts_afresh(capsys):
    with LiveRanks(2) as group:
        pids = [r["pid"] for r in group.run(rank_fns.identity)]
        [launcher] = group._launchers
        os.kill(launcher.process.pid, signal.SIGKILL)
        assert wait_dead(pids) == []  # each rank's death signal follows its launcher
        capsys.readouterr()
        again = group.run(rank_fns.identity)
        assert [r["rank"] for r in again] == [0, 1]
        assert group._launchers[0] is not launcher and not launcher.alive()
    assert capsys.readouterr().err.strip().splitlines() == [
        "helpers.ranks: the ranks' launcher (exit code -9, killed by SIGKILL), and with it every "
        "rank, had exited while idle; starting fresh ranks"]


def test_without_fork_each_rank_is_a_python_process_of_its_own(monkeypatch):
    monkeypatch.setattr(ranks, "FORK_RANKS", False)  # as on macOS
    with LiveRanks(2) as group:
        results = group.run(rank_fns.where, [])
        assert group._launchers == []
        assert {parent(r["pid"]) for r in results} == {os.getpid()}
    assert [r["rank"] for r in results] == [0, 1]
    assert wait_dead([r["pid"] for r in results]) == []


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
    with LiveRanks(2, timeout=5) as group:  # short, yet room for a rendezvous on a busy machine
        with pytest.raises(RankTimeoutError) as info:
            group.run(rank_fns.all_reduce_unless_last)
        assert info.value.op == "all_reduce"
        assert "all_reduce" in str(info.value) and "rank 0" in str(info.value)
        assert "[1]" in str(info.value)  # rank 1 returned without joining
        assert isinstance(info.value, TimeoutError)
        assert group.run(rank_fns.identity)[1]["rank"] == 1
        # The case: a peer stuck in Python, not one that never came (the barrier's
        # own timeout=1 stands for the group's: the same flag, sooner).
        with pytest.raises(RankTimeoutError) as info:
            group.run(sleep_on_rank_0_while_1_waits_in_a_barrier, 4)
        assert info.value.rank == 1 and info.value.others == {0: None}
        assert "rank 1 timed out after 1 s in barrier; rank(s) [0] were running Python " \
               "code, in no collective." in str(info.value)
        assert "never joined" not in str(info.value)


def sleep_on_rank_0_while_1_waits_in_a_barrier(rank, world_size, seconds):
    if rank == 0:
        time.sleep(seconds)
    else:
        dist.barrier(timeout=datetime.timedelta(seconds=1))


def test_a_timeout_is_the_ranks_flag_and_its_message_blames_no_rank_that_joined(monkeypatch):
    from helpers.launch import worker
    monkeypatch.setitem(worker._LAB, "timeout", 5.0)
    in_a_collective = RuntimeError("Connection closed by peer")
    in_a_collective.__collective__ = ("all_reduce", 0.1, None)
    waited = RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")
    waited.__collective__ = ("all_reduce", 5.0, None)
    its_own = RuntimeError("[gloo] Timed out waiting 1000ms for recv operation to complete")
    its_own.__collective__ = ("barrier", 1.0, 1.0)  # barrier(timeout=timedelta(seconds=1))
    assert worker._status(RuntimeError("Timed out waiting for a file")) == ("error", None)
    assert [worker._status(e) for e in (in_a_collective, waited, its_own)] == [
        ("error", None), ("timeout", 5.0), ("timeout", 1.0)]
    # World size 4: rank 1 timed out in all_reduce as well, rank 2 is still in it, rank 3
    # returned without it. Only rank 3 is said to have returned.
    error = RankTimeoutError(0, "all_reduce", "tb", 5.0,
                             {1: "timed out", 2: "all_reduce", 3: "returned"})
    assert str(error).splitlines()[0] == (
        "rank 0 timed out after 5 s in all_reduce; rank(s) [1] timed out too; rank(s) [2] were "
        "inside all_reduce; rank(s) [3] had already returned without joining it.")
    assert error.returned == [3]
    # No reply at all: the notebook gave up on a rank busy in its own code.
    error = RankTimeoutError(0, None, "(no reply from the rank)", 3.0, {1: "returned"},
                             waited=8.0)
    assert str(error).splitlines()[0] == (
        "rank 0 gave no reply in 8 s, in no collective: its own Python code was still running; "
        "rank(s) [1] had already returned.")


@pytest.mark.parametrize("fn", [rank_fns.exit_hard, rank_fns.exit_hard_pipe_held_open],
                         ids=["pipe-closed", "pipe-held-open"])
def test_a_rank_that_dies_is_reported_and_the_rest_are_torn_down(fn):
    """The dead rank is named, not a peer whose barrier failed because of it, whichever
    the parent reads first (with its pipe held open, only the peer's error is there)."""
    with LiveRanks(2, timeout=20) as group:
        pids = [r["pid"] for r in group.run(rank_fns.identity)]
        with pytest.raises(RankError) as info:
            group.run(fn)
        assert info.value.rank == 0 and "exit code 3" in str(info.value)
        assert wait_dead(pids) == []


def test_keyboard_interrupt_kills_every_rank_and_the_next_call_works(interruptible):
    with LiveRanks(2, timeout=60) as group:
        pids = [r["pid"] for r in group.run(rank_fns.identity)]
        # A real SIGINT, as Jupyter's interrupt button sends, not just a flag.
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            group.run(rank_fns.sleep, 30)
        assert wait_dead(pids) == []
        assert not my_descendants() & set(pids)
        assert [r["rank"] for r in group.run(rank_fns.identity)] == [0, 1]


def test_close_leaves_no_child_process_and_no_folder():
    group = LiveRanks(2)
    pids = [r["pid"] for r in group.run(rank_fns.identity)]
    [folder] = group._folders
    assert os.path.basename(folder) in private_folders()
    group.close()
    assert wait_dead(pids) == []
    assert not my_descendants() & set(pids)
    assert not os.path.exists(folder)


SCRIPT = """
import os, signal, sys, time
# A kernel starts with the default dispositions; a runner under nohup or in the background
# would hand down SIGHUP / SIGINT ignored, and LiveRanks rightly leaves ignored signals alone.
for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, signal.SIG_DFL)
sys.path.insert(0, {root!r})
from helpers.ranks import LiveRanks
from tests import rank_fns
group = LiveRanks(1)
pids = [r["pid"] for r in group.run(rank_fns.identity)]
print(" ".join(map(str, pids)), flush=True)
how = {how!r}
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "exit":
    os._exit(0)  # no close(), no atexit: the bluntest exit short of a kill
if how == "return":
    sys.exit(0)
print("waiting", flush=True)
# SIGTERM / SIGHUP come from the test. Not signal.pause(): a signal landing between the print
# and the pause would leave Python's handler pending while pause() waited for another one
# (it hung one CI run for 120 s); a sleep returns, and the handler runs at the loop.
while True:
    time.sleep(0.05)
"""


def run_script(how):
    """A 'kernel' that starts a rank, prints its pid, then ends as `how` says."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=ROOT, how=how)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    if how in ("SIGTERM", "SIGHUP"):
        assert proc.stdout.readline() == "waiting\n"
        proc.send_signal(getattr(signal, how))
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()  # no stray 'kernel' after a failure (the next start removes its folder)
        proc.communicate()
        raise
    assert len(pids) == 1, err
    return proc, pids


@pytest.mark.parametrize("how", ["exit", "kill", "return", "SIGTERM", "SIGHUP"])
def test_ranks_die_with_the_kernel(how):
    """A kernel that exits (or is killed) takes its ranks with it: no orphans."""
    proc, pids = run_script(how)
    assert wait_dead(pids) == []
    if how in ("SIGTERM", "SIGHUP"):  # it still dies of the signal, as before...
        assert proc.returncode == -getattr(signal, how)
    if how in ("return", "SIGTERM", "SIGHUP"):  # ...but cleans up first
        assert private_folders(proc.pid) == set()
    if how == "kill":  # nothing can clean up after SIGKILL: the next start does
        assert private_folders(proc.pid), "SIGKILL leaves the folder behind"
        process._remove_stale_folders()  # what every start of ranks begins with
        assert private_folders(proc.pid) == set()


UNSHIPPABLE = threading.Lock()


# -- bad arguments: one clear error, nothing started --------------------------------------------

def uses_a_lock(rank, world_size, lock):
    return rank


@pytest.mark.parametrize("call, error, words", [
    (lambda: spawn(rank_fns.identity, 0), ValueError, "world_size must be between 1 and"),
    (lambda: spawn(rank_fns.identity, 10_000), ValueError, "world_size must be between 1 and"),
    (lambda: spawn(rank_fns.identity, "2"), TypeError, "world_size must be an int"),
    (lambda: spawn(42, 2), TypeError, "fn must be a callable"),
    (lambda: spawn(uses_a_lock, 2, threading.Lock()), TypeError,
     "argument 'lock' of uses_a_lock \\(a lock\\) cannot be sent to the ranks"),
    (lambda: spawn(rank_fns.identity, 2, value=open(os.devnull)), TypeError,
     "argument 'value' of identity \\(a TextIOWrapper\\) cannot be sent"),
    (lambda: spawn(lambda r, w: UNSHIPPABLE, 2), TypeError, r"fn=.*<lambda> \(a global"),
    (lambda: spawn(rank_fns.identity, 2, backend="mpi"), ValueError, "backend must be one of"),
    (lambda: spawn(rank_fns.identity, 2, timeout=0), ValueError, "timeout must be"),
    (lambda: spawn(rank_fns.identity, 2, timeout=float("inf")), ValueError,
     r"timeout must be a number of seconds in \[1, 604800\]"),
    (lambda: spawn(rank_fns.identity, 2, timeout=1e12), ValueError, r"in \[1, 604800\]"),
    (lambda: spawn(rank_fns.identity, 2, timeout=1e-9), ValueError, r"in \[1, 604800\]"),
    (lambda: spawn(rank_fns.identity, 2, check_collectives=1), TypeError,
     "check_collectives must be True or False"),
    (lambda: spawn(rank_fns.identity, 2, timeout=float("nan")), ValueError, "timeout must be"),
    (lambda: spawn(rank_fns.identity, 2, timeout=10**400), ValueError, "timeout must be"),
    (lambda: spawn(rank_fns.identity, 2, timeout=True), ValueError, "timeout must be"),
    (lambda: spawn(rank_fns.identity, 2, timeout="5"), ValueError, "timeout must be"),
    (lambda: LiveRanks(2, multi_node="yes"), TypeError, "multi_node must be True or False"),
    (lambda: LiveRanks(2).resize(-1), ValueError, "world_size must be between 1 and"),
    (lambda: LiveRanks(2).run(print), ValueError, "must be a Python function"),
])
def test_bad_arguments_fail_before_any_process_starts(call, error, words):
    before = set(multiprocessing.active_children()), my_descendants(), private_folders()
    with pytest.raises(error, match=words):
        call()
    assert (set(multiprocessing.active_children()), my_descendants(), private_folders()) == before


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
    with pytest.raises(ValueError, match=f"between 1 and {max(limit, host.cuda_device_count())}"):
        ranks.check_world_size(limit + max(1, host.cuda_device_count()) + 1)


def test_resize_keeps_the_backend_chosen_at_construction():
    group = LiveRanks(2)
    backend = group.backend
    assert group.resize(3).backend == backend and group.resize(1).backend == backend


def test_timeout_none_means_no_timeout():
    with LiveRanks(1, timeout=None) as group:
        assert group.timeout is None
        assert group.run(rank_fns.identity)[0]["rank"] == 0


# -- threads, stale replies, interrupts during clean-up ----------------------------------------

def test_one_liveranks_called_from_many_threads_returns_each_call_its_own_results(live):
    live.resize(2)
    wrong, errors = [], []

    def caller(t):
        try:
            for i in range(8):
                got = live.run(rank_fns.identity, value=(t, i))
                if [r["value"] for r in got] != [(t, i)] * 2 or [r["rank"] for r in got] != [0, 1]:
                    wrong.append((t, i, got))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and wrong == []


def test_ranks_started_from_a_thread_outlive_the_thread():
    """PR_SET_PDEATHSIG follows the creating thread: ranks must not die when it ends."""
    with LiveRanks(1, timeout=20) as group:
        started = []
        thread = threading.Thread(target=lambda: started.extend(group.run(rank_fns.identity)))
        thread.start()
        thread.join()
        pids = [r["pid"] for r in started]
        assert len(pids) == 1
        again = group.run(rank_fns.identity)
        assert [r["pid"] for r in again] == pids
        assert all(alive(p) for p in pids)


def test_a_stale_reply_is_never_returned(live):
    live.resize(2)
    live.run(rank_fns.identity)
    # A request the parent gave up on: its answers arrive while the next call waits.
    import pickle
    payload = pickle.dumps((rank_fns.sleep, (0.3,), {}))
    for rank in live._ranks[:2]:
        rank.conn.send((10**9, "run", (payload,)))
    got = live.run(rank_fns.identity, value="new")
    assert [r["value"] for r in got] == ["new", "new"]
    assert [r["value"] for r in live.run(rank_fns.identity, value="next")] == ["next", "next"]


def test_an_interrupt_during_clean_up_leaves_no_rank_and_the_next_call_works(monkeypatch,
                                                                            interruptible):
    """The reader presses stop twice: the second interrupt lands while ranks are reaped."""
    with LiveRanks(1, timeout=60) as group:
        pids = [r["pid"] for r in group.run(rank_fns.identity)]
        real_release = process.RankProcess.release

        def release_then_interrupted(rank):
            if not interrupted.is_set():
                interrupted.set()
                os.kill(os.getpid(), signal.SIGINT)  # the second press, mid clean-up
            real_release(rank)

        interrupted = threading.Event()
        monkeypatch.setattr(process.RankProcess, "release", release_then_interrupted)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            group.run(rank_fns.sleep, 30)
        assert interrupted.is_set()
        assert wait_dead(pids) == [] and group.pids == []
        monkeypatch.undo()
        again = group.run(rank_fns.identity, value="after")
        assert [r["value"] for r in again] == ["after"]
        assert not set(pids) & {r["pid"] for r in again}


def test_a_call_cut_short_anywhere_is_cleaned_up_by_the_next_one():
    """Even if clean-up never ran (the object was left dirty), the next call kills the old
    ranks first and answers with its own results."""
    with LiveRanks(1, timeout=20) as group:
        pids = [r["pid"] for r in group.run(rank_fns.identity)]
        import pickle
        payload = pickle.dumps((rank_fns.sleep, (30,), {}))
        for rank in group._ranks:
            rank.conn.send((10**9, "run", (payload,)))
        group._dirty = True  # what an interrupt between two statements leaves
        got = group.run(rank_fns.identity, value="fresh")
        assert [r["value"] for r in got] == ["fresh"]
        assert wait_dead(pids) == []


# -- dead ranks are replaced -------------------------------------------------------------------

def test_a_rank_killed_while_idle_is_replaced_with_a_notice(live, capsys):
    live.resize(2)
    pids = [r["pid"] for r in live.run(rank_fns.identity)]
    os.kill(pids[1], signal.SIGKILL)
    # Reaped, not just a zombie leader: the rank's other threads may still be exiting.
    live._ranks[1].process.wait(timeout=60)
    capsys.readouterr()
    again = live.run(rank_fns.identity)
    assert [r["rank"] for r in again] == [0, 1]
    assert not set(pids) & {r["pid"] for r in again}
    notice = capsys.readouterr().err.strip().splitlines()
    assert notice == ["helpers.ranks: rank 1 (exit code -9, killed by SIGKILL) had exited "
                      "while idle; starting fresh ranks"]


def test_the_exit_code_of_a_dead_rank_is_always_known():
    with LiveRanks(1, timeout=20) as group:
        for code in (3, 4):
            with pytest.raises(RankError, match=f"rank 0 died \\(exit code {code}\\)"):
                group.run(rank_fns.exit_now, code)


def test_a_result_that_cannot_be_unpickled_names_the_rank(live):
    live.resize(2)
    pids = [r["pid"] for r in live.run(rank_fns.identity)]
    with pytest.raises(RankError) as info:
        live.run(rank_fns.unpicklable_in_parent)
    assert info.value.rank == 0 and "could not be unpickled" in str(info.value)
    assert "only loads in the rank" in str(info.value)
    assert [r["pid"] for r in live.run(rank_fns.identity)] == pids  # the ranks were fine


# -- functions from cells, by value; groups the lab owns; modules on disk ----------------------

@dataclasses.dataclass
class CellPoint:
    x: int
    y: int


CellPoint.__module__ = "__main__"  # what a class typed into a notebook cell looks like
SCALE = 10


def cell_helper(value):
    return value * SCALE


def make_cell_closure(k):
    def fn(rank, world_size):
        return CellPoint(rank, cell_helper(rank) + k)
    return fn


for _cell_thing in (cell_helper, make_cell_closure):
    _cell_thing.__module__ = "__main__"


def test_cell_functions_closures_and_lambdas_run_by_value(live):
    live.resize(2)
    points = live.run(make_cell_closure(1))
    # The class went by value and came back as the notebook's own class.
    assert points == [CellPoint(0, 1), CellPoint(1, 11)]
    assert all(type(p) is CellPoint for p in points)
    assert live.run(lambda rank, world_size, f: f(rank), lambda r: r * 100) == [0, 100]
    assert live.run(functools.partial(lambda rank, world_size, k: rank + k, k=5)) == [5, 6]


def test_cell_lines_are_put_back_from_this_process(monkeypatch, tmp_path):
    cell = str(tmp_path / "ipykernel_1" / "123.py")  # where IPython names a cell's code
    monkeypatch.setitem(linecache.cache, cell, (30, None, ["x = 1\n", "    raise ValueError(x)\n"],
                                                cell))
    remote = ('Traceback (most recent call last):\n'
              '  File "worker.py", line 9, in _handle\n'
              '    data = run()\n'
              f'  File "{cell}", line 2, in fails\n'
              'ValueError: 1\n')
    shown = shipping.with_cell_lines(remote)
    assert shown == remote.replace("fails\n", "fails\n    raise ValueError(x)\n")
    assert shipping.with_cell_lines(shown) == shown  # a line already there is not repeated


def test_module_files_are_stamped_when_first_seen_and_a_change_is_seen(tmp_path, monkeypatch):
    (tmp_path / "student_module_a.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = set(sys.modules)
    import student_module_a  # noqa: F401
    try:
        stamps = shipping.new_module_files(seen)
        path = os.path.realpath(tmp_path / "student_module_a.py")
        assert list(stamps) == [path] and shipping.new_module_files(seen) == {}
        assert shipping.changed_files(stamps) == []
        (tmp_path / "student_module_a.py").write_text("VALUE = 22\n")
        assert shipping.changed_files(stamps) == [path]
    finally:
        del sys.modules["student_module_a"]
    # The standard library's and installed packages' modules are never counted.
    assert shipping.new_module_files(set(sys.modules) - {"json", "torch", "helpers.launch.live"}) \
        == {os.path.realpath(launch_live.__file__): ANY}


def leaves_a_group(rank, world_size, keep):
    group = dist.new_group(list(range(world_size)))
    if keep:
        KEPT_GROUPS.append(group)  # a rank-side cache, as helpers.labs.layouts keeps
    return len(dist.distributed_c10d._world.pg_map)


def group_count(rank, world_size):
    return len(dist.distributed_c10d._world.pg_map)


KEPT_GROUPS = []


def test_a_sub_group_left_behind_is_destroyed_and_a_kept_one_stays(live):
    live.resize(2)
    before = live.run(group_count)
    assert live.run(leaves_a_group, False) == [before[0] + 1] * 2
    assert live.run(group_count) == before
    assert live.run(leaves_a_group, True) == [before[0] + 1] * 2
    assert live.run(group_count) == [before[0] + 1] * 2


# -- a bounded number of rank processes ---------------------------------------------------------

def test_rerunning_a_cell_keeps_the_live_ranks_bounded(monkeypatch, capsys):
    monkeypatch.setattr(ranks, "LIVE_RANK_LIMIT", 1)
    kept = []  # what Out[] does to every displayed LiveRanks
    try:
        for _ in range(3):
            kept.append(LiveRanks(1, timeout=20))
            kept[-1].run(rank_fns.identity)
            everyone = list(launch_live._POOL)  # the fixture's ranks too
            assert sum(len(g.pids) for g in everyone) <= 1
        notices = [l for l in capsys.readouterr().err.splitlines() if "helpers.ranks" in l]
        assert len(notices) >= 2
        assert all("to keep at most 1 rank processes alive" in line for line in notices)
        assert kept[0].pids == [] and len(kept[2].pids) == 1
        # The evicted one restarts lazily, evicting the least recently used in turn.
        assert [r["rank"] for r in kept[0].run(rank_fns.identity)] == [0]
        assert kept[2].pids == [] and len(kept[0].pids) == 1
    finally:
        for group in kept:
            group.close()


def test_settings_assigned_on_helpers_ranks_reach_the_code_that_reads_them(monkeypatch):
    # The README's `helpers.ranks.LIVE_RANK_LIMIT = n`: the setting lives in launch.live.
    monkeypatch.setattr(ranks, "LIVE_RANK_LIMIT", 3)
    monkeypatch.setattr(ranks, "FORK_RANKS", not launch_live.FORK_RANKS)
    assert launch_live.LIVE_RANK_LIMIT == 3 and ranks.live_rank_limit() == 3
    assert ranks.FORK_RANKS == launch_live.FORK_RANKS
    monkeypatch.undo()
    assert ranks.LIVE_RANK_LIMIT is None and ranks.live_rank_limit() == ranks.max_cpu_world_size()
    assert ranks.FORK_RANKS == launch_live.FORK_RANKS == sys.platform.startswith("linux")


# -- nothing beyond loopback unless asked ------------------------------------------------------

def test_inherited_transport_variables_do_not_override_the_loopback_pin(monkeypatch):
    lo = ranks.loopback_interface()
    for name in ranks.TRANSPORT_VARIABLES:
        monkeypatch.setenv(name, "eth0")
    got = spawn(rank_fns.environment, 1, ranks.TRANSPORT_VARIABLES)[0]
    assert got == {name: lo for name in ranks.TRANSPORT_VARIABLES}


def test_multi_node_keeps_inherited_transport_variables(monkeypatch):
    # TensorPipe's variable: honoured by the rank's environment, unused by gloo here.
    monkeypatch.setenv("TP_SOCKET_IFNAME", "eth0")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    got = spawn(rank_fns.environment, 1, ranks.TRANSPORT_VARIABLES, multi_node=True)[0]
    assert got["TP_SOCKET_IFNAME"] == "eth0"
    assert got["GLOO_SOCKET_IFNAME"] == ranks.loopback_interface()  # still the default


# -- checked collectives ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checked():
    with LiveRanks(2, timeout=20, check_collectives=True) as group:
        yield group


def checked_calls(rank, world_size):
    """Calls of many kinds that agree pass the check; each that differs raises the same error
    on every rank, after which the ranks are still in step."""
    from helpers.launch.worker import CollectiveMismatchError
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    gathered = [torch.zeros(4) for _ in range(world_size)]
    dist.all_gather(gathered, t)
    objects = [None] * world_size
    dist.all_gather_object(objects, "x" * (rank + 1))  # objects may differ in size
    if rank == 0:  # point to point: not checked
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    dist.all_reduce(t, group=dist.new_group([0, 1]))
    caught = []
    for differing in (lambda: dist.broadcast(t, src=rank),
                      lambda: dist.all_reduce(torch.ones(4, dtype=[torch.float32, torch.int64][rank])),
                      lambda: dist.all_reduce(t, op=[dist.ReduceOp.SUM, dist.ReduceOp.MAX][rank]),
                      lambda: dist.all_reduce(torch.ones(4 + rank)),
                      lambda: dist.all_reduce(t) if rank == 0 else dist.barrier()):
        try:
            differing()
        except CollectiveMismatchError as error:
            caught.append(str(error).splitlines())
    dist.all_reduce(t)
    return t.tolist(), objects, caught


def test_checked_collectives_raise_on_every_rank_naming_the_field_and_the_ranks(checked):
    results = checked.run(checked_calls)
    assert results[0] == results[1]  # the same errors on both ranks
    t, objects, caught = results[0]
    assert t == [8.0] * 4 and objects == ["x", "xx"]  # 2 after all_reduce, 4, 8
    differently = "checked collectives: {} called differently by the ranks of group [0, 1]"
    assert caught == [
        [differently.format("broadcast"), "  root: src=0 on rank(s) [0], src=1 on rank(s) [1]"],
        [differently.format("all_reduce"),
         "  dtype: torch.float32 on rank(s) [0], torch.int64 on rank(s) [1]"],
        [differently.format("all_reduce"),
         "  op: ReduceOp.SUM on rank(s) [0], ReduceOp.MAX on rank(s) [1]"],
        [differently.format("all_reduce"), "  shape: (4,) on rank(s) [0], (5,) on rank(s) [1]"],
        ["checked collectives: different collectives called by the ranks of group [0, 1]",
         "  kind: all_reduce on rank(s) [0], barrier on rank(s) [1]"],
    ]


def test_checked_collectives_are_off_unless_asked(live):
    assert not live.check_collectives and LiveRanks(2).check_collectives is False


# -- what comes back, what is left behind, what cannot nest ----------------------------------------

def small_view(rank, world_size):
    return torch.arange(1_000_000.0)[10:12]


def test_a_view_comes_back_with_its_data_only(live):
    live.resize(2)
    view = live.run(small_view)[1]
    assert view.tolist() == [10.0, 11.0] and view.untyped_storage().nbytes() == 8


def test_a_tensor_crosses_as_its_bytes_once():
    tensor = torch.arange(12.0).reshape(3, 4)
    frames = shipping.dumps_frames({"t": tensor, "name": "x"})
    # Out: the second frame is the tensor's own memory, not a copy in the pickle.
    assert len(frames) == 2 and frames[1].nbytes == 48 and len(frames[0]) < 300
    assert torch.frombuffer(frames[1], dtype=torch.uint8).data_ptr() == tensor.data_ptr()
    # In: the tensor is built over the bytes received, writable.
    received = [bytearray(f) for f in frames]
    back = shipping.loads_frames(received)
    assert back["name"] == "x" and torch.equal(back["t"], tensor)
    assert back["t"].data_ptr() == torch.frombuffer(received[1], dtype=torch.uint8).data_ptr()
    odd = [torch.tensor(3, dtype=torch.bfloat16), tensor.T, torch.empty(0, 2),
           torch.ones(2, dtype=torch.complex64).conj(), torch.tensor([True, False])]
    for before, after in zip(odd, shipping.loads_frames([bytearray(f) for f in
                                                         shipping.dumps_frames(odd)])):
        assert after.dtype == before.dtype and torch.equal(after, before.resolve_conj())


def two_kib_on_rank_1(rank, world_size):
    return torch.zeros(512 * rank)


def test_a_large_result_is_named_in_a_warning(live, monkeypatch):
    live.resize(2)
    monkeypatch.setattr(process, "LARGE_RESULT_BYTES", 1024)  # 1 GiB in the lab
    with pytest.warns(UserWarning) as warned:
        results = live.run(two_kib_on_rank_1)
    assert [r.numel() for r in results] == [0, 512]
    assert [str(w.message) for w in warned] == [
        "the result of rank 1 is 0.0 GiB: the notebook holds all of it (return less, or save "
        "it to a file on the rank)"]


def test_a_call_from_a_signal_handler_inside_a_call_is_refused_with_one_error(live):
    live.resize(2)
    refused = []

    def handler(signum, frame):
        for again in (lambda: live.run(rank_fns.identity), live.close):
            try:
                again()
            except RuntimeError as error:
                refused.append(str(error))

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        assert live.run(rank_fns.sleep, 1.0) == [0, 1]  # the interrupted call goes on unharmed
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert refused == [
        f"LiveRanks.{what}() was called while this thread is inside LiveRanks.run() of the same "
        "object (from a signal handler?); calls on one LiveRanks cannot nest: call it after that "
        "one returns" for what in ("run", "close")]


# Last, as they end the module's live ranks (a restart costs seconds): a rank gloo aborts,
# then a close.

def all_reduce_of_another_size(rank, world_size):
    dist.all_reduce(torch.ones(4 + rank))


def test_a_rank_gloo_aborts_is_named_with_gloos_own_words(live):
    live.resize(2)
    with pytest.raises(RankError) as info:
        live.run(all_reduce_of_another_size)  # unchecked: gloo aborts the receiving rank
    assert "killed by SIGABRT); its last words on stderr:" in str(info.value)
    assert "Is there a distributed collective mismatch in your code?" in str(info.value)


def start_a_subprocess(rank, world_size):
    return subprocess.Popen(["sleep", "600"]).pid


def start_a_subprocess_then_exit_on_rank_0(rank, world_size, folder):
    if rank == 0:
        with open(os.path.join(folder, "pid"), "w") as f:
            f.write(str(start_a_subprocess(rank, world_size)))
        os._exit(3)
    dist.barrier()


def test_a_ranks_subprocesses_end_with_it(live, capsys, tmp_path):
    live.resize(2)
    pids = live.run(start_a_subprocess)
    assert all(alive(pid) for pid in pids)
    live.close()
    assert wait_dead(pids) == []
    # A rank that exited on its own was reaped: its group is named, not killed.
    capsys.readouterr()
    with pytest.raises(RankError, match="exit code 3"):
        live.run(start_a_subprocess_then_exit_on_rank_0, str(tmp_path))
    orphan = int((tmp_path / "pid").read_text())
    try:
        assert capsys.readouterr().err.splitlines() == [
            "helpers.ranks: rank 0 had exited before it could be stopped with the processes it "
            f"started; still running: {orphan} (sleep)"]
    finally:
        os.kill(orphan, signal.SIGKILL)
