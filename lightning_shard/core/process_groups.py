"""The process side as a strategy sees it: :class:`ProcessGroups`, mixed into each front door's strategy.

It joins the world (:mod:`.processes`), lays out the device mesh, applies the ``timeout`` flag, runs the
collectives a user calls on ``trainer.strategy`` / ``fabric.strategy``, and builds the run context an
engine reads. It reads only what both Lightning ``ParallelStrategy`` bases provide (``cluster_environment``,
``parallel_devices``, ``local_rank``, ``global_rank``, ``node_rank``, ``world_size``).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_shard import _compat
from lightning_shard.activation_checkpointing import ActivationCheckpointingConfig
from lightning_shard.config import CheckpointMode, ShardConfig
from lightning_shard.context_parallel import ContextParallel
from lightning_shard.core.processes import (
    CollectiveTimeoutError,
    apply_timeout,
    guarded,
    init_process_group,
    join_live,
    own_groups,
    owns_world,
    release_groups,
    timeout_error,
    world_generation,
)
from lightning_shard.engines import RunContext
from lightning_shard.offload import OffloadDevice
from lightning_shard.parallel import ParallelDims, ParallelMeshes

log = logging.getLogger(__name__)


def reduce_tensor(tensor: Tensor | Any, group: Any | None, reduce_op: Any) -> Tensor | Any:
    """All-reduce ``tensor`` (``"mean"``, ``"sum"`` or a ``ReduceOp``); anything else is returned as it is."""
    if isinstance(tensor, Tensor):
        return _compat.sync_ddp(tensor, group, reduce_op=reduce_op)
    return tensor


def parallel_dims(config: ShardConfig, world_size: int) -> ParallelDims:
    """The flags' layout of ``world_size`` ranks (a ``ValueError`` naming the flag that does not divide it)."""
    return ParallelDims.for_flags(config, world_size)


