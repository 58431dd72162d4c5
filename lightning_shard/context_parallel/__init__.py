"""Context parallelism: the sequence of each batch cut over the ranks of a group, attention computed across
them (docs/context_parallel.md). ``ShardStrategy(context_parallel_size=c, context_parallel_method=...)``
builds on these; nothing here knows about Lightning.
"""

from lightning_shard.context_parallel.attention import METHODS, ContextParallel, ContextParallelMethod
from lightning_shard.context_parallel.batch import SplitBatch, chunk_positions, scale_loss, split_batch
from lightning_shard.context_parallel.install import HF_ATTENTION, apply_context_parallel, hf_attention

__all__ = [
    "HF_ATTENTION",
    "METHODS",
    "ContextParallel",
    "ContextParallelMethod",
    "SplitBatch",
    "apply_context_parallel",
    "chunk_positions",
    "hf_attention",
    "scale_loss",
    "split_batch",
]
