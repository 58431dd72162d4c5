"""Monitors that work with any strategy: throughput and MFU, and the rank that holds the others back."""

from lightning_shard.averaging import EMA
from lightning_shard.callbacks.mfu import MFUMonitor
from lightning_shard.callbacks.straggler import StragglerDetector

__all__ = ["EMA", "MFUMonitor", "StragglerDetector"]
