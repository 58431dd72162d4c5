"""The parallel dimensions of a job, owned in one place: :class:`ParallelDims` (sizes by name, their checks,
each rank's coordinates, the sampler's rank) and :class:`ParallelMeshes` (the device meshes, built once).

A world of ``W`` ranks is laid out as ``W = pp x replicate x shard x cp x tp`` in row-major order, so the
tensor-parallel groups are consecutive ranks (one node's fast links), the context-parallel and shard groups
come next, the replicate groups span the rest (across nodes) and each pipeline stage is one such block of
ranks (stages talk point to point, the lightest traffic, so they may sit across the slowest links).

The ``cp`` ranks of a group hold the same model and read the same batch, so FSDP2 / DDP treat them as
data-parallel ranks: the mesh's ``shard`` dimension (or its one ``dp`` dimension) spans ``shard x cp``, as
torchtitan shards over its flattened ``dp_shard_cp``. Expert parallelism (``ep`` ranks each hold ``E/ep``
whole experts) is carved from that same dimension, as torchtitan carves its ``ep`` from ``dp_shard x cp``:
consecutive runs of ``ep`` ranks along it are the expert-parallel groups, and the ranks left (``edp``, times
``replicate``) shard or replicate each expert block.

Every mesh is a view of one root mesh over the world (``DeviceMesh._unflatten``, where torch has it), so FSDP2
and DTensor see one root for the dense and the expert parameters alike:

==================  ===================================================================================
view                dimensions
==================  ===================================================================================
dense               ``("dp",)`` when only ``shard`` is above 1; else ``([pp,] replicate, shard, tp)``
expert              ``(pp, replicate, edp, ep, tp)``: ``edp x ep = shard x cp`` (``ep > 1`` only)
context             ``(cp_outer, cp, cp_tp)``, of which this rank's ``cp`` group (``cp > 1`` only)
==================  ===================================================================================

Fault tolerance's replica groups are separate worlds (each its own ``torchrun``); they enter the layout only
through the sampler: every rank of every group reads its own part, as one HSDP job's ranks would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import init_device_mesh

from lightning_shard import _compat

DIMS = ("replicate", "shard", "tp")
PIPELINE_DIMS = ("pp", *DIMS)
#: The expert view's dimensions: ``edp`` x ``ep`` spans the dense view's shard dimension.
EXPERT_DIMS = ("pp", "replicate", "edp", "ep", "tp")
CONTEXT_DIMS = ("cp_outer", "cp", "cp_tp")


def strategy_flag(name: str, value: Any) -> str:
    return f"ShardStrategy({name}={value})"


@dataclass(frozen=True)
class ParallelDims:
    """How a world of ranks splits: ``pp x replicate x shard x cp x tp``, with ``ep`` inside ``shard x cp``
    and fault tolerance's ``replica_groups`` beside the world."""

    replicate: int
    shard: int
    """Data-parallel ranks of one replica that read different batches (the mesh's shard dim is ``shard x cp``)."""
    tp: int
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """Ranks of one expert-parallel group, inside the mesh's shard dimension (``shard x cp``)."""
    replica_groups: int = 1
    """Fault tolerance's replica groups (separate worlds of this layout each): the sampler counts them."""
    replica_id: int = 0

    @classmethod
    def for_world(
        cls,
        world_size: int,
        replicate_size: int = 1,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        replica_groups: int = 1,
        replica_id: int = 0,
        flag: Callable[[str, int], str] = strategy_flag,
        world: str = "the world size",
        error: type[ValueError] = ValueError,
    ) -> ParallelDims:
        """The layout of ``world_size`` ranks, or an ``error`` naming the flag that does not divide it (the
        only check of what divides what: the strategy's, the planner's and the CLI's, ``flag`` spelling a
        flag as their user typed it)."""
        if isinstance(world_size, bool) or int(world_size) != world_size or world_size < 1:
            raise error(f"{world} is {world_size!r}: a layout needs at least one rank (a whole number >= 1).")
        check_pipeline_world(world_size, pipeline_parallel_size, flag, world, error)
        stage_world = world_size // pipeline_parallel_size
        check_world(stage_world, replicate_size, tensor_parallel_size, flag, world, error)
        check_context_parallel_world(
            stage_world // tensor_parallel_size, replicate_size, context_parallel_size, flag, error
        )
        shard = stage_world // (replicate_size * tensor_parallel_size * context_parallel_size)
        check_expert_parallel_world(shard * context_parallel_size, expert_parallel_size, flag, error)
        return cls(
            replicate_size,
            shard,
            tensor_parallel_size,
            pipeline_parallel_size,
            context_parallel_size,
            expert_parallel_size,
            replica_groups,
            replica_id,
        )

    @classmethod
    def for_flags(cls, flags: Any, world_size: int) -> ParallelDims:
        """The layout the strategy's flags (a ``ShardConfig``: each ``*_size`` flag, ``fault_tolerance``'s replica
        groups) ask of ``world_size`` ranks: :meth:`for_world`, with its refusals."""
        ft = flags.fault_tolerance
        return cls.for_world(
            world_size,
            replicate_size=flags.replicate_size,
            tensor_parallel_size=flags.tensor_parallel_size,
            pipeline_parallel_size=flags.pipeline_parallel_size,
            context_parallel_size=flags.context_parallel_size,
            expert_parallel_size=flags.expert_parallel_size,
            replica_groups=1 if ft is None else ft.replica_groups,
            replica_id=0 if ft is None else ft.replica_id,
        )

    # --- sizes by name ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.pp * self.replicate * self.shard * self.cp * self.tp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: ``replicate x shard``."""
        return self.replicate * self.shard

    @property
    def edp(self) -> int:
        """Ranks that shard (or replicate) one expert block inside a replica: ``shard x cp / ep``."""
        return self.shard * self.cp // self.ep

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.replicate > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def ft_enabled(self) -> bool:
        return self.replica_groups > 1

    @property
    def multi_dimensional(self) -> bool:
        """Whether the dense view has more than one dimension (else it is one ``dp`` dimension)."""
        return self.replicate > 1 or self.tp > 1 or self.pp > 1

    @property
    def model_split(self) -> bool:
        """Whether the model's parameters are split over more than its data-parallel ranks (tensor-parallel
        slices, pipeline stages or expert-parallel blocks): no rank holds the whole model."""
        return self.tp > 1 or self.pp > 1 or self.ep > 1

    @property
    def global_clip(self) -> bool:
        """Whether a gradient norm must be reduced over more than the data-parallel mesh (parameters split
        over tensor-parallel, pipeline or expert-parallel ranks)."""
        return self.replicate > 1 or self.model_split

    # --- each rank's place -----------------------------------------------------------------------

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits on every dimension (``pp replicate shard cp tp``, and ``edp ep`` inside
        ``shard x cp``): pure arithmetic, the same as the meshes' ``get_local_rank``."""
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        rest, shard = divmod(rest, self.shard)
        pp, replicate = divmod(rest, self.replicate)
        edp, ep = divmod(shard * self.cp + cp, self.ep)
        return {"pp": pp, "replicate": replicate, "shard": shard, "cp": cp, "tp": tp, "edp": edp, "ep": ep}

    def data_parallel_rank(self, global_rank: int) -> int:
        """Which batch slice ``global_rank`` reads: the ranks of one tensor-parallel or context-parallel
        group, and the stages of one pipeline, read the same."""
        return (global_rank // (self.tp * self.cp)) % self.data_parallel_size

    def sampler(self, global_rank: int) -> dict[str, int]:
        """``DistributedSampler``'s ``num_replicas`` and ``rank`` for ``global_rank``: every rank of every
        replica group reads its own part, as one HSDP job of all the groups would."""
        size, rank = self.data_parallel_size, self.data_parallel_rank(global_rank)
        return {"num_replicas": size * self.replica_groups, "rank": self.replica_id * size + rank}

    # --- meshes ----------------------------------------------------------------------------------

    def build(self, device_type: str) -> ParallelMeshes:
        """Every mesh of this layout (a collective: every rank calls it), as views of one root."""
        shard = self.shard * self.cp  # context-parallel ranks shard (and reduce gradients) with the rest
        if self.pp > 1:
            dense: tuple[tuple[int, ...], tuple[str, ...]] = (
                (self.pp, self.replicate, shard, self.tp),
                PIPELINE_DIMS,
            )
        elif self.multi_dimensional:
            dense = ((self.replicate, shard, self.tp), DIMS)
        else:
            dense = ((self.world_size,), ("dp",))
        views = {"dense": dense}
        if self.ep > 1:
            views["expert"] = ((self.pp, self.replicate, self.edp, self.ep, self.tp), EXPERT_DIMS)
        if self.cp > 1:
            views["context"] = ((self.world_size // (self.cp * self.tp), self.cp, self.tp), CONTEXT_DIMS)
        built = _views(device_type, self.world_size, views)
        context = built.get("context")
        return ParallelMeshes(
            self, built["dense"], built.get("expert"), None if context is None else context["cp"]
        )


def _views(
    device_type: str, world_size: int, views: dict[str, tuple[tuple[int, ...], tuple[str, ...]]]
) -> dict[str, Any]:
    """One root mesh over the world and each view unflattened from it; a mesh per view where torch has no
    ``DeviceMesh._unflatten`` (before 2.9)."""
    if len(views) == 1 and len(views["dense"][0]) == 1:  # one data-parallel dimension: the root itself
        return {"dense": init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))}
    root = init_device_mesh(device_type, (world_size,), mesh_dim_names=("world",))
    built = {name: _compat.unflatten_mesh(root, sizes, names) for name, (sizes, names) in views.items()}
    if any(view is None for view in built.values()):
        return {name: init_device_mesh(device_type, s, mesh_dim_names=n) for name, (s, n) in views.items()}
    return built


@dataclass(frozen=True)
class ParallelMeshes:
    """The meshes of one world, by name: what every set-up step asks for instead of slicing its own."""

    dims: ParallelDims
    dense: Any
    """``("dp",)``, ``(replicate, shard, tp)`` or ``(pp, replicate, shard, tp)``: what DTensor parameters of
    the dense layers live on."""
    expert: Any = None
    """``(pp, replicate, edp, ep, tp)`` (``None``: expert parallelism off)."""
    context: Any = None
    """This rank's 1-D context-parallel group (``None``: context parallelism off)."""

    def _has(self, name: str) -> bool:
        return name in (self.dense.mesh_dim_names or ())

    @property
    def data_parallel(self) -> Any:
        """The mesh FSDP2 / DDP run on (within one pipeline stage): ``dp``, ``shard``, or ``(replicate,
        shard)`` (HSDP)."""
        if not self._has("tp"):
            return self.dense
        return self.dense["replicate", "shard"] if self.dims.replicate > 1 else self.dense["shard"]

    @property
    def tensor_parallel(self) -> Any:
        """The tensor-parallel sub-mesh, or ``None`` when tensor parallelism is off."""
        return self.dense["tp"] if self.dims.tp > 1 else None

    @property
    def pipeline(self) -> Any:
        """The pipeline sub-mesh (one rank per stage, the stages' point-to-point group), or ``None``."""
        return self.dense["pp"] if self._has("pp") else None

    @property
    def expert_parallel(self) -> Any:
        """The experts' DTensor dimension (``ep``), or ``None``."""
        return None if self.expert is None else self.expert["ep"]

    @property
    def expert_data_parallel(self) -> Any:
        """The mesh FSDP2 shards (or replicates) each expert block over: ``edp``, or ``(replicate, edp)``
        (HSDP); ``None`` without expert parallelism."""
        if self.expert is None:
            return None
        return self.expert["replicate", "edp"] if self.dims.replicate > 1 else self.expert["edp"]

    @property
    def pipeline_stage(self) -> int | None:
        """This rank's place on the ``pp`` dimension (``None`` without pipeline stages)."""
        pipeline = self.pipeline
        return None if pipeline is None else pipeline.get_local_rank()


def divisors(n: int) -> str:
    """The sizes that divide ``n``, for a message: ``"1, 2, 4 or 8"``."""
    found = [str(d) for d in range(1, n + 1) if n % d == 0]
    return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} or {found[-1]}"


