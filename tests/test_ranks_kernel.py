"""helpers.ranks inside a real Jupyter kernel (ipykernel, driven through jupyter_client), the
way a reader uses it: interrupts from the stop button, re-run cells, restart and shutdown."""
import json
import os
import time

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
from jupyter_client.manager import KernelManager  # noqa: E402

from tests.test_ranks import ROOT, alive, wait_dead  # noqa: E402

SETUP = """
import json, os
import helpers.ranks
from helpers.ranks import LiveRanks
from tests import rank_fns
def processes():
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            cmdline = open(f"/proc/{entry}/cmdline", errors="replace").read()
        except OSError:
            continue
        if stat[0] != "Z":
            found[int(entry)] = (int(stat[1]), cmdline)
    return found
def launchers():  # this kernel's rank launchers: its children that run _launcher_main
    return sorted(p for p, (ppid, cmd) in processes().items()
                  if ppid == os.getpid() and "_launcher_main" in cmd)
def rank_children():  # this kernel's rank processes: what its launchers forked
    mine = set(launchers())
    return sorted(p for p, (ppid, _) in processes().items() if ppid in mine)
"""


def start_kernel():
    km = KernelManager(kernel_name="python3")
    # Generous: a kernel that needs SIGTERM or the kill fails the test, not a slow machine.
    km.shutdown_wait_time = 240
    km.start_kernel(cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=180)
    execute(kc, SETUP)
    return km, kc


