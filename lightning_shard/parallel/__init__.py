"""The parallel dimensions and their meshes (:mod:`.dims`), tensor-parallel plans, clipping across meshes.

See docs/parallelism.md. ``ShardStrategy(replicate_size=R, tensor_parallel_size=T,
tensor_parallel_plan=...)`` builds on these; nothing here knows about Lightning.
"""

from lightning_shard.parallel.clip import clip_grad_norm_, grad_norm
from lightning_shard.parallel.dims import MeshLayout, ParallelDims, ParallelMeshes, check_world
from lightning_shard.parallel.plan import (
    STYLES,
    apply_tensor_parallel,
    carried_plan,
    check_plan_flag,
    resolve_plan,
)

__all__ = [
    "STYLES",
    "MeshLayout",
    "ParallelDims",
    "ParallelMeshes",
    "apply_tensor_parallel",
    "carried_plan",
    "check_plan_flag",
    "check_world",
    "clip_grad_norm_",
    "grad_norm",
    "resolve_plan",
]
