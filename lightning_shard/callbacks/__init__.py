"""Monitors that work with any strategy: throughput and MFU, the rank that holds the others back, FLOPs and a
peak for Lightning's own ThroughputMonitor, a summary of the run at its end, and the experts' load balance
under expert parallelism."""

from lightning_shard.averaging import EMA
from lightning_shard.callbacks.experts import ExpertLoadMonitor
from lightning_shard.callbacks.mfu import MFUMonitor
from lightning_shard.callbacks.straggler import StragglerDetector
from lightning_shard.callbacks.summary import RunSummary
from lightning_shard.callbacks.throughput import ThroughputMonitorFlops, feed_throughput_monitor

__all__ = [
    "EMA",
    "ExpertLoadMonitor",
    "MFUMonitor",
    "RunSummary",
    "StragglerDetector",
    "ThroughputMonitorFlops",
    "feed_throughput_monitor",
]