def check_pipeline_world(
    world_size: int,
    pipeline_parallel_size: int,
    flag: Callable[[str, int], str] = strategy_flag,
    world: str = "the world size",
    error: type[ValueError] = ValueError,
) -> None:
    if world_size % pipeline_parallel_size:
        raise error(
            f"{flag('pipeline_parallel_size', pipeline_parallel_size)} does not divide {world} {world_size}."
            f" Use a pipeline_parallel_size that divides {world_size} ({divisors(world_size)}: each stage gets"
            f" world size / pipeline_parallel_size ranks)."
        )


def check_context_parallel_world(
    ranks: int,
    replicate_size: int,
    context_parallel_size: int,
    flag: Callable[[str, int], str] = strategy_flag,
    error: type[ValueError] = ValueError,
) -> None:
    """``context_parallel_size`` must divide each replica's ``ranks / replicate_size`` ranks."""
    if isinstance(context_parallel_size, bool) or not isinstance(context_parallel_size, int):
        raise error(f"{flag('context_parallel_size', repr(context_parallel_size))} must be an integer.")  # type: ignore[arg-type]
    per_replica = ranks // replicate_size
    if per_replica % context_parallel_size:
        raise error(
            f"{flag('context_parallel_size', context_parallel_size)} does not divide the {per_replica}"
            " data-parallel ranks of each replica (world size / tensor_parallel_size / pipeline_parallel_size /"
            f" replicate_size). Use a context_parallel_size that divides {per_replica} ({divisors(per_replica)})."
        )


