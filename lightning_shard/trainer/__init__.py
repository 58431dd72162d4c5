"""The Trainer front door: :class:`ShardStrategy`, a thin adapter from Lightning's Trainer hooks to the core
(:mod:`lightning_shard.core`) and the engines."""

from lightning_shard.trainer.strategy import ShardStrategy

__all__ = ["ShardStrategy"]
