"""Every checkpoint the pack writes, as the one dict Lightning's ``load_from_checkpoint`` reads.

Lightning's ``LightningModule.load_from_checkpoint(path)`` wants a ``torch.load``-able file holding
``pytorch-lightning_version``, ``state_dict`` (the full weights) and ``hyper_parameters``.
``checkpoint="full"`` files are such a file already; a sharded checkpoint (DCP shards + ``meta.pt``) and
a DeepSpeed checkpoint (per-rank ZeRO partitions whose model-states file carries Lightning's entries)
are directories. :func:`load_lightning_checkpoint` reads either directory into that dict, in one process
with no process group, and ``consolidate`` writes it as a file.

``load_from_checkpoint(directory)`` itself works through one adapter,
:func:`install_load_from_checkpoint`, run when ``lightning_shard`` is imported: it wraps the loader
Lightning's ``load_from_checkpoint`` calls (``lightning.pytorch.core.saving.pl_load``, a private name).
The wrapper takes only local directories that are one of our two layouts, recognised by their files
(``.metadata`` + ``meta.pt``; ``checkpoint/*mp_rank_00_model_states.pt``), and hands every other path
to Lightning's own loader unchanged. ``weights_only`` and ``map_location`` are passed through.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

import lightning_shard.checkpoint._torch_files as torch_files
from lightning_shard.checkpoint._commit import save_file
from lightning_shard.checkpoint.layout import (
    DEEPSPEED_EXPERTS,
    META_FILENAME,
    MODEL_KEY,
    is_deepspeed_checkpoint,
    is_sharded_checkpoint,
)
from lightning_shard.checkpoint.staged import downloaded
from lightning_shard.checkpoint.storage import Location, Remote, follow_alias, resolve
from lightning_shard.checkpoint.weights import deepspeed_model_states, load_model_weights

log = logging.getLogger(__name__)

VERSION_KEY = "pytorch-lightning_version"
#: What only resuming training needs; left out as ``ModelCheckpoint(save_weights_only=True)`` leaves it
#: out, so ``fit(ckpt_path=...)`` on the result stops with Lightning's "contains only the model" error.
RESUME_ONLY = ("optimizer_states", "lr_schedulers", "callbacks")
#: DeepSpeed's own entries in its model-states file, beside Lightning's (``client_state``).
DEEPSPEED_ENTRIES = (
    DEEPSPEED_EXPERTS,
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "checkpoint_parallel_dimensions",
    "ds_config",
    "ds_version",
)


def is_checkpoint_directory(path: str | os.PathLike | Remote) -> bool:
    """A directory in one of the pack's layouts (sharded DCP, or DeepSpeed's)."""
    return is_sharded_checkpoint(path) or is_deepspeed_checkpoint(path)


def _our_url(path: str) -> Remote | None:
    """A checkpoint in one of our layouts at an object-store URL (an alias object followed), else ``None``."""
    try:
        location = follow_alias(resolve(path, "checkpoint_path"))
    except (ValueError, ImportError):
        return None  # a URL Lightning's own loader reads (http://), or a store whose extra is absent
    return location if isinstance(location, Remote) and is_checkpoint_directory(location) else None


def load_lightning_checkpoint(
    given: str | os.PathLike | Remote, map_location: Any = None, weights_only: bool | None = None
) -> dict[str, Any]:
    """A Lightning checkpoint dict, full weights in ``state_dict``, from any checkpoint the pack writes.

    ``path``: a sharded or DeepSpeed checkpoint directory, or a ``checkpoint="full"`` / consolidated file.
    ``weights_only`` as in ``torch.load`` (``None``: torch's default, ``True``). ``map_location``: a device
    (``"cuda:0"``, ``torch.device``) moves the weights there; anything else leaves them on the CPU.
    """
    path = follow_alias(resolve(given, "path"))
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
    if path.is_file():
        entries = torch_files.load(path, weights_only)
        if not isinstance(entries, dict) or not isinstance(entries.get(MODEL_KEY), dict):
            raise ValueError(
                f"{str(path)!r} is not a Lightning checkpoint (no {MODEL_KEY!r} entry): a plain state dict holds no"
                " hyperparameters. Consolidate the training checkpoint it came from instead:"
                " `lightning-shard consolidate CKPT model.ckpt`."
            )
        weights = entries.pop(MODEL_KEY)
    elif is_deepspeed_checkpoint(path):
        if isinstance(path, Remote):  # DeepSpeed's files are read from local paths: downloaded once
            with downloaded(path, every_rank=False) as local:
                return load_lightning_checkpoint(local, map_location, weights_only)
        states = deepspeed_model_states(path, weights_only)
        entries = {k: v for k, v in states.items() if k not in DEEPSPEED_ENTRIES}
        weights = load_model_weights(path, weights_only)
    elif is_sharded_checkpoint(path):
        entries = torch_files.load(path / META_FILENAME, weights_only)
        weights = load_model_weights(path, weights_only)
    else:
        raise ValueError(
            f"{str(path)!r} is a directory but not a sharded checkpoint (no .metadata / {META_FILENAME}) nor a"
            " DeepSpeed one (no checkpoint/ folder): its save never finished, or it is not a checkpoint."
        )
    if isinstance(map_location, (str, torch.device)):
        weights = {k: v.to(map_location) for k, v in weights.items()}
    checkpoint = {k: v for k, v in entries.items() if k not in RESUME_ONLY}
    checkpoint[MODEL_KEY] = weights
    return checkpoint


ConsolidateFormat = Literal["lightning", "state_dict"]


def consolidate(
    path: str | os.PathLike,
    out: str | os.PathLike,
    format: ConsolidateFormat = "lightning",
    weights_only: bool | None = None,
) -> Location:
    """Write a checkpoint's full model weights as one ``torch.save`` file (``out`` may be an object-store URL).

    ``format="lightning"``: a Lightning checkpoint holding the weights (what ``ModelCheckpoint(
    save_weights_only=True)`` writes): ``LightningModule.load_from_checkpoint``, ``trainer.test(ckpt_path=...)``
    and ``ShardStrategy(init_weights=...)`` read it. ``format="state_dict"``: the plain state dict, for
    ``module.load_state_dict(torch.load(out))`` in code without Lightning.
    """
    if format not in ("lightning", "state_dict"):
        raise ValueError(f"consolidate(format={format!r}) is unknown. Use 'lightning' or 'state_dict'.")
    target = resolve(out, "consolidate(out)")  # a bad URL is refused before anything is read
    if format == "lightning":
        content: Mapping[str, Any] = load_lightning_checkpoint(path, weights_only=weights_only)
    else:
        content = load_model_weights(path, weights_only=weights_only)
    save_file(dict(content), target)
    return target


_ADAPTER_FLAG = "_lightning_shard_adapter"


def install_load_from_checkpoint() -> bool:
    """Let ``LightningModule.load_from_checkpoint`` (and ``LightningDataModule``'s) read our directories.

    Wraps ``lightning.pytorch.core.saving.pl_load``, once. Returns ``False``, changing nothing, when that
    name is gone (another Lightning release): ``load_from_checkpoint`` then reads files only, and
    ``lightning-shard consolidate`` turns a directory into one.
    """
    # Found among the loaded modules, not imported: below the doors nothing loads Trainer code. ``import
    # lightning`` (which ``lightning.fabric`` runs first) has loaded it; a Fabric-only install has none.
    saving = sys.modules.get("lightning.pytorch.core.saving")
    if saving is None:
        return False
    original = getattr(saving, "pl_load", None)
    if not callable(original):
        log.debug("lightning.pytorch.core.saving.pl_load not found: load_from_checkpoint reads files only.")
        return False
    if getattr(original, _ADAPTER_FLAG, False):
        return True

    @functools.wraps(original)
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if isinstance(path_or_url, (str, os.PathLike)) and "://" in str(path_or_url):
            remote = _our_url(str(path_or_url))
            if remote is not None:
                return load_lightning_checkpoint(remote, map_location, weights_only)
        elif isinstance(path_or_url, (str, os.PathLike)):
            if is_checkpoint_directory(path_or_url):
                return load_lightning_checkpoint(path_or_url, map_location, weights_only)
            if Path(path_or_url).is_file():
                # Our one-file checkpoints' hyper-parameters (dataclasses, enums) load as under ShardStrategy.
                with torch_files.allowing(path_or_url, weights_only):
                    return original(path_or_url, map_location=map_location, weights_only=weights_only)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    setattr(pl_load, _ADAPTER_FLAG, True)
    saving.pl_load = pl_load  # type: ignore[attr-defined]
    return True