def check_expert_parallel_world(
    ranks: int,
    expert_parallel_size: int,
    flag: Callable[[str, int], str] = strategy_flag,
    error: type[ValueError] = ValueError,
) -> None:
    """``expert_parallel_size`` must divide the ``ranks`` of the mesh's shard dimension (``shard x cp``)."""
    if isinstance(expert_parallel_size, bool) or not isinstance(expert_parallel_size, int):
        raise error(f"{flag('expert_parallel_size', repr(expert_parallel_size))} must be an integer.")  # type: ignore[arg-type]
    if ranks % expert_parallel_size:
        raise error(
            f"{flag('expert_parallel_size', expert_parallel_size)} does not divide the {ranks} data-parallel"
            " ranks that shard each replica (world size / tensor_parallel_size / pipeline_parallel_size /"
            f" replicate_size, context-parallel ranks included). Use an expert_parallel_size that divides {ranks}"
            f" ({divisors(ranks)})."
        )


def check_world(
    world_size: int,
    replicate_size: int,
    tensor_parallel_size: int,
    flag: Callable[[str, int], str] = strategy_flag,
    world: str = "the world size",
    error: type[ValueError] = ValueError,
) -> None:
    """Both sizes must divide the world: ``W = replicate_size x shard x tensor_parallel_size``.

    ``flag`` spells a flag as the caller's user typed it (the strategy's, the planner's, the CLI's).
    """
    if world_size % tensor_parallel_size:
        raise error(
            f"{flag('tensor_parallel_size', tensor_parallel_size)} does not divide {world} {world_size}."
            f" Use a tensor_parallel_size that divides {world_size} ({divisors(world_size)}), e.g. the number of"
            " devices of one node or a divisor of it."
        )
    if (world_size // tensor_parallel_size) % replicate_size:
        rest = world_size // tensor_parallel_size
        raise error(
            f"{flag('replicate_size', replicate_size)} does not divide the {rest} data-parallel ranks"
            f" ({world} {world_size} / tensor_parallel_size {tensor_parallel_size}). Use a replicate_size"
            f" that divides {rest} ({divisors(rest)}), typically the number of nodes."
        )


#: The name this layout had before it owned the meshes.
MeshLayout = ParallelDims

__all__ = [
    "CONTEXT_DIMS",
    "DIMS",
    "EXPERT_DIMS",
    "PIPELINE_DIMS",
    "MeshLayout",
    "ParallelDims",
    "ParallelMeshes",
    "check_context_parallel_world",
    "check_expert_parallel_world",
    "check_pipeline_world",
    "check_world",
]
