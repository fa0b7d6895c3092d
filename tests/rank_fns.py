"""Rank functions used by the tests: they must live in an importable module."""
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def identity(rank, world_size, value=None):
    return {"rank": rank, "world_size": world_size, "value": value, "pid": os.getpid(),
            "threads": torch.get_num_threads(), "backend": dist.get_backend()}


def chatty(rank, world_size):
    for i in range(3):
        print(f"line {i} from {rank}")
        time.sleep(0.01 * (world_size - rank))  # later ranks print first in wall time
    return rank


def fail_on(rank, world_size, bad_rank):
    if rank == bad_rank:
        raise ValueError(f"boom on rank {rank}")
    dist.barrier()  # the others wait for a peer that will never come
    return rank


def all_reduce_unless_last(rank, world_size):
    """Every rank but the last calls all_reduce: the classic hang."""
    if rank == world_size - 1:
        return "skipped"
    x = torch.ones(4)
    dist.all_reduce(x)
    return x


def sleep(rank, world_size, seconds):
    time.sleep(seconds)
    return rank


def exit_hard(rank, world_size):
    if rank == 0:
        os._exit(3)
    dist.barrier()


def exit_hard_pipe_held_open(rank, world_size, hold_s=2.0):
    """As `exit_hard`, but a child of rank 0 keeps its Unix sockets (its pipe to the parent
    among them; gloo's are TCP) open for `hold_s`: the parent reads rank 1's barrier error
    and no end-of-file from rank 0, which has exited all the same."""
    if rank == 0:
        unix = []
        for name in os.listdir("/proc/self/fd"):
            try:
                with socket.socket(fileno=os.dup(int(name))) as s:
                    if s.family == socket.AF_UNIX:
                        unix.append(int(name))
            except OSError:  # not a socket
                pass
        subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({hold_s})"],
                         pass_fds=unix, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        os._exit(3)
    dist.barrier()


def mesh_against_device_mesh(rank, world_size, d, t, p):
    """helpers.parallel.mesh.build_groups' groups next to torch's DeviceMesh groups, as global rank lists."""
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.layout import Groups, Layout
    from helpers.parallel.mesh import build_groups
    mesh = Layout(d, t, p)
    ours = build_groups(mesh)
    device_mesh = init_device_mesh("cpu", mesh.shape, mesh_dim_names=Layout.names)
    return {"ours": Groups(*(dist.get_process_group_ranks(g) for g in ours)),
            "torch": Groups(*(dist.get_process_group_ranks(device_mesh.get_group(name))
                              for name in Groups._fields)),
            "torch_coords": device_mesh.get_coordinate()}


def exit_now(rank, world_size, code):
    os._exit(code)


def environment(rank, world_size, names):
    return {name: os.environ.get(name) for name in names}


def where(rank, world_size, names):
    """What a rank was started with: directory, some variables, import path, pid."""
    return {"rank": rank, "pid": os.getpid(), "cwd": os.getcwd(), "path": sys.path,
            "env": {name: os.environ.get(name) for name in names}}


def mark_then_sleep(rank, world_size, folder, seconds):
    """Leave a file saying this rank is busy, then sleep: a test interrupts it then."""
    with open(os.path.join(folder, f"busy-{rank}"), "w"):
        pass
    time.sleep(seconds)
    return rank


def _only_in(pid):
    if os.getpid() != pid:
        raise ImportError("this object only loads in the rank that made it")
    return pid


class LoadsOnlyInRank:
    def __reduce__(self):
        return _only_in, (os.getpid(),)


def unpicklable_in_parent(rank, world_size):
    return LoadsOnlyInRank()
