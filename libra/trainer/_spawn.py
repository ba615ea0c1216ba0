"""Starting trainer ranks as ``torchrun`` would, for tests and single-machine runs:
:func:`spawn` starts ``world_size`` processes with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, each of which dies with the
process that started it (:func:`die_with_parent`).

A rank killed by a fatal signal (an abort in torch's C++, a segfault) writes every
thread's Python stack to its stderr first, so the failure says where it happened.
A rank that finishes frees what its function built before it leaves: a model sharded
by FSDP sits in reference cycles (modules and their hooks), and left to the
interpreter's shutdown its gloo work may release tensors from a thread that can no
longer take the GIL, which can abort the process after its result was written. Then it
leaves together with the others: a barrier, then the process group is destroyed.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import os
import pickle
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

from libra._net import free_port

__all__ = ["die_with_parent", "spawn"]

R = TypeVar("R")
StartMethod = Literal["spawn", "fork"]


def spawn(
    world_size: int, fn: Callable[..., R], *args: Any, start_method: StartMethod = "spawn"
) -> list[R]:
    """Run ``fn(*args)`` on ``world_size`` new processes, set up as torchrun would.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function); returns each
    rank's result, rank 0 first. A rank that raises makes this raise. ``"fork"`` only
    from a process with one thread that has not touched a device (the trainer's own):
    its ranks then start without importing torch again.
    """
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="libra-spawn-") as results:
        mp.start_processes(
            _run_rank,
            args=(os.getpid(), world_size, port, fn, args, results),
            nprocs=world_size,
            join=True,
            start_method=start_method,
        )
        return [_read_result(Path(results), rank) for rank in range(world_size)]


def _run_rank(
    rank: int,
    parent: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out: str,
) -> None:
    die_with_parent(parent)
    faulthandler.enable(all_threads=True)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    with _process_group_torn_down():
        result = fn(*args)
        with (Path(out) / f"rank{rank}.pkl").open("wb") as file:
            pickle.dump(result, file)
        del result


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Have Linux kill this process when ``parent`` (the process that started it) dies.

    A rank, or the trainer's process, outliving a killed loop would hold its cores and
    memory until its command ended, and its rank 0 would then find the pipe gone.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request was made
        os._exit(1)


@contextlib.contextmanager
def _process_group_torn_down() -> Iterator[None]:
    import torch.distributed as dist

    try:
        yield
    except BaseException:
        if dist.is_initialized():  # the other ranks may be gone: no barrier
            dist.destroy_process_group()
        raise
    gc.collect()  # see the module's docstring
    if dist.is_initialized():
        dist.barrier()  # no rank closes its connections while another still reads
        dist.destroy_process_group()


def _read_result(folder: Path, rank: int) -> Any:
    with (folder / f"rank{rank}.pkl").open("rb") as file:
        return pickle.load(file)
