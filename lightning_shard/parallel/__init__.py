"""HSDP and tensor parallelism: the device mesh, tensor-parallel plans, clipping across meshes.

See docs/parallelism.md. ``ShardStrategy(replicate_size=R, tensor_parallel_size=T,
tensor_parallel_plan=...)`` builds on these; nothing here knows about Lightning.
"""

from lightning_shard.parallel.clip import clip_grad_norm_, grad_norm
from lightning_shard.parallel.mesh import MeshLayout, check_world, data_parallel_mesh, tensor_parallel_mesh
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
    "apply_tensor_parallel",
    "carried_plan",
    "check_plan_flag",
    "check_world",
    "clip_grad_norm_",
    "data_parallel_mesh",
    "grad_norm",
    "resolve_plan",
    "tensor_parallel_mesh",
]
