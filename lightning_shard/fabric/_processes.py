"""The process side of ShardFabricStrategy: ranks, the process group, the device mesh, collectives.

The same machinery as the Trainer strategy's (:mod:`lightning_shard._processes`): the default group is
made on the store kept for the life of the process, the mesh is laid out as ``[pp,] replicate x shard x
tp`` by :class:`~lightning_shard.parallel.mesh.MeshLayout`, every group gets the ``timeout`` flag's limit,
a collective that exceeds it raises :class:`~lightning_shard.CollectiveTimeoutError`, and the groups live
until interpreter exit (Fabric has no end-of-run hook), when they are released with the Trainer
strategy's. Only the base class differs: Fabric's ``ParallelStrategy``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_shard import _compat
from lightning_shard import _processes as processes
from lightning_shard._processes import CollectiveTimeoutError, guarded
from lightning_shard.parallel.mesh import MeshLayout


class FabricProcesses(ParallelStrategy):
    """One process per device (or torchrun's / SLURM's), the process group and the device mesh, for Fabric."""

    def __init__(
        self,
        backend: str | None,
        timeout: timedelta | None,
        replicate_size: int = 1,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
    ) -> None:
        super().__init__()
        self._mesh_sizes = (replicate_size, tensor_parallel_size, pipeline_parallel_size)
        self._requested_backend = backend
        self._process_group_backend: str | None = backend
        self._timeout = timeout
        self._device_mesh: Any = None
        self._mesh_generation = -1
        self._num_nodes = 1
        self._groups_before: set[Any] | None = None
        self._timed_out = False
        self._live_key = -1

    @property
    def device_mesh(self) -> Any:
        if self._device_mesh is None:
            raise RuntimeError(
                f"{type(self).__name__}.device_mesh is only available once processes have started: call"
                " fabric.launch() first."
            )
        return self._device_mesh

    @property
    def layout(self) -> MeshLayout:
        """The world as ``pp x replicate x shard x tp``."""
        return MeshLayout.for_world(self.num_nodes * self.num_processes, *self._mesh_sizes)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The ranks of one tensor-parallel group read the same batches.
        layout = self.layout
        return {
            "num_replicas": layout.data_parallel_size,
            "rank": layout.data_parallel_rank(self.global_rank),
        }

    @override
    def _configure_launcher(self) -> None:
        # Runs while Fabric is built: sizes that do not divide the world fail before any process starts.
        self.layout  # noqa: B018
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        self._process_group_backend = self._requested_backend or _compat.default_backend(self.root_device)
        self._connect()

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _connect(self) -> None:
        """Join the process group and build the device mesh, once."""
        if not _compat.distributed_is_initialized():
            assert self._process_group_backend is not None
            device_id = self.root_device if self.root_device.type != "cpu" else None
            processes.init_process_group(
                self.cluster_environment, self._process_group_backend, self._timeout, device_id
            )
            self._timed_out = False
        if self._device_mesh is None or self._mesh_generation != processes.world_generation():
            if self._groups_before is None:
                self._groups_before = set(_compat.live_process_groups())
            self._device_mesh = self.layout.build(self.root_device.type)
            self._mesh_generation = processes.world_generation()
        self._live_key = processes.join_live(self, self._live_key)
        self.apply_timeout()

    def apply_timeout(self) -> None:
        """Give every group this strategy (or its engine) made the ``timeout`` flag's limit."""
        processes.apply_timeout(self._groups_before, self._timeout)

    def _destroy_world(self) -> None:
        torch.distributed.destroy_process_group()

    def _release_at_exit(self) -> None:
        """Interpreter exit: destroy the groups this strategy made. No barrier: other ranks may be gone."""
        joined = self._device_mesh is not None
        processes.release_groups(self._live_key, self._groups_before, self._destroy_world, joined)
        self._device_mesh = None

    def _timeout_error(self, where: str, error: BaseException) -> CollectiveTimeoutError:
        self._timed_out = True
        return processes.timeout_error(type(self).__name__, where, self.global_rank, self._timeout, error)

    # --- collectives (work before, during and after the loop, until exit) ------------------------

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
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _compat.sync_ddp(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    @guarded
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)
