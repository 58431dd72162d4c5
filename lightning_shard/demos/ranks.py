"""Run a function on several local CPU ranks over gloo and gather what each rank returns.

Each rank gets the torchrun environment, so a Trainer inside the function joins it as an existing
process group instead of launching processes of its own (whose results it would have to pickle back,
which fails on sharded parameters). Ranks are started with ``spawn`` (never fork: the parent may hold
OpenMP threads) and use one thread each; a rank's exception is re-raised in the parent with its
traceback. The tests and the benchmarks run their 2- and 4-rank jobs with it.

Where the platform has it, ranks start from a fork server (``multiprocessing``'s ``forkserver``): one
clean process, started on the first call, that has imported torch and Lightning once and forks a fresh
process per rank from then on. It runs no OpenMP or other threads, so forking it is safe, and each rank
is still a new process that shares nothing with other jobs; only the imports (several seconds per rank
on a small machine) are not repeated, the optional libraries' too (:mod:`lightning_shard.demos._warm`).
A rank gets the caller's environment as it is at the call (the server's own dates from its start).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: What the fork server imports once, before it forks any rank.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "lightning",
    "lightning_shard",
    # the doors, both engines and the callbacks that ``import lightning_shard`` leaves to first use (the
    # DeepSpeed engine imports DeepSpeed only when it runs)
    "lightning_shard.trainer.strategy",
    "lightning_shard.trainer.precision",
    "lightning_shard.callbacks",
    "lightning_shard.averaging",
    "lightning_shard.engines.fsdp",
    "lightning_shard.engines.deepspeed",
    "lightning_shard.demos.gpt",
    "lightning_shard.demos._warm",  # last: the optional libraries (best-effort), then gc.freeze()
]


def _start_method() -> str:
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read only when the server starts, i.e. on the first call
    return "forkserver"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reserved_port() -> socket.socket:
    """A socket bound (not listening) to a free port, held for as long as a job's store may need the port.

    :func:`free_port` releases its port at once, and a job started at the same moment (another test, another
    benchmark) may be handed the same one before rank 0's store listens on it: its ranks then join the other
    job's store and mix their collectives. While this socket is open the system hands the port to no one else;
    rank 0's store still binds it, both sockets allowing address reuse and this one never listening."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    return sock


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    out_dir: str,
    env: dict[str, str],
    args: tuple,
    kwargs: dict,
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    result = fn(*args, **kwargs)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    # The result is on disk: leave without interpreter teardown. Callers want what a rank computes;
    # a rare abort in torch's exit-time cleanup (a joinable C++ thread destroyed at exit) would
    # otherwise fail them at random. Exit codes of whole jobs are tested where they are the subject.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned processes; return each rank's result."""
    reservation = reserved_port()
    port = reservation.getsockname()[1]
    with reservation, tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, port, out_dir, dict(os.environ), args, kwargs),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        try:
            while not context.join():
                pass
        finally:
            # Left waiting by an exception of the caller's own (a test's time limit, Ctrl+C): a rank still
            # running would hold its memory and ports for the rest of the caller's process.
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
    return results