def collect(kc, msg_id, timeout=300) -> dict:
    """Everything one cell sent back: streams, result, error name, final status."""
    got = {"stdout": "", "stderr": "", "result": None, "ename": None}
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            got[content["name"]] += content["text"]
        elif kind == "execute_result":
            got["result"] = content["data"]["text/plain"]
        elif kind == "error":
            got["ename"] = content["ename"]
        elif kind == "status" and content["execution_state"] == "idle":
            break
    while True:  # the shell reply says how the cell ended
        reply = kc.get_shell_msg(timeout=max(1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            got["status"] = reply["content"]["status"]
            return got


def execute(kc, code, timeout=300) -> dict:
    got = collect(kc, kc.execute(code), timeout)
    return got


def value(kc, expression):
    """The JSON value of `expression`, evaluated in the kernel."""
    got = execute(kc, f"print(json.dumps({expression}))")
    assert got["ename"] is None, got
    return json.loads(got["stdout"].strip().splitlines()[-1])


def sigterm_ignored(pid) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask & (1 << (15 - 1)))


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_kernel()
    yield km, kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def test_two_interrupts_in_a_row_leave_the_next_call_correct(kernel, tmp_path):
    km, kc = kernel
    execute(kc, "live = LiveRanks(2, timeout=120)")
    first = value(kc, "[r['pid'] for r in live.run(rank_fns.identity)]")
    msg_id = kc.execute(f"live.run(rank_fns.mark_then_sleep, {str(tmp_path)!r}, 120)")
    deadline = time.monotonic() + 180
    while not all((tmp_path / f"busy-{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, "the ranks never started the call"
        time.sleep(0.05)
    km.interrupt_kernel()
    time.sleep(0.3)  # the scenario: a reader pressing stop twice, 0.3 s apart
    km.interrupt_kernel()
    got = collect(kc, msg_id)
    # The cell was interrupted. (On a loaded machine the second press can land while IPython
    # is still printing the first traceback, which then never arrives: not ours to test.)
    assert got["status"] != "ok" and got["ename"] in ("KeyboardInterrupt", None), got
    assert wait_dead(first) == []
    assert value(kc, "[r['value'] for r in live.run(rank_fns.identity, value='after')]") \
        == ["after", "after"]
    assert value(kc, "[r['value'] for r in live.run(rank_fns.identity, value='again')]") \
        == ["again", "again"]
    assert value(kc, "rank_children()") == sorted(value(kc, "live.pids"))
    execute(kc, "live.close()")


def test_rerunning_a_cell_keeps_the_rank_processes_bounded(kernel):
    km, kc = kernel
    execute(kc, "helpers.ranks.LIVE_RANK_LIMIT = 2")
    cell = "live = LiveRanks(2, timeout=120); live.run(rank_fns.identity); live"
    notices = []
    for _ in range(3):
        got = execute(kc, cell)
        assert got["ename"] is None and got["result"].startswith("LiveRanks(world_size=2")
        notices += [l for l in got["stderr"].splitlines() if l.startswith("helpers.ranks:")]
        assert len(value(kc, "rank_children()")) <= 2 and len(value(kc, "launchers()")) == 1
    # Out[] still holds all three objects; only the newest has processes.
    assert len(notices) == 2 and all("to keep at most 2 rank processes" in n for n in notices)
    assert value(kc, "[o.pids != [] for o in Out.values() if isinstance(o, LiveRanks)]") \
        == [False, False, True]
    execute(kc, "live.close(); helpers.ranks.LIVE_RANK_LIMIT = None")


def kernel_state(kc) -> dict:
    execute(kc, "live = LiveRanks(2, timeout=120)")
    return value(kc, "{'kernel': os.getpid(), 'ranks': [r['pid'] for r in "
                     "live.run(rank_fns.identity)], 'folder': live._folders[0], "
                     "'children': [p for p, (ppid, _) in processes().items() "
                     "if ppid == os.getpid()]}")  # processes(): skips a pid that exits meanwhile


def check_gone(state, km):
    assert wait_dead(state["ranks"] + state["children"] + [state["kernel"]], seconds=60) == []
    assert not os.path.exists(state["folder"])
    status = getattr(km, "_shutdown_status", None)  # jupyter_client's record of how it ended
    if status is not None:
        assert status.name == "ShutdownRequest", f"the kernel had to be {status.name}ed"


def test_restart_and_shutdown_leave_nothing_and_need_no_kill():
    km, kc = start_kernel()
    try:
        state = kernel_state(kc)
        # ipykernel ends its children with SIGTERM: none of ours may ignore it (the
        # multiprocessing resource tracker did, so every shutdown waited for the kill).
        assert [p for p in state["children"] + state["ranks"]
                if alive(p) and sigterm_ignored(p)] == []
        km.restart_kernel(now=False)
        check_gone(state, km)
        kc.wait_for_ready(timeout=180)
        execute(kc, SETUP)
        state = kernel_state(kc)
        assert value(kc, "[r['rank'] for r in live.run(rank_fns.identity)]") == [0, 1]
        kc.stop_channels()
        km.shutdown_kernel(now=False)
        check_gone(state, km)
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=True)


# -- a reader's own code on live ranks: typed into cells, edited on disk, groups it breaks ------

@pytest.fixture(scope="module")
def cells(kernel, tmp_path_factory):
    """Live ranks in the kernel, `cells`, shared by the tests below (a start costs seconds),
    with a folder of the reader's own modules on the path (before the ranks start: they
    take the kernel's path with them)."""
    km, kc = kernel
    folder = tmp_path_factory.mktemp("reader")
    execute(kc, f"import sys; sys.path.insert(0, {str(folder)!r})\n"
                "cells = LiveRanks(2, timeout=120)")
    yield kc, folder
    execute(kc, "cells.close()")


def notices(got) -> list[str]:
    return [line for line in got["stderr"].splitlines() if line.startswith("helpers.ranks:")]


def test_an_edited_module_restarts_the_ranks_and_every_rank_runs_it(cells):
    kc, folder = cells
    module = folder / "student_ranks.py"
    source = "def version(rank, world_size):\n    return {!r}\n"
    module.write_text(source.format("v1"))
    got = execute(kc, "%load_ext autoreload\n%autoreload 2\nimport student_ranks")
    assert got["ename"] is None, got
    assert value(kc, "cells.run(student_ranks.version)") == ["v1", "v1"]
    module.write_text(source.format("v22"))  # another size: no doubt the file changed
    got = execute(kc, "print(json.dumps(cells.run(student_ranks.version)))")
    assert json.loads(got["stdout"]) == ["v22", "v22"]
    assert len(notices(got)) == 1 and "student_ranks.py changed on disk" in notices(got)[0]
    # The case: edited, then resized, the ranks ran ['v22', 'v22', 'v333'].
    module.write_text(source.format("v333"))
    got = execute(kc, "print(json.dumps(cells.resize(3).run(student_ranks.version)))")
    assert json.loads(got["stdout"]) == ["v333"] * 3 and len(notices(got)) == 1
    got = execute(kc, "print(json.dumps(cells.resize(2).run(student_ranks.version)))")
    assert json.loads(got["stdout"]) == ["v333"] * 2 and notices(got) == []


CELLS = [
    "import dataclasses\n@dataclasses.dataclass\nclass Point:\n    x: int\n    y: int",
    "SCALE = 10\ndef helper(value):\n    return value * SCALE",
    "def make(k):\n    def fn(rank, world_size):\n        return Point(rank, helper(rank) + k)\n"
    "    return fn",
    "def apply(rank, world_size, f):\n    return f(rank)",
    "def fails(rank, world_size):\n    width = 3\n"
    "    raise ValueError(f'no room for {width}')  # the cell's own line",
    "import threading\nlock = threading.Lock()\ndef locked(rank, world_size, lock):\n    return rank",
]


def test_functions_typed_into_cells_run_on_the_ranks(cells):
    kc, _ = cells
    for cell in CELLS:
        assert execute(kc, cell)["ename"] is None
    # A closure over a class and a helper of other cells; the class comes back as the cell's.
    assert value(kc, "[[p.x, p.y, type(p) is Point, p == Point(p.x, p.y)] "
                     "for p in cells.run(make(1))]") == [[0, 1, True, True], [1, 11, True, True]]
    assert value(kc, "cells.run(apply, helper)") == [0, 10]  # a cell function as an argument
    got = execute(kc, "try:\n    cells.run(fails)\nexcept helpers.ranks.RankError as error:\n"
                      "    print(error)")
    assert "raise ValueError(f'no room for {width}')  # the cell's own line" in got["stdout"]
    assert "ValueError: no room for 3" in got["stdout"]
    ranks_before, launchers_before = value(kc, "rank_children()"), value(kc, "launchers()")
    got = execute(kc, "try:\n    helpers.ranks.spawn(locked, 2, lock)\nexcept TypeError as error:"
                      "\n    print(error)")
    assert "argument 'lock' of locked (a lock) cannot be sent to the ranks" in got["stdout"]
    assert value(kc, "[rank_children(), launchers()]") == [ranks_before, launchers_before]


GROUP_CELLS = [
    "import torch, torch.distributed as dist\n"
    "def tutorial(rank, world_size):\n    t = torch.ones(1)\n    dist.all_reduce(t)\n"
    "    dist.destroy_process_group()\n    return t.item()",
    "def gathered(rank, world_size):\n    out = [torch.zeros(1) for _ in range(world_size)]\n"
    "    dist.all_gather(out, torch.tensor([float(rank)]))\n"
    "    return [dist.get_rank(), [int(o) for o in out]]",
    "def reform(rank, world_size, path):\n    dist.destroy_process_group()\n"
    "    dist.init_process_group('gloo', store=dist.FileStore(path, world_size),\n"
    "                            rank=world_size - 1 - rank, world_size=world_size)\n"
    "    return dist.get_rank()",
]


def test_the_default_group_destroyed_or_replaced_by_a_rank_function_is_the_labs_again(
        cells, tmp_path):
    kc, _ = cells
    for cell in GROUP_CELLS:
        assert execute(kc, cell)["ename"] is None
    right = [[0, [0, 1]], [1, [0, 1]]]
    got = execute(kc, "print(json.dumps(cells.resize(2).run(tutorial)))")
    assert json.loads(got["stdout"]) == [2.0, 2.0]
    assert len(notices(got)) == 1 and "tutorial destroyed the default process group" in got["stderr"]
    assert value(kc, "cells.run(gathered)") == right  # the next, innocent call works
    got = execute(kc, f"print(json.dumps(cells.run(reform, {str(tmp_path / 'store')!r})))")
    assert json.loads(got["stdout"]) == [1, 0]
    assert len(notices(got)) == 1 and "reform replaced the default process group" in got["stderr"]
    got = execute(kc, "print(json.dumps(cells.run(gathered)))")
    assert json.loads(got["stdout"]) == right and notices(got) == []  # not [[1, [1, 0]], ...]


CHECKED_CELL = (
    "import torch, torch.distributed as dist\n"
    "def mixed(rank, world_size):  # rank 1: another dtype and another reduce op\n"
    "    t = torch.ones(4, dtype=torch.float64 if rank else torch.float32)\n"
    "    dist.all_reduce(t, op=dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM)\n"
    "    return t.tolist()\n"
    "def agreed(rank, world_size):\n"
    "    t = torch.ones(4)\n    dist.all_reduce(t)\n    return t.tolist()")


def test_checked_collectives_name_a_mismatched_dtype_and_reduce_op(kernel):
    km, kc = kernel
    assert execute(kc, CHECKED_CELL + "\nchecked = LiveRanks(2, timeout=120, "
                                      "check_collectives=True)")["ename"] is None
    got = execute(kc, "try:\n    checked.run(mixed)\nexcept helpers.ranks.RankError as error:\n"
                      "    print(error)")
    assert "CollectiveMismatchError: checked collectives: all_reduce called differently by " \
           "the ranks of group [0, 1]\n" \
           "  op: ReduceOp.SUM on rank(s) [0], ReduceOp.MAX on rank(s) [1]\n" \
           "  dtype: torch.float32 on rank(s) [0], torch.float64 on rank(s) [1]\n" in got["stdout"]
    assert value(kc, "checked.run(agreed)") == [[2.0] * 4] * 2  # the next call is right
    execute(kc, "checked.close()")
