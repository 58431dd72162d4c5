"""The planner recommends only what ``ShardStrategy`` accepts: every candidate is checked by the strategy's rules.

A candidate configuration (stage, offloads, recompute, ``replicate_size``, ``tensor_parallel_size``)
is refused when ``engines.configure`` refuses its flags (offload rules, DeepSpeed or libaio not
installed, a missing NVMe directory, HSDP below stage 2, TP with DeepSpeed or at stage 1) or when
the engine those flags choose refuses the planned precision at that stage (DeepSpeed: no
``bf16-true``, no ``16-mixed`` at stage 0). The error message is kept as the row's reason, so the
table says why (and what to install) instead of recommending something that fails at start-up.
There is no second copy of those rules here: the planner and the strategy cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lightning_shard.engines import configure, engine_class
from lightning_shard.planner.memory import Breakdown, Config


@dataclass
class StrategyCheck:
    """The flags a plan keeps fixed besides the four it searches, and the verdict on each candidate."""

    engine: str = "auto"
    """``ShardStrategy(engine=...)``: ``"auto"`` lets each candidate's flags choose."""
    nvme_path: str | None = None
    """``ShardStrategy(nvme_path=...)``, for candidates that offload to NVMe."""
    precision: str = "32-true"
    """The Trainer's precision the plan is for; engines refuse some precisions at some stages."""
    _verdicts: dict[Config, str | None] = field(default_factory=dict, repr=False)

    def refusal(self, config: Config) -> str | None:
        """Why the strategy refuses ``config`` (its own ``ValueError`` message), or None if it runs."""
        if config not in self._verdicts:
            self._verdicts[config] = self._check(config)
        return self._verdicts[config]

    def _check(self, config: Config) -> str | None:
        try:
            resolved = configure(**config.strategy_kwargs(self.engine, self.nvme_path))
            engine = engine_class(resolved.engine)
            engine.check_precision(config.stage, engine.precision_class(self.precision))  # type: ignore[arg-type]
        except ValueError as err:
            return str(err)
        return None

    def judge(self, row: Breakdown) -> Breakdown:
        """``row`` with its ``ShardStrategy`` keyword arguments, and the reason it cannot run if any."""
        return replace(
            row,
            unsupported=row.unsupported or self.refusal(row.config),
            strategy_kwargs=row.config.strategy_kwargs(self.engine, self.nvme_path),
        )
