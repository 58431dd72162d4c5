"""ShardStrategy's side of Lightning's checkpoint hooks: the engine writes and reads every kind.

Lightning asks the strategy for the model and optimizer state and hands it the dict to save or the
path to load; here each goes to the engine (sharded DCP directories, one-file checkpoints, DeepSpeed's
directories, async saves), committed atomically by :mod:`lightning_shard.checkpoint`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerStatus
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.checkpoint.storage import Location, Remote, follow_alias, newest_last, resolve
from lightning_shard.config import ShardConfig
from lightning_shard.core.processes import guarded
from lightning_shard.trainer import _compat as trainer_compat
from lightning_shard.trainer._steps import EngineSteps

log = logging.getLogger(__name__)


def _last_on_object_stores(trainer: Any) -> str | None:
    """``ckpt_path="last"`` under ShardStrategy with a ModelCheckpoint on an object store."""
    if not isinstance(trainer.strategy, CheckpointHooks):
        return None
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            directory = resolve(callback.dirpath, "ModelCheckpoint(dirpath)")
            found = newest_last(directory) if isinstance(directory, Remote) else None
            if found is not None:
                return str(found)
    return None


class CheckpointHooks(EngineSteps):
    """Save, load and remove checkpoints through the engine."""

    config: ShardConfig

    @property
    def _full(self) -> bool:
        return self.config.checkpoint == "full"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return self.engine.model_state_dict(self.model, full=self._full)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return self.engine.optimizer_state_dict(self.model, optimizer, full=self._full)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint(), straight into the sharded layout

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "ShardStrategy.save_checkpoint(storage_options=...) is not supported: it writes with DCP."
            )
        if self._timed_out:
            # The ranks no longer agree on anything: writing would hang until the timeout again.
            log.error(
                "ShardStrategy: checkpoint %s NOT written: a collective failed before it (see the error);"
                " resume from the last committed checkpoint.",
                filepath,
            )
            return
        trainer = self._lm.trainer if self.lightning_module is not None else None
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        self._save_checkpoint(checkpoint, filepath, exception=interrupted)
        if interrupted:
            # An exception checkpoint (OnExceptionCheckpoint, SIGTERM): committed before the job goes on
            # to exit, not left to a background thread.
            self.engine.wait_for_checkpoints()

    @guarded
    def _save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, exception: bool) -> None:
        path = self._checkpoint_location(filepath, "save_checkpoint(filepath)")
        assert self.model is not None
        self.engine.save_checkpoint(self.model, self.optimizers, checkpoint, path, exception=exception)

    def _checkpoint_location(self, filepath: Any, argument: str) -> Location:
        """The one checkpoint every rank writes into or reads: rank 0's path (a rank's own name for it, such
        as a per-rank temporary directory, would split the checkpoint). A strategy whose ranks each keep
        their own copy of the checkpoint overrides this (``lightning_shard.ray``)."""
        return resolve(self.broadcast(str(filepath)), argument)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.engine.remove_checkpoint(resolve(filepath, "remove_checkpoint(filepath)"))

    @override
    @guarded
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = follow_alias(self._checkpoint_location(checkpoint_path, "ckpt_path"))
        assert self.model is not None
        if weights_only is None:
            # What the Trainer call was given: Lightning drops it for strategies that restore after set-up.
            trainer = getattr(self.lightning_module, "_trainer", None)
            weights_only = getattr(trainer, trainer_compat.WEIGHTS_ONLY_ATTR, None)
        checkpoint = self.engine.load_checkpoint(self.model, self.optimizers, path, weights_only)
        module = self.lightning_module
        assert module is not None
        if self.config.engine == "fsdp" and not any(isinstance(p, DTensor) for p in module.parameters()):
            # Whole parameters (stages 0-1, no tensor parallelism): the hooks that read the loaded model state
            # (Lightning's WeightAveraging reads its averages back from it) get what DDPStrategy gives them, by
            # the LightningModule's names. A sharded checkpoint keeps that state in its shards, and a one-file one
            # was read by the DDP-wrapped names; either way it is in the module now.
            checkpoint["state_dict"] = module.state_dict()
        return checkpoint


trainer_compat.resolve_last_checkpoint(_last_on_object_stores)
