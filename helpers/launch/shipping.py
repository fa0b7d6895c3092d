"""What crosses between the notebook and its ranks, and how the notebook tells that ranks went
stale.

* `pack(fn, args, kwargs)`: a call as bytes, made in the notebook before any process starts.
  cloudpickle (what Ray, Dask and PySpark ship functions with) sends a function by reference
  when its module imports by name (the rank imports it) and by value when it cannot: a
  function typed into a cell (module `__main__`), a lambda or a closure travels with its code,
  the globals it reads, and the helpers and classes those name. Arguments travel the same way,
  functions among them. Whatever does not pickle (a lock, an open file, a process group) is
  one `TypeError` naming the argument.
* Results come back through the same pickler, as frames (`dumps_frames`): the pickle, then
  each plain CPU tensor's memory sent as it lies, received once and used as the tensor's own
  storage in the notebook, so a result costs about its own size in transit, not three times.
  (A tensor's values, dtype and shape cross; its layout arrives contiguous.) A class defined
  in a cell keeps cloudpickle's id for it on both sides, so an instance a rank returns unpickles as an instance of the
  notebook's very class: `isinstance` and `==` hold, as long as the cell defining it has not
  been run again since the call (a re-run defines a new class, as in plain Python).
* `with_cell_lines(traceback_text)`: a rank has no copy of a cell's source, so its traceback
  names the cell's frames without their lines; the notebook has them in its `linecache`
  (IPython keeps every cell there) and puts each missing line back. (cloudpickle writes
  "<dynamic-code>" for the file of code it ships; `dumps` keeps the real name.)
* `new_module_files(seen)` (on a rank) and `changed_files(stamps)` (in the notebook): the
  files of the reader's and the project's modules a rank has imported (not the standard
  library's, not installed packages'), with their modification time and size when first
  seen; one that differs on disk now means the ranks run code that is no longer there.
"""
from __future__ import annotations

import functools
import inspect
import io
import linecache
import os
import pickle
import re
import site
import struct
import sys
import sysconfig
import types
from collections import ChainMap

import cloudpickle

_code_reduce = getattr(cloudpickle.cloudpickle, "_code_reduce", None)


def _code_keeping_its_file(code: types.CodeType):
    """cloudpickle's reduction of a code object, with the file name it replaced put back: a
    rank's traceback then names the cell, which the notebook can show the lines of."""
    rebuild, fields = _code_reduce(code)
    return rebuild, tuple(code.co_filename if f == "<dynamic-code>" else f for f in fields)


def _refuse_open_file(file: io.TextIOWrapper):
    """cloudpickle would send a file open for reading as a copy of all its text: one rank
    would read a snapshot, and a large file would cross whole. Refuse it like any file."""
    raise TypeError(f"cannot send an open file ({getattr(file, 'name', '?')!r})")


def _tensor_from_buffer(buffer, dtype, shape):
    """A tensor over `buffer` itself (no copy): what `_reduce_tensor` ships is rebuilt here."""
    import torch
    if memoryview(buffer).readonly:  # torch wants memory it may write
        buffer = bytearray(buffer)
    if not len(buffer):
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)


def _reduce_tensor(tensor):
    """A plain CPU tensor as its bytes in a pickle.PickleBuffer: with `dumps_frames` they are
    sent as they lie in memory, never copied into the pickle (values, dtype and shape cross;
    the layout arrives contiguous). Anything else pickles as torch pickles it."""
    import torch
    if (tensor.layout != torch.strided or tensor.device.type != "cpu" or tensor.requires_grad
            or tensor.is_quantized):
        return NotImplemented
    try:
        data = tensor.resolve_conj().resolve_neg().contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # named dimensions, a dtype numpy cannot view, ...
        return NotImplemented
    return _tensor_from_buffer, (pickle.PickleBuffer(raw), data.dtype, tuple(data.shape))


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({io.TextIOWrapper: _refuse_open_file},
                              {types.CodeType: _code_keeping_its_file} if _code_reduce else {},
                              cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor:
            reduced = _reduce_tensor(obj)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


def dumps(value) -> bytes:
    """`value` as cloudpickle pickles it, code objects keeping their file names."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def dumps_frames(value) -> list[memoryview]:
    """`value` as frames to send one after another: the pickle, then the memory of each of its
    tensors as it lies (pickle protocol 5's out-of-band buffers). A result crosses as its
    bytes once: nothing is copied into a pickle on the way out, and `loads_frames` builds
    each tensor over the bytes received."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(value)
    return [stream.getbuffer(), *(b.raw() for b in buffers)]


def loads_frames(frames: list):
    """What `dumps_frames` sent, from the frames as received (bytearrays: writable)."""
    return pickle.loads(frames[0], buffers=frames[1:])


# Frames travel on the pipe's file descriptor itself, between two of its messages: 8 bytes of
# length, then the bytes, written from and read into memory as it lies (multiprocessing's own
# recv_bytes_into reads into a copy first: twice the result).
_LENGTH = struct.Struct("!Q")


def write_frames(fd: int, frames: list) -> None:
    for frame in frames:
        with memoryview(frame) as view, view.cast("B") as data:
            _write_all(fd, _LENGTH.pack(len(data)))
            _write_all(fd, data)


def _write_all(fd: int, data) -> None:
    with memoryview(data) as view:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:done + (1 << 24)])