class ProcessGroups:
    """One process per device (or torchrun's / SLURM's), the process group and the device mesh (one
    data-parallel dimension, or ``([pp,] replicate, shard, tp)``: :mod:`lightning_shard.parallel.dims`).

    A mixin listed before a framework's ``ParallelStrategy`` in each door's bases, so these methods win.
    Each door names its launcher class (:attr:`launcher_class`) and its all-reduce hook (the Trainer's
    ``reduce``, Fabric's ``all_reduce``: both :func:`reduce_tensor`).
    """

    #: The door's subprocess launcher, with :class:`ReapChildren` mixed in.
    launcher_class: type

    #: The door's validated flags (set before this ``__init__`` runs): the backend, the ``timeout`` and the sizes
    #: of the mesh's dimensions are read from it, not passed flag by flag.
    config: ShardConfig

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._context_parallel: ContextParallel | None = None
        self._meshes: ParallelMeshes | None = None  # every mesh of the layout, built once per world
        self._requested_backend = self.config.process_group_backend
        self._process_group_backend: str | None = self._requested_backend
        self._mesh_generation = -1
        self._num_nodes = 1
        self._groups_before: set[Any] | None = None  # groups alive before this strategy made its own
        self._timed_out = False  # a collective failed: the groups can no longer be trusted
        self._apart = False  # the call ends on an exception raised on this rank alone
        self._live_key = -1

    # Read from the framework's ParallelStrategy.
    cluster_environment: Any
    parallel_devices: list[torch.device] | None
    local_rank: int
    global_rank: int
    node_rank: int
    world_size: int

    # --- the validated flags, as both doors show them -------------------------------------------

    @property
    def stage(self) -> int | str:
        """The ZeRO stage (``"auto"`` until setup resolves it)."""
        return self.config.stage

    @property
    def engine_name(self) -> str:
        """The engine that serves the flags (``engine="auto"`` resolved)."""
        return self.config.engine

    @property
    def checkpoint_mode(self) -> CheckpointMode:
        return self.config.checkpoint

    @property
    def activation_checkpointing(self) -> ActivationCheckpointingConfig | None:
        return self.config.activation_checkpointing

    @property
    def offload_optimizer(self) -> OffloadDevice | None:
        return self.config.offload_optimizer

    @property
    def offload_params(self) -> OffloadDevice | None:
        return self.config.offload_params

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def meshes(self) -> ParallelMeshes:
        """Every mesh of the layout, by name (:class:`~lightning_shard.parallel.ParallelMeshes`)."""
        if self._meshes is None:
            raise RuntimeError(
                f"{type(self).__name__}.device_mesh is only available once processes have started (after the"
                " Trainer set the model up, or after fabric.launch())."
            )
        return self._meshes

    @property
    def device_mesh(self) -> Any:
        """The dense layers' mesh: ``("dp",)``, or ``([pp,] replicate, shard, tp)``."""
        return self.meshes.dense

    @property
    def context_parallel(self) -> ContextParallel | None:
        """This rank's context-parallel group (``None``: ``context_parallel_size=1``, or before processes start)."""
        return self._context_parallel

    @property
    def dims(self) -> ParallelDims:
        """The world as ``pp x replicate x shard x cp x tp`` (checked against the world size before any process
        starts)."""
        return parallel_dims(self.config, self.num_nodes * self.num_processes)

    @property
    def layout(self) -> ParallelDims:
        """The same as :attr:`dims` (its earlier name)."""
        return self.dims

    @property
    def _timeout(self) -> timedelta | None:
        return self.config.timeout

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The ranks of one tensor-parallel group, and the stages of one pipeline, read the same batches.
        return self.dims.sampler(self.global_rank)

    def _configure_launcher(self) -> None:
        # Runs while the Trainer / Fabric is built: sizes that do not divide the world fail before any
        # process starts.
        self.dims  # noqa: B018
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self.launcher_class(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._requested_backend or _compat.default_backend(self.root_device)
        self._connect()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _export_ranks(self) -> None:
        """Put this rank's place in the environment variables DeepSpeed and other libraries read, as
        Lightning's ``DeepSpeedStrategy`` does: under SLURM or Ray nothing else sets ``LOCAL_RANK`` & co."""
        env = self.cluster_environment
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.main_address, str(env.main_port)
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(self.global_rank), str(self.world_size)
        os.environ["LOCAL_RANK"] = str(self.local_rank)

    def _connect(self) -> None:
        """Join the process group and build the device mesh, once: later calls reuse both."""
        self._export_ranks()
        if not _compat.distributed_is_initialized():
            assert self._process_group_backend is not None
            device_id = self.root_device if self.root_device.type != "cpu" else None
            init_process_group(
                self.cluster_environment, self._process_group_backend, self._timeout, device_id
            )
            self._timed_out = False  # a new world: an earlier one's failure is behind it
        if self._meshes is None or self._mesh_generation != world_generation():
            if self._groups_before is None:
                self._groups_before = set(_compat.live_process_groups())
            self._meshes = self.dims.build(self.root_device.type)
            self._context_parallel = self._build_context_parallel(self._meshes.context)
            self._mesh_generation = world_generation()
        self._live_key = join_live(self, self._live_key)
        self.apply_timeout()

    def _build_context_parallel(self, mesh: Any) -> ContextParallel | None:
        if mesh is None:
            return None
        return ContextParallel(
            mesh.get_group(), mesh.size(), mesh.get_local_rank(), self.config.context_parallel_method, mesh
        )

    def run_context(self) -> RunContext:
        """What an engine needs to know about these processes (:class:`~lightning_shard.engines.RunContext`)."""
        return RunContext(
            device=self.root_device,
            meshes=self.meshes,
            global_rank=self.global_rank,
            world_size=self.world_size,
            backend=str(self.process_group_backend),
            barrier=self.barrier,
        )

    # --- groups this strategy made: timeouts and release -----------------------------------------

    @property
    def _owns_world(self) -> bool:
        return owns_world()

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
        release_groups(self._live_key, self._groups_before, self._destroy_world, self._meshes is not None)
        self._meshes = None
        self._context_parallel = None

    @property
    def pipeline_stage(self) -> int | None:
        """This rank's pipeline stage (``None`` without pipeline stages)."""
        return self.meshes.pipeline_stage

    def refuse_write_after_failure(self, path: Any) -> bool:
        """Whether a checkpoint must not be written: a collective failed before it, so the ranks no longer agree
        on anything and writing would hang until the timeout again (logged)."""
        if self._timed_out:
            log.error(
                "%s: checkpoint %s NOT written: a collective failed before it (see the error); resume from the"
                " last committed checkpoint.",
                type(self).__name__,
                path,
            )
        return self._timed_out

    #: Exceptions every rank raises at the same point; a call ending on any other skips :meth:`end_barrier`.
    ends_together: tuple[type[BaseException], ...] = ()

    def on_exception(self, exception: BaseException) -> None:
        """The call is ending on ``exception`` (Lightning calls this before ``teardown``)."""
        self._apart = not isinstance(exception, self.ends_together)

    def end_barrier(self) -> None:
        """When a call returns on any rank, every rank has committed its checkpoints and removed its files.

        Skipped after a collective failed (the other ranks may be gone) and when the call ends on an exception
        raised on this rank alone: the others are in another collective, which a barrier here would match or
        wait on until the timeout (``DDPStrategy`` has no barrier there either).
        """
        apart, self._apart = self._apart, False
        if self._timed_out or self._meshes is None or apart:
            return
        try:
            self.barrier("teardown")
        except CollectiveTimeoutError as error:
            log.error("%s: the barrier at the end of the call failed: %s", type(self).__name__, error)

    def _timeout_error(self, where: str, error: BaseException) -> CollectiveTimeoutError:
        self._timed_out = True
        return timeout_error(type(self).__name__, where, self.global_rank, self._timeout, error)

    # --- collectives (before, during and after a run, until exit) --------------------------------

    @guarded
    def barrier(self, name: str | None = None) -> None:
        if not _compat.distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @guarded
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _compat.distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @guarded
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)  # type: ignore[misc]
