"""The process side of ShardStrategy: ranks, the process group, the device mesh, collectives.

Kept apart from the strategy's model side (engine, optimizers, checkpoints) so each stays one job.
Nothing here knows about sharding.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_shard import _compat


class ProcessGroupStrategy(ParallelStrategy):
    """Starts one process per device (or joins torchrun / SLURM ones), the process group and a 1-D mesh."""

    def __init__(self, backend: str | None, timeout: timedelta | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._requested_backend = backend
        self._process_group_backend: str | None = backend
        self._timeout = timeout
        self._device_mesh: Any = None
        self.num_nodes = 1

    @property
    def device_mesh(self) -> Any:
        if self._device_mesh is None:
            raise RuntimeError("ShardStrategy.device_mesh is only available once processes have started.")
        return self._device_mesh

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
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning's connector: a custom strategy must say so to get a DistributedSampler.
        return True

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _compat.SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._requested_backend or _compat.default_backend(self.root_device)
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _compat.init_dist_connection(
            self.cluster_environment,
            self._process_group_backend,
            timeout=self._timeout,
            device_id=device_id,
        )
        from torch.distributed.device_mesh import init_device_mesh

        self._device_mesh = init_device_mesh(
            self.root_device.type, (self.world_size,), mesh_dim_names=("dp",)
        )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _compat.distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _compat.distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            return _compat.sync_ddp(tensor, group, reduce_op=reduce_op)
        return tensor