def read_frame(fd: int) -> bytearray:
    """The next frame `write_frames` wrote to `fd`'s other end, in a bytearray of its own."""
    (size,) = _LENGTH.unpack(_read_into(fd, bytearray(_LENGTH.size)))
    return _read_into(fd, bytearray(size))


def _read_into(fd: int, buffer: bytearray) -> bytearray:
    with io.FileIO(fd, "rb", closefd=False) as pipe, memoryview(buffer) as view:
        done = 0
        while done < len(view):
            got = pipe.readinto(view[done:])
            if not got:
                raise EOFError("the rank's pipe closed in the middle of a result")
            done += got
    return buffer


def pack(fn, args: tuple, kwargs: dict) -> bytes:
    """The call `fn(rank, world_size, *args, **kwargs)` as bytes; what does not pickle is named."""
    try:
        return dumps((fn, args, kwargs))
    except Exception as error:
        raise TypeError(f"{_culprit(fn, args, kwargs)} cannot be sent to the ranks "
                        f"({type(error).__name__}: {error}). Only what pickles reaches a rank "
                        "process: create locks, open files and process groups on the rank, "
                        "inside the rank function.") from error


def _culprit(fn, args: tuple, kwargs: dict) -> str:
    """Which part of a call does not pickle, in words: an argument by name, or the function."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(target, "__qualname__", repr(fn))
    try:
        named = inspect.signature(fn).bind_partial(0, 1, *args, **kwargs).arguments
        named = dict(list(named.items())[2:])  # not rank and world_size: the ranks fill them
    except (TypeError, ValueError):
        named = {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}
    for key, value in named.items():
        if not _pickles(value):
            return f"argument {key!r} of {name} (a {type(value).__name__})"
    return f"fn={name} (a global, default or closure variable it uses)"


def _pickles(value) -> bool:
    try:
        dumps(value)
    except Exception:
        return False
    return True


# "  File "<path>", line 3, in f", with the '|' margins of an exception group's members.
_FRAME = re.compile(r'^(?P<indent>[ |]*)File "(?P<file>[^"]+)", line (?P<line>\d+), in ')


def with_cell_lines(text: str) -> str:
    """A rank's traceback with the source line of every frame the rank could not read (a
    cell's) put back from this process's line cache."""
    lines = text.splitlines(keepends=True)
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        frame = _FRAME.match(line)
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if frame and not following.startswith(frame["indent"] + "  "):
            source = linecache.getline(frame["file"], int(frame["line"])).strip()
            if source:
                out.append(f"{frame['indent']}  {source}\n")
    return "".join(out)


@functools.lru_cache(maxsize=1)
def _installed_folders() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    folders = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    folders.update(getattr(site, "getsitepackages", list)())
    folders.add(site.getusersitepackages())
    return tuple(os.path.join(os.path.realpath(f), "") for f in folders if f)


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def new_module_files(seen: set) -> dict[str, tuple[int, int]]:
    """{file: (mtime, size)} of the reader's and the project's modules imported since the last
    look (`seen` holds the module names already looked at, and is updated)."""
    found = {}
    for name in [n for n in list(sys.modules) if n not in seen]:
        seen.add(name)
        path = getattr(sys.modules.get(name), "__file__", None)
        if not isinstance(path, str):
            continue
        path = os.path.realpath(path)
        if path.startswith(_installed_folders()):  # torch's thousands of files: not stat'ed
            continue
        stamp = _stamp(path)
        if stamp is not None:
            found[path] = stamp
    return found


def changed_files(stamps: dict[str, tuple[int, int]]) -> list[str]:
    """The files whose modification time or size differs from `stamps` now (or that are gone)."""
    return [path for path, stamp in stamps.items() if _stamp(path) != stamp]


def shown_path(path: str) -> str:
    """`path` relative to the working folder when it lies inside it (as a reader names it)."""
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative
