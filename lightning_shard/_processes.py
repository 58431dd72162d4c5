"""The process side of ShardStrategy: ranks, process groups, the device mesh, collectives, exits.

Kept apart from the strategy's model side (engine, optimizers, checkpoints) so each stays one job.
Nothing here knows about sharding.

Process groups live as long as the process, as under Lightning's ``DDPStrategy``: the default group
(made here unless the user or torchrun's agent made one first) and the device mesh are made at the
first Trainer call and kept across ``fit`` / ``validate`` / ``test`` / ``predict``, so
``trainer.strategy.barrier / broadcast / reduce / all_gather`` work in user code between and after
calls. They are destroyed once, at interpreter exit (:func:`_release_all_at_exit`): the engines
commit their pending checkpoints first, then every group this package made is destroyed (a user's
own ``init_process_group`` is left alone). ``timeout`` applies to every group, and a collective that
exceeds it raises :class:`CollectiveTimeoutError`; from then on every collective of the strategy
raises too (the ranks no longer agree on anything), never a local value. Child ranks started by
Lightning's launcher are waited for when rank 0 exits, and stopped if they do not follow.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import re
import subprocess
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_shard import _compat
from lightning_shard.parallel.mesh import MeshLayout

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

#: How long rank 0, exiting, waits for the ranks it launched before it stops them; after a collective
#: failed (a rank is hung or dead) the healthy ones have already failed too, so it waits less.
CHILD_EXIT_GRACE_S = 10.0
CHILD_EXIT_GRACE_AFTER_FAILURE_S = 2.0
_collective_failed = False

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
        from torch.distributed.constants import default_pg_timeout

        store, _, _ = next(
            dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout or default_pg_timeout)
        )
        _STORES[address, port] = store
    _generation += 1
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    if device_id is not None:
        kwargs["device_id"] = device_id
    log.info("Initializing distributed: GLOBAL_RANK: %d, MEMBER: %d/%d", rank, rank + 1, world_size)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"lightning_shard/{_generation}", _STORES[address, port]),
        rank=rank,
        world_size=world_size,
        **kwargs,
    )
    _world_made, _collective_failed = True, False


def _release_all_at_exit() -> None:
    """At interpreter exit: every live strategy commits its engine's pending checkpoints and releases
    the groups it made, newest first; then the default group, if this package made it."""
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


class ProcessGroupStrategy(ParallelStrategy):
    """Starts one process per device (or joins torchrun / SLURM ones), the process group and the device mesh
    (one data-parallel dimension, or ``([pp,] replicate, shard, tp)``: :mod:`lightning_shard.parallel.mesh`)."""

    def __init__(
        self,
        backend: str | None,
        timeout: timedelta | None,
        replicate_size: int = 1,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._mesh_sizes = (replicate_size, tensor_parallel_size, pipeline_parallel_size)
        self._requested_backend = backend
        self._process_group_backend: str | None = backend
        self._timeout = timeout
        self._device_mesh: Any = None
        self._mesh_generation = -1
        self.num_nodes = 1
        self._groups_before: set[Any] | None = None  # groups alive before this strategy made its own
        self._timed_out = False  # a collective failed: the groups can no longer be trusted
        self._live_key = -1

    @property
    def device_mesh(self) -> Any:
        if self._device_mesh is None:
            raise RuntimeError("ShardStrategy.device_mesh is only available once processes have started.")
        return self._device_mesh

    @property
    def layout(self) -> MeshLayout:
        """The world as ``pp x replicate x shard x tp`` (checked against the world size when the Trainer is built)."""
        return MeshLayout.for_world(self.num_nodes * self.num_processes, *self._mesh_sizes)

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The ranks of one tensor-parallel group, and the stages of one pipeline, read the same batches.
        layout = self.layout
        return {
            "num_replicas": layout.data_parallel_size,
            "rank": layout.data_parallel_rank(self.global_rank),
        }

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning's connector: a custom strategy must say so to get a DistributedSampler.
        return True

    @override
    def _configure_launcher(self) -> None:
        # Runs while the Trainer is built: sizes that do not divide the world fail before any process starts.
        self.layout  # noqa: B018
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = ShardLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._requested_backend or _compat.default_backend(self.root_device)
        assert self.cluster_environment is not None
        self._connect()

    def _connect(self) -> None:
        """Join the process group and build the device mesh, once: later Trainer calls reuse both."""
        if not _compat.distributed_is_initialized():
            assert self._process_group_backend is not None
            device_id = self.root_device if self.root_device.type != "cpu" else None
            init_process_group(
                self.cluster_environment, self._process_group_backend, self._timeout, device_id
            )
            self._timed_out = False  # a new world: an earlier one's failure is behind it
        if self._device_mesh is None or self._mesh_generation != _generation:
            if self._groups_before is None:
                self._groups_before = set(_compat.live_process_groups())
            self._device_mesh = self.layout.build(self.root_device.type)
            self._mesh_generation = _generation
        self._live_key = join_live(self, self._live_key)
        self.apply_timeout()

    # --- groups this strategy made: timeouts and release -----------------------------------------

    @property
    def _owns_world(self) -> bool:
        return _world_made

    def _own_groups(self) -> list[Any]:
        """The process groups this strategy (or its engine) made; all of them when this package made the
        default group."""
        return own_groups(self._groups_before)

    def apply_timeout(self) -> None:
        """Give every group this strategy (or its engine) made the ``timeout`` flag's limit."""
        apply_timeout(self._groups_before, self._timeout)

    def _destroy_world(self) -> None:
        """Destroy the default process group and every group made after it."""
        dist.destroy_process_group()

    def _release_at_exit(self) -> None:
        """Exit: destroy the groups this strategy made (the default one too, when this package made it).
        No barrier: the other ranks may be gone."""
        release_groups(
            self._live_key, self._groups_before, self._destroy_world, self._device_mesh is not None
        )
        self._device_mesh = None

    def _timeout_error(self, where: str, error: BaseException) -> CollectiveTimeoutError:
        self._timed_out = True
        return timeout_error(type(self).__name__, where, self.global_rank, self._timeout, error)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    @guarded
    def barrier(self, name: str | None = None) -> None:
        if not _compat.distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    @guarded
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _compat.distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @override
    @guarded
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            return _compat.sync_ddp(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    @guarded
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)


class ShardLauncher(_compat.SubprocessScriptLauncher):  # type: ignore[misc,valid-type]
    """Lightning's script launcher, plus: rank 0, exiting, waits for the ranks it started, then stops
    any still running (a rank hung in its training step would otherwise outlive the job)."""

    def _call_children_scripts(self) -> None:
        super()._call_children_scripts()
        atexit.register(self._reap_children, list(self.procs))

    @staticmethod
    def _reap_children(procs: list[subprocess.Popen]) -> None:
        grace_s = CHILD_EXIT_GRACE_AFTER_FAILURE_S if _collective_failed else CHILD_EXIT_GRACE_S
        for rank, proc in enumerate(procs, start=1):
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.error(
                    "ShardStrategy: rank %d (pid %d) is still running %.0f s after rank 0 finished; stopping it.",
                    rank,
                    proc.pid,
                    grace_s,
                )
                proc.kill()
                proc.wait()
            if proc.returncode:
                log.error(
                    "ShardStrategy: rank %d (pid %d) exited with code %d.", rank, proc.pid, proc.returncode
                )
