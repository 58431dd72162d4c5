"""The process side both front doors share: ranks, process groups, the device mesh, collectives, exits.

The strategy-side half, :class:`~lightning_shard.core.process_groups.ProcessGroups`, is mixed into each
door's strategy; this module holds what is per process: the default group and its store, the groups
released at exit, collective failures, and the reaping of child ranks. Nothing here knows about sharding
or imports ``lightning.pytorch``.

Process groups live as long as the process, as under Lightning's ``DDPStrategy``: the default group
(made here unless the user or torchrun's agent made one first) and the device mesh are made at the
first Trainer call and kept across ``fit`` / ``validate`` / ``test`` / ``predict``, so
``trainer.strategy.barrier / broadcast / reduce / all_gather`` work in user code between and after
calls. They are destroyed once, at interpreter exit (:func:`_release_all_at_exit`): the engines
commit their pending checkpoints first, then every group this package made is destroyed (a user's
own ``init_process_group`` is left alone). ``timeout`` applies to every group, and a collective that
exceeds it raises :class:`CollectiveTimeoutError`; from then on every collective of the strategy
raises too (the ranks no longer agree on anything), never a local value. Child ranks started by
either door's launcher (:class:`ReapChildren`) are waited for when rank 0 exits, after its own release, for
as long as they run, as torchrun waits for its workers; one is stopped only when it is known to be stuck
(:func:`reap_children`), and a child that fails makes the job fail.

Under torchrun's elastic agent the rendezvous store outlives the workers: a restarted attempt keys its
groups by ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT`` (:func:`store_prefix`), so it never
reads the addresses the dead attempt's ranks wrote there.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import re
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from lightning_shard import _compat

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

#: How long rank 0, exiting, still waits for the ranks it launched once one may be stuck (a collective failed,
#: or rank 0 is exiting on an uncaught exception: :func:`reap_children`) before it stops them. A healthy rank
#: has failed on its own by then (its collectives lost a peer); a rank that is merely slower is never stopped.
CHILD_EXIT_GRACE_S = 2.0
_collective_failed = False
#: The ranks this process launched (local rank, process), reaped at exit after this process's own release.
_CHILDREN: list[tuple[int, subprocess.Popen]] = []

_TIMEOUT_MARKERS = ("timed out", "timeout", "connection closed by peer", "connection reset by peer")


_STORES: dict[tuple[str, int], Any] = {}
#: Bumped each time this package makes the default group; a mesh built on an older one is rebuilt.
_generation = 0
#: This package made the default group now alive (then it destroys it at exit).
_world_made = False
#: Strategies that joined a process group in this process, released at exit in reverse order.
_LIVE: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_joined = itertools.count()


def init_process_group(
    cluster_environment: Any, backend: str, timeout: timedelta | None, device_id: torch.device | None
) -> None:
    """``init_process_group`` on a store kept for the life of the process, under a fresh key prefix.

    A process may make the default group more than once (a user destroyed it between Trainer calls).
    Re-creating the env:// store each time on the same port races with the previous one and reads its
    stale keys; one store, with one prefix per generation, never does.
    """
    global _generation, _world_made, _collective_failed
    rank, world_size = cluster_environment.global_rank(), cluster_environment.world_size()
    address, port = cluster_environment.main_address, int(cluster_environment.main_port)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    if (address, port) not in _STORES:
        # Joining waits for every rank to start (imports, a slow node) as long as torch's default allows;
        # a short ``timeout`` flag bounds the collectives and the store's waits once all have joined.
        joining = max(timeout or default_pg_timeout, default_pg_timeout)
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=joining))
        if timeout is not None:
            store.set_timeout(timeout)
        _STORES[address, port] = store
    _generation += 1
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    if device_id is not None:
        kwargs["device_id"] = device_id
    log.info("Initializing distributed: GLOBAL_RANK: %d, MEMBER: %d/%d", rank, rank + 1, world_size)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(store_prefix(_generation), _STORES[address, port]),
        rank=rank,
        world_size=world_size,
        **kwargs,
    )
    _world_made, _collective_failed = True, False


def store_prefix(generation: int) -> str:
    """The key prefix of the default group made for the ``generation``-th time in this process.

    torchrun's agent keeps one rendezvous store across the restarts of its workers, and every restarted
    process counts its generations from 1 again: keyed by generation alone, a restarted attempt would read
    the keys of the attempt that died and dial its ranks' dead addresses. The run id and the agent's restart
    count (both set by torchrun for each worker; absent elsewhere) tell the attempts apart.
    """
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"lightning_shard/{run}/{attempt}/{generation}" if run else f"lightning_shard/{generation}"


def _release_all_at_exit() -> None:
    """At interpreter exit: every live strategy commits its engine's pending checkpoints and releases
    the groups it made, newest first; then the default group, if this package made it; then rank 0 waits
    for the ranks it launched (:func:`reap_children`).

    The wait comes last: a child may still be in a collective of its own exit that needs this process's
    release, and waiting for it first would hold both until the collective timed out."""
    try:
        _release_groups_at_exit()
    finally:
        reap_children()


def _release_groups_at_exit() -> None:
    global _world_made
    for key in sorted(_LIVE.keys(), reverse=True):
        strategy = _LIVE.get(key)
        try:
            if strategy is not None:
                strategy._release_at_exit()
        except Exception as error:  # noqa: BLE001  (exiting: report, and still release the rest)
            log.error("ShardStrategy: releasing a strategy's groups at exit failed: %r", error)
    try:
        if _world_made and _compat.distributed_is_initialized():
            dist.destroy_process_group()
        _world_made = False
        _STORES.clear()  # the rendezvous store's server thread, stopped before interpreter finalization
    except Exception as error:  # noqa: BLE001  (exiting: report, never mask the exit status)
        log.error("ShardStrategy: releasing process groups at exit failed: %r", error)


atexit.register(_release_all_at_exit)


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than ``ShardStrategy(timeout=...)``, or lost a rank that died."""


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out or lost its peer (gloo, nccl, torch's watchdog)."""
    dist_error = getattr(dist, "DistError", ())
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (
        (bool(dist_error) and isinstance(error, dist_error)) or any(m in text for m in _TIMEOUT_MARKERS)
    )


def guarded(method: F) -> F:
    """Turn a collective's timeout inside ``method`` into a :class:`CollectiveTimeoutError`."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if (self._timed_out or _collective_failed) and _compat.distributed_is_initialized():
            # The groups outlive the failure: a collective on them would wait for the lost rank again,
            # and returning this rank's own value instead would be a silent wrong answer.
            raise CollectiveTimeoutError(
                f"{type(self).__name__}.{method.__name__} was not run: an earlier collective on rank"
                f" {self.global_rank} failed ({type(self).__name__}(timeout={self._timeout})); see the first error."
            )
        try:
            return method(self, *args, **kwargs)
        except CollectiveTimeoutError:
            raise
        except RuntimeError as error:
            if not is_collective_failure(error):
                raise
            raise self._timeout_error(method.__name__, error) from error

    return wrapper  # type: ignore[return-value]


def own_groups(groups_before: set[Any] | None) -> list[Any]:
    """The process groups made since ``groups_before`` was taken; all of them when this package made the
    default group."""
    groups = _compat.live_process_groups()
    if _world_made or groups_before is None:
        return groups
    return [group for group in groups if group not in groups_before]


def apply_timeout(groups_before: set[Any] | None, timeout: timedelta | None) -> None:
    """Give every group made since ``groups_before`` the ``timeout`` flag's limit.

    Groups made after the default one (DeepSpeed's, the async checkpoint group) would otherwise get
    torch's default of 30 minutes, so a hung rank would hold the others that long.
    """
    if timeout is None:
        return
    for group in own_groups(groups_before):
        setter = getattr(group, "set_timeout", None) or getattr(group, "_set_default_timeout", None)
        if setter is not None:
            setter(timeout)


def join_live(strategy: Any, key: int) -> int:
    """Register ``strategy`` (either front door) to release its groups at exit; returns its key."""
    if key not in _LIVE:
        key = next(_joined)
        _LIVE[key] = strategy
    return key


def owns_world() -> bool:
    """Whether this package made the default group now alive (then it destroys it at exit)."""
    return _world_made


def world_generation() -> int:
    """How many times this package has made the default group (a mesh from an older one is stale)."""
    return _generation


def release_groups(
    live_key: int, groups_before: set[Any] | None, destroy_world: Callable[[], None], joined: bool
) -> None:
    """Exit: destroy the groups a strategy made (the default one too, when this package made it)."""
    global _world_made
    _LIVE.pop(live_key, None)
    if not _compat.distributed_is_initialized() or not joined:
        return
    if _world_made:
        destroy_world()
        _world_made = False
    else:
        for group in own_groups(groups_before):
            dist.destroy_process_group(group)


def timeout_error(
    front_door: str, where: str, rank: int, timeout: timedelta | None, error: BaseException
) -> CollectiveTimeoutError:
    """The error for a collective that timed out or lost its peer; every later collective refuses to run."""
    global _collective_failed
    _collective_failed = True
    text = str(error)
    peer = re.search(r"[Rr]ank \d+|peer \[[^\]]*\]:?\d*", text)
    reported = f" torch names {peer.group(0)}." if peer else ""
    return CollectiveTimeoutError(
        f"Rank {rank} gave up on a collective in {front_door}.{where}: another rank did not join"
        f" within {front_door}(timeout={timeout}) or has died.{reported} A rank stuck in its"
        " training_step, a dataloader or I/O holds every other rank; its own log says where it stopped."
        f" If steps legitimately take longer, raise {front_door}(timeout=...)."
        f" torch's error: {text.strip()[:500]}"
    )


class ReapChildren:
    """Mixed into a door's subprocess launcher: rank 0, exiting, waits for the ranks it started (a rank that
    outlives it, or hangs in its training step, would otherwise be orphaned, and its failure lost)."""

    procs: list[subprocess.Popen]

    def _call_children_scripts(self) -> None:
        super()._call_children_scripts()  # type: ignore[misc]
        _CHILDREN.extend(enumerate(self.procs, start=1))


def reap_children() -> None:
    """Wait for every rank this process launched, for as long as each runs, and make the job fail if one did.

    A rank is stopped only when it is known to be stuck: a collective failed in this process (the ranks no
    longer agree; one is hung or dead), or this process is exiting on an uncaught exception (the others may
    wait for it in a collective). Then those still running :data:`CHILD_EXIT_GRACE_S` later are killed. A
    launched rank that fails while this one waits for another is Lightning's to handle: the observer thread
    its launcher starts with the children kills every rank, this one included, within seconds.
    """
    failing = _exiting_on_error()
    deadline = time.monotonic() + CHILD_EXIT_GRACE_S if failing or _collective_failed else None
    for rank, proc in _CHILDREN:
        try:
            proc.wait(timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            log.error(
                "lightning_shard: rank %d (pid %d) is still running %.0f s after the job failed; stopping it.",
                rank,
                proc.pid,
                CHILD_EXIT_GRACE_S,
            )
            proc.kill()
            proc.wait()
    failed = [(rank, proc) for rank, proc in _CHILDREN if proc.returncode]
    _CHILDREN.clear()
    for rank, proc in failed:
        log.error("lightning_shard: rank %d (pid %d) exited with code %d.", rank, proc.pid, proc.returncode)
    if failed and not failing:
        _exit(_exit_status(failed[0][1].returncode))


def _exiting_on_error() -> bool:
    """Whether this interpreter is exiting on an uncaught exception: it printed it and kept it as
    ``sys.last_exc`` (``sys.last_value`` before Python 3.12). A ``SystemExit`` sets neither."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _exit_status(returncode: int) -> int:
    """A child's exit status as a shell reports it: its code, or 128 + the signal that killed it."""
    return returncode if returncode > 0 else 128 - returncode


def _exit(code: int) -> None:
    """End this process with ``code`` from an exit handler, where ``sys.exit`` can no longer change it; the
    output still buffered and the log handlers are flushed first (``os._exit`` skips both)."""
    log.error(
        "lightning_shard: rank 0 finished, but a rank it launched failed; the job exits with code %d.", code
    )
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
