"""The device mesh: ``(pp, replicate, shard, tp)`` for pipeline stages, HSDP and tensor parallelism, or one
data-parallel dim; and the context-parallel groups inside the shard dim.

A world of ``W`` ranks is laid out as ``W = pp x replicate x shard x tp`` in row-major order, so the
tensor-parallel groups are consecutive ranks (one node's fast links), the shard groups come next, the
replicate groups span the rest (across nodes) and each pipeline stage is one such block of ranks (stages
talk point to point, the lightest traffic, so they may sit across the slowest links). With every size but
the shard one at 1 the mesh stays one dimension named ``"dp"``; without pipeline stages it has no ``pp``.

Context parallelism (``cp`` ranks cut each sequence) sits between shard and tp: ``W = pp x replicate x shard x
cp x tp``. The ``cp`` ranks of a group hold the same model and read the same batch, so FSDP2 / DDP treat
them as data-parallel ranks: the mesh's ``shard`` dimension (or its one ``dp`` dimension) spans ``shard x
cp``, as torchtitan shards over its flattened ``dp_shard_cp``; the groups that cut a sequence are a second
mesh (:meth:`MeshLayout.build_context_parallel`).

Expert parallelism (``ep`` ranks each hold ``E/ep`` whole experts) is carved from that shard dimension, as
torchtitan carves its ``ep`` from ``dp_shard x cp``: consecutive runs of ``ep`` ranks along it are the
expert-parallel groups, and the ranks left (``shard x cp / ep``, times ``replicate``) shard or replicate each
expert block. They are a second mesh, ``(pp, replicate, edp, ep, tp)`` over the same ranks
(:meth:`MeshLayout.build_expert`): the experts are DTensors on its ``ep`` dimension, and FSDP2 shards them over
its ``edp`` (and ``replicate``) dimensions, one root mesh for both as FSDP2 requires.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import init_device_mesh

DIMS = ("replicate", "shard", "tp")
PIPELINE_DIMS = ("pp", *DIMS)
#: The expert mesh's dimensions: ``edp`` x ``ep`` spans the main mesh's shard dimension.
EXPERT_DIMS = ("pp", "replicate", "edp", "ep", "tp")


@dataclass(frozen=True)
class MeshLayout:
    """How a world of ranks splits: ``pp x replicate x shard x cp x tp``."""

    replicate: int
    shard: int
    """Data-parallel ranks of one replica that read different batches (the mesh's shard dim is ``shard x cp``)."""
    tp: int
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """Ranks of one expert-parallel group, inside the mesh's shard dimension (``shard x cp``)."""

    @classmethod
    def for_world(
        cls,
        world_size: int,
        replicate_size: int = 1,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
    ) -> MeshLayout:
        """The layout of ``world_size`` ranks, or a ``ValueError`` naming the flag that does not divide it."""
        check_pipeline_world(world_size, pipeline_parallel_size)
        stage_world = world_size // pipeline_parallel_size
        check_world(stage_world, replicate_size, tensor_parallel_size)
        check_context_parallel_world(
            stage_world // tensor_parallel_size, replicate_size, context_parallel_size
        )
        shard = stage_world // (replicate_size * tensor_parallel_size * context_parallel_size)
        check_expert_parallel_world(shard * context_parallel_size, expert_parallel_size)
        return cls(
            replicate_size,
            shard,
            tensor_parallel_size,
            pipeline_parallel_size,
            context_parallel_size,
            expert_parallel_size,
        )

    @property
    def world_size(self) -> int:
        return self.pp * self.replicate * self.shard * self.cp * self.tp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: ``replicate x shard``."""
        return self.replicate * self.shard

    @property
    def multi_dimensional(self) -> bool:
        return self.replicate > 1 or self.tp > 1 or self.pp > 1

    def data_parallel_rank(self, global_rank: int) -> int:
        """Which batch slice ``global_rank`` reads: the ranks of one tensor-parallel or context-parallel
        group, and the stages of one pipeline, read the same."""
        return (global_rank // (self.tp * self.cp)) % self.data_parallel_size

    def build(self, device_type: str) -> Any:
        """The ``DeviceMesh`` over every rank (a collective: every rank calls it)."""
        shard = self.shard * self.cp  # context-parallel ranks shard (and reduce gradients) with the rest
        if self.pp > 1:
            sizes = (self.pp, self.replicate, shard, self.tp)
            return init_device_mesh(device_type, sizes, mesh_dim_names=PIPELINE_DIMS)
        if not self.multi_dimensional:
            return init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("dp",))
        return init_device_mesh(device_type, (self.replicate, shard, self.tp), mesh_dim_names=DIMS)

    def build_expert(self, device_type: str) -> Any:
        """The ``(pp, replicate, edp, ep, tp)`` mesh over every rank (a collective: every rank calls it), or
        ``None`` when ``ep`` is 1. Its ``ep`` groups are consecutive runs of the main mesh's shard dimension."""
        if self.ep == 1:
            return None
        sizes = (self.pp, self.replicate, self.shard * self.cp // self.ep, self.ep, self.tp)
        return init_device_mesh(device_type, sizes, mesh_dim_names=EXPERT_DIMS)

    def build_context_parallel(self, device_type: str) -> Any:
        """The 1-D mesh of this rank's context-parallel group (a collective: every rank calls it), or ``None``
        when ``cp`` is 1. A group is ``cp`` ranks ``tp`` apart, at one place on every other dimension."""
        if self.cp == 1:
            return None
        sizes = (self.world_size // (self.cp * self.tp), self.cp, self.tp)
        return init_device_mesh(device_type, sizes, mesh_dim_names=("cp_outer", "cp", "cp_tp"))["cp"]


def data_parallel_mesh(mesh: Any) -> Any:
    """The mesh FSDP2 / DDP run on (within one pipeline stage): ``dp``, ``shard``, or ``(replicate, shard)``
    (HSDP)."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        return mesh
    if mesh["replicate"].size() > 1:
        return mesh["replicate", "shard"]
    return mesh["shard"]


def expert_meshes(mesh: Any) -> tuple[Any, Any]:
    """``(ep, data-parallel)`` sub-meshes of the expert mesh (:meth:`MeshLayout.build_expert`): the experts'
    DTensor dimension, and the one FSDP2 shards (or replicates) each expert block over: ``edp``, or
    ``(replicate, edp)`` (HSDP)."""
    data = mesh["replicate", "edp"] if mesh["replicate"].size() > 1 else mesh["edp"]
    return mesh["ep"], data


def tensor_parallel_mesh(mesh: Any) -> Any | None:
    """The tensor-parallel sub-mesh, or ``None`` when tensor parallelism is off."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names or mesh["tp"].size() == 1:
        return None
    return mesh["tp"]


def pipeline_mesh(mesh: Any) -> Any | None:
    """The pipeline sub-mesh (one rank per stage, the stages' point-to-point group), or ``None``."""
    names = mesh.mesh_dim_names or ()
    return mesh["pp"] if "pp" in names else None


def check_pipeline_world(world_size: int, pipeline_parallel_size: int) -> None:
    if world_size % pipeline_parallel_size:
        raise ValueError(
            f"ShardStrategy(pipeline_parallel_size={pipeline_parallel_size}) does not divide the world size"
            f" {world_size}. Use a pipeline_parallel_size that divides {world_size} (each stage gets"
            f" world size / pipeline_parallel_size ranks)."
        )


def check_context_parallel_world(ranks: int, replicate_size: int, context_parallel_size: int) -> None:
    """``context_parallel_size`` must divide each replica's ``ranks / replicate_size`` ranks."""
    if isinstance(context_parallel_size, bool) or not isinstance(context_parallel_size, int):
        raise ValueError(
            f"ShardStrategy(context_parallel_size={context_parallel_size!r}) must be an integer."
        )
    per_replica = ranks // replicate_size
    if per_replica % context_parallel_size:
        raise ValueError(
            f"ShardStrategy(context_parallel_size={context_parallel_size}) does not divide the {per_replica}"
            " data-parallel ranks of each replica (world size / tensor_parallel_size / pipeline_parallel_size /"
            f" replicate_size). Use a context_parallel_size that divides {per_replica}."
        )


def check_expert_parallel_world(ranks: int, expert_parallel_size: int) -> None:
    """``expert_parallel_size`` must divide the ``ranks`` of the mesh's shard dimension (``shard x cp``)."""
    if isinstance(expert_parallel_size, bool) or not isinstance(expert_parallel_size, int):
        raise ValueError(f"ShardStrategy(expert_parallel_size={expert_parallel_size!r}) must be an integer.")
    if ranks % expert_parallel_size:
        raise ValueError(
            f"ShardStrategy(expert_parallel_size={expert_parallel_size}) does not divide the {ranks} data-parallel"
            " ranks that shard each replica (world size / tensor_parallel_size / pipeline_parallel_size /"
            f" replicate_size, context-parallel ranks included). Use an expert_parallel_size that divides {ranks}."
        )


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


__all__ = [
    "DIMS",
    "EXPERT_DIMS",
    "PIPELINE_DIMS",
    "MeshLayout",
    "check_context_parallel_world",
    "check_expert_parallel_world",
    "check_pipeline_world",
    "check_world",
    "data_parallel_mesh",
    "expert_meshes",
    "pipeline_mesh",
    "tensor_parallel_mesh",
]
