"""Selective activation checkpointing for any LightningModule, as a callback or a ShardStrategy flag.

Activation checkpointing trades compute for memory: a checkpointed block keeps only its inputs
from the forward pass and re-runs its forward during backward to get the activations its gradient
needs. Three ways to choose what to re-run, per block:

* ``policy="full"``: keep nothing inside the block, re-run all of it (most memory saved, one extra
  forward of the block, ~+1/3 of its step FLOPs).
* ``policy="selective"``: keep the outputs of compute-heavy ops (matmuls, attention kernels,
  collectives: :data:`DEFAULT_SAVE_OPS`) and re-run only the cheap elementwise ops around them
  (layer norms, activations, dropout, residual adds), which hold most of the bytes per FLOP.
* ``every_n=k``: the policy on every k-th block only (blocks 0, k, 2k, ...); ``memory_budget=f``:
  a per-block mix of none / selective / full chosen to fit ``f`` x the no-checkpoint activation bytes
  of the blocks with the least recompute (see :mod:`.budget`).

Blocks are patched in place (their ``forward`` is replaced on the instance), so parameter names,
``state_dict`` keys and the module classes that sharding looks for are unchanged.

Modules, each importing only those above it:

==============  ===========================================================================
``modes``       ``BlockMode`` and the ``ModeChooser`` interface (shared types)
``policy``      the selective policy: which op outputs to keep (``DEFAULT_SAVE_OPS``)
``flops``       the tally of FLOPs re-run in backward (``count_recompute_flops``)
``wrap``        ``CheckpointedForward``: one block's forward under ``torch.utils.checkpoint``
``measure``     ``measure(module, batch)``: activation bytes and FLOPs of one step
``budget``      ``memory_budget``: a per-block mix of modes, measured on the first step
``cache``       no key/value cache in training forwards of a checkpointed Hugging Face model
``blocks``      which blocks to patch; already-checkpointed checks; undoing it
``apply``       ``ActivationCheckpointingConfig`` and ``apply_activation_checkpointing`` (torch alone)
``callback``    ``ActivationCheckpointing``: the configuration as a Lightning callback (loaded on first use)
==============  ===========================================================================

Example::

    trainer = L.Trainer(callbacks=[ActivationCheckpointing(policy="selective")])
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_shard.activation_checkpointing.apply import (
    ActivationCheckpointingConfig,
    Policy,
    apply_activation_checkpointing,
)
from lightning_shard.activation_checkpointing.blocks import (
    checkpointed_blocks,
    is_activation_checkpointed,
    remove_activation_checkpointing,
)
from lightning_shard.activation_checkpointing.flops import count_recompute_flops
from lightning_shard.activation_checkpointing.measure import Measurement, measure
from lightning_shard.activation_checkpointing.policy import DEFAULT_SAVE_OPS
from lightning_shard.activation_checkpointing.wrap import RecomputeMismatchError

__all__ = [
    "DEFAULT_SAVE_OPS",
    "ActivationCheckpointing",
    "ActivationCheckpointingConfig",
    "Measurement",
    "Policy",
    "RecomputeMismatchError",
    "apply_activation_checkpointing",
    "checkpointed_blocks",
    "count_recompute_flops",
    "is_activation_checkpointed",
    "measure",
    "remove_activation_checkpointing",
]


def __getattr__(name: str) -> Any:
    # The callback is the Trainer's: imported on first use, so the core (which applies the configuration)
    # loads no Trainer code through this package.
    if name == "ActivationCheckpointing":
        return importlib.import_module(
            "lightning_shard.activation_checkpointing.callback"
        ).ActivationCheckpointing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
