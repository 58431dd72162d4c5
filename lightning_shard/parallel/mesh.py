"""The device mesh: ``(replicate, shard, tp)`` for HSDP and tensor parallelism, or one data-parallel dim.

A world of ``W`` ranks is laid out as ``W = replicate x shard x tp`` in row-major order, so the
tensor-parallel groups are consecutive ranks (one node's fast links), the shard groups come next and
the replicate groups span the rest (across nodes). With ``replicate_size == tensor_parallel_size == 1``
the mesh stays one dimension named ``"dp"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DIMS = ("replicate", "shard", "tp")


@dataclass(frozen=True)
class MeshLayout:
    """How a world of ranks splits: ``replicate x shard x tp``."""

    replicate: int
    shard: int
    tp: int

    @classmethod
    def for_world(cls, world_size: int, replicate_size: int = 1, tensor_parallel_size: int = 1) -> MeshLayout:
        """The layout of ``world_size`` ranks, or a ``ValueError`` naming the flag that does not divide it."""
        check_world(world_size, replicate_size, tensor_parallel_size)
        return cls(
            replicate_size, world_size // (replicate_size * tensor_parallel_size), tensor_parallel_size
        )

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.tp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: ``replicate x shard``."""
        return self.replicate * self.shard

    @property
    def multi_dimensional(self) -> bool:
        return self.replicate > 1 or self.tp > 1

    def data_parallel_rank(self, global_rank: int) -> int:
        """Which batch slice ``global_rank`` reads: the ranks of one tensor-parallel group read the same."""
        return global_rank // self.tp

    def build(self, device_type: str) -> Any:
        """The ``DeviceMesh`` over every rank (a collective: every rank calls it)."""
        from torch.distributed.device_mesh import init_device_mesh

        if not self.multi_dimensional:
            return init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("dp",))
        return init_device_mesh(device_type, (self.replicate, self.shard, self.tp), mesh_dim_names=DIMS)


def data_parallel_mesh(mesh: Any) -> Any:
    """The mesh FSDP2 / DDP run on: ``dp``, ``shard``, or ``(replicate, shard)`` (HSDP)."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        return mesh
    if mesh["replicate"].size() > 1:
        return mesh["replicate", "shard"]
    return mesh["shard"]


def tensor_parallel_mesh(mesh: Any) -> Any | None:
    """The tensor-parallel sub-mesh, or ``None`` when tensor parallelism is off."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names or mesh["tp"].size() == 1:
        return None
    return mesh["tp"]


def check_world(
    world_size: int,
    replicate_size: int,
    tensor_parallel_size: int,
    flag: Callable[[str, int], str] = lambda name, value: f"ShardStrategy({name}={value})",
    world: str = "the world size",
    error: type[ValueError] = ValueError,
) -> None:
    """Both sizes must divide the world: ``W = replicate_size x shard x tensor_parallel_size``.

    ``flag`` spells a flag as the caller's user typed it (the strategy's, the planner's, the CLI's).
    """
    if world_size % tensor_parallel_size:
        raise error(
            f"{flag('tensor_parallel_size', tensor_parallel_size)} does not divide {world} {world_size}."
            f" Use a tensor_parallel_size that divides {world_size}, e.g. the number of devices of one node or"
            " a divisor of it."
        )
    if (world_size // tensor_parallel_size) % replicate_size:
        rest = world_size // tensor_parallel_size
        raise error(
            f"{flag('replicate_size', replicate_size)} does not divide the {rest} data-parallel ranks"
            f" ({world} {world_size} / tensor_parallel_size {tensor_parallel_size}). Use a replicate_size"
            f" that divides {rest}, typically the number of nodes."
        )


__all__ = ["DIMS", "MeshLayout", "check_world", "data_parallel_mesh", "tensor_parallel_mesh"]
