"""``ActivationCheckpointing``: the configuration as a Lightning callback, for any strategy.

The callback patches the blocks right after the module's ``configure_model`` and before the strategy
wraps or shards it; ``ShardStrategy(activation_checkpointing=...)`` takes the same object and calls
:func:`~lightning_shard.activation_checkpointing.apply.apply_activation_checkpointing` itself.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from lightning_shard.activation_checkpointing.apply import (
    ActivationCheckpointingConfig,
    applied_by,
    apply_activation_checkpointing,
)


class ActivationCheckpointing(ActivationCheckpointingConfig, Callback):
    """Recompute the model's repeated blocks in backward instead of keeping their activations.

    Works with any strategy: the blocks are patched right after ``configure_model`` and before the
    strategy wraps or shards the model. The same object is the configuration that
    ``ShardStrategy(activation_checkpointing=...)`` takes (:class:`ActivationCheckpointingConfig`).

    Args: those of :class:`ActivationCheckpointingConfig` (``policy``, ``blocks``, ``every_n``, ``memory_budget``,
    ``save_ops``, ``save_matmuls``).
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Only training runs backward; validation and prediction run under no_grad, where a
        # checkpointed block is a plain call anyway.
        if stage != "fit" or applied_by(pl_module, self):
            return
        _apply_after_configure_model(pl_module, self)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A strategy that never calls configure_model skipped the deferred apply. Patching now, after the
        # strategy's setup, is still correct: wrapper hooks (DDP, FSDP2) run around the patched forward.
        _restore_configure_model(pl_module)
        if not applied_by(pl_module, self):
            apply_activation_checkpointing(pl_module, self)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _restore_configure_model(pl_module)


def _apply_after_configure_model(
    pl_module: pl.LightningModule, config: ActivationCheckpointingConfig
) -> None:
    """Make ``pl_module.configure_model`` run the user's hook and then patch the blocks, for this one fit.

    Why not patch in the callback's ``setup``: Lightning calls callbacks' ``setup`` before the
    module's own ``setup`` and ``configure_model``, where many models create their layers, and the
    next hook after ``configure_model`` is ``strategy.setup``, which already wraps or shards. So the
    patching runs at the end of the ``configure_model`` call. Lightning calls ``configure_model``
    only when it looks overridden (its code differs from ``LightningModule.configure_model``), which a
    function set on the instance always does, so this also covers modules built in ``__init__``.
    The attribute lives only until that call (or teardown): a closure on the module must not outlive
    the fit, where it would stop the module from pickling.
    """
    _restore_configure_model(pl_module)
    user_hook = pl_module.__dict__.get("configure_model")

    def configure_model_then_checkpoint() -> None:
        _restore_configure_model(pl_module)
        pl_module.configure_model()
        if not applied_by(pl_module, config):
            apply_activation_checkpointing(pl_module, config)

    configure_model_then_checkpoint._ac_user_hook = (user_hook,)  # type: ignore[attr-defined]
    pl_module.configure_model = configure_model_then_checkpoint  # type: ignore[method-assign]


def _restore_configure_model(pl_module: nn.Module) -> None:
    patched = pl_module.__dict__.get("configure_model")
    if patched is None or not hasattr(patched, "_ac_user_hook"):
        return
    (user_hook,) = patched._ac_user_hook
    if user_hook is not None:
        pl_module.configure_model = user_hook  # type: ignore[method-assign]
    else:
        del pl_module.configure_model
