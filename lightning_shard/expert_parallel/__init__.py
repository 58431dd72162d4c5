"""Expert parallelism: each rank of an expert-parallel group holds ``E/ep`` whole experts of every
mixture-of-experts layer, and tokens travel to their experts and back by all-to-all.

- :func:`apply_expert_parallel` splits an unchanged model's experts modules (a Hugging Face model through its
  ``config.base_model_ep_plan``, any module through ``plan=``) and replaces only their forward;
- :func:`dispatch_combine` is that forward's token exchange, for any routing and any expert computation;
- :func:`grouped_linear` is the local experts' products (torch's grouped GEMM where it runs, else a loop).

Nothing here knows about Lightning; the strategy flags build on these.
"""

from lightning_shard.expert_parallel.apply import (
    ROLES,
    apply_expert_parallel,
    expert_modules,
    expert_shards,
    planned_experts,
)
from lightning_shard.expert_parallel.dispatch import ExpertCompute, ExpertShard, all_to_all, dispatch_combine
from lightning_shard.expert_parallel.experts import ExpertLayout
from lightning_shard.expert_parallel.grouped import (
    COMPUTE_MODES,
    ComputeMode,
    grouped_linear,
    grouped_mm_runs,
)

__all__ = [
    "COMPUTE_MODES",
    "ROLES",
    "ComputeMode",
    "ExpertCompute",
    "ExpertLayout",
    "ExpertShard",
    "all_to_all",
    "apply_expert_parallel",
    "dispatch_combine",
    "expert_modules",
    "expert_shards",
    "grouped_linear",
    "grouped_mm_runs",
    "planned_experts",
]
