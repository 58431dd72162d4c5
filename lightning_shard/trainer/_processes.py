"""The Trainer door's launcher: Lightning's Trainer script launcher, whose rank 0 reaps the ranks it started."""

from __future__ import annotations

from lightning_shard.core.processes import ReapChildren
from lightning_shard.trainer import _compat as trainer_compat


class TrainerLauncher(ReapChildren, trainer_compat.SubprocessScriptLauncher):  # type: ignore[misc,valid-type]
    """Lightning's Trainer script launcher; rank 0 reaps the ranks it started when it exits."""
