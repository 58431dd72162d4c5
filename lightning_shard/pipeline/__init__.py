"""Pipeline parallelism: the model cut into stages, one per rank of the mesh's ``pp`` dimension, run by
torch's schedules (:mod:`torch.distributed.pipelining`). See docs/pipeline.md.

``ShardStrategy(pipeline_parallel_size=P, pipeline_schedule=..., microbatches=M)`` builds on these;
nothing here knows about Lightning.
"""

from lightning_shard.pipeline.runner import StageRunner
from lightning_shard.pipeline.schedules import (
    MICROBATCHES_PER_STAGE,
    PipelineScheduleName,
    check_pipeline_flags,
    schedule_class,
    stages_of_rank,
)
from lightning_shard.pipeline.split import StagePlan, balanced_starts, keep_stage, plan_stages

__all__ = [
    "MICROBATCHES_PER_STAGE",
    "PipelineScheduleName",
    "StagePlan",
    "StageRunner",
    "balanced_starts",
    "check_pipeline_flags",
    "keep_stage",
    "plan_stages",
    "schedule_class",
    "stages_of_rank",
]
