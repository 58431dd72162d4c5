"""ExpertLoadMonitor: how evenly a mixture-of-experts model's routers spread tokens over the experts.

Under ``ShardStrategy(expert_parallel_size=e)`` each experts module records, at every forward, how many rows
each of its local experts received from each rank of its expert-parallel group
(:attr:`lightning_shard.expert_parallel.ExpertShard.received`). Every ``every_n_steps`` training batches this
callback gathers those counts over the group (one small all-gather per experts module, through the strategy's
``all_gather``) and logs, per module, the busiest expert's tokens over the mean (``1.0``: perfectly balanced;
``E``: every token to one expert), and the worst module's as ``moe/max_over_mean``. With ``per_expert=True`` it
also logs each expert's share of the tokens. The last values are in ``self.metrics`` on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_shard.callbacks._common import Runner, check_count, logged_step
from lightning_shard.expert_parallel import expert_shards


class ExpertLoadMonitor(Callback):
    """Log the tokens each expert computed, as a load-balance ratio per experts module.

    Args:
        every_n_steps: gather and log every this many training batches (one all-gather per experts module).
        per_expert: also log ``moe/<module>/expert<i>``, each expert's share of the module's tokens.

    It reads what expert parallelism records; without it (``expert_parallel_size=1``) it warns once and logs
    nothing. In a Lightning Fabric loop, pass it to ``L.Fabric(callbacks=[...])`` and call
    ``fabric.call("on_train_batch_end", trainer=fabric, pl_module=model, outputs=loss, batch=batch, batch_idx=i)``
    at each batch's end.
    """

    def __init__(self, every_n_steps: int = 50, per_expert: bool = False) -> None:
        check_count("ExpertLoadMonitor", "every_n_steps", every_n_steps, 50)
        self.every_n_steps, self.per_expert = every_n_steps, per_expert
        self.metrics: dict[str, float] = {}
        self._batches = 0
        self._warned = False

    @override
    def on_train_batch_end(
        self, trainer: Runner, pl_module: torch.nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        if self._batches % self.every_n_steps:
            return
        shards = {
            name: shard for name, shard in expert_shards(pl_module).items() if shard.received is not None
        }
        if not shards:
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    "ExpertLoadMonitor found no experts split by expert parallelism in"
                    f" {type(pl_module).__name__}: it logs only under ShardStrategy(expert_parallel_size>1)."
                )
            return
        metrics: dict[str, float] = {}
        for name, shard in shards.items():
            assert shard.received is not None
            local = shard.received.sum(dim=0).to(torch.float64)  # rows per local expert, from every source
            counts = trainer.strategy.all_gather(local, group=shard.group).reshape(-1)  # [E], expert order
            mean = float(counts.mean())
            metrics[f"moe/{name}/max_over_mean"] = float(counts.max()) / mean if mean > 0 else 1.0
            if self.per_expert:
                total = float(counts.sum()) or 1.0
                metrics.update(
                    {f"moe/{name}/expert{i}": float(c) / total for i, c in enumerate(counts.tolist())}
                )
        metrics["moe/max_over_mean"] = max(v for k, v in metrics.items() if k.endswith("max_over_mean"))
        self.metrics = metrics
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=logged_step(trainer, self._batches))
