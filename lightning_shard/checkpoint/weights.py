"""Full model weights out of any checkpoint, in one process: ``load_model_weights`` (written as a file by
:func:`~lightning_shard.checkpoint.lightning_format.consolidate`).

``weights_only`` follows ``torch.load``: ``None`` is torch's default (``True``), and only ``False`` lets a
checkpoint's pickles name arbitrary globals (:mod:`._pickles` applies it to DCP's ``.metadata`` and to
DeepSpeed's files, which their libraries unpickle without it).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

import lightning_shard.checkpoint._errors as errors
import lightning_shard.checkpoint._torch_files as torch_files
from lightning_shard.checkpoint._pickles import check_deepspeed_pickles
from lightning_shard.checkpoint._zero_reader import (
    ZeroReader,
    refuse_tensor_parallel,
)
from lightning_shard.checkpoint.layout import (
    DEEPSPEED_EXPERTS,
    DEEPSPEED_TAG,
    META_FILENAME,
    MODEL_KEY,
    is_deepspeed_checkpoint,
    is_sharded_checkpoint,
    metadata_reader,
)
from lightning_shard.checkpoint.staged import downloaded
from lightning_shard.checkpoint.storage import Location, Remote, follow_alias, resolve


def load_model_weights(
    given: str | os.PathLike | Remote, weights_only: bool | None = None
) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint (sharded or DeepSpeed directory, or a file), in this process.

    Needs no process group: DCP reads every shard of the requested keys, DeepSpeed's ``zero_to_fp32``
    every rank's partitions. A file is a Lightning checkpoint (its ``state_dict``) or a plain state dict.
    """
    path = follow_alias(resolve(given, "path"))
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
    if path.is_file():
        checkpoint = torch_files.load(path, weights_only)
        return checkpoint.get(MODEL_KEY, checkpoint)
    if is_deepspeed_checkpoint(path):
        if isinstance(path, Remote):  # DeepSpeed's reader opens local files only
            with downloaded(path, every_rank=False) as local:
                return _deepspeed_weights(local, weights_only)
        return _deepspeed_weights(path, weights_only)
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{str(path)!r} is a directory but not a sharded checkpoint (no .metadata / {META_FILENAME});"
            " it may be a save that never completed."
        )
    reader = metadata_reader(path, weights_only)
    metadata = reader.read_metadata()
    prefix = MODEL_KEY + "."
    keys = [
        key
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    ]
    target = read_dcp_tensors(path, reader, metadata, keys)
    return {key[len(prefix) :]: value for key, value in target.items()}


def read_dcp_tensors(
    path: Location, reader: FileSystemReader, metadata: Metadata, keys: list[str]
) -> dict[str, torch.Tensor]:
    """The whole tensors of ``keys`` (DCP keys, e.g. ``state_dict.layer.weight``) in this process, no process
    group needed: DCP reads only the byte ranges of the keys in its load target, from every shard file."""
    entries = metadata.state_dict_metadata
    target = {key: torch.empty(entries[key].size, dtype=entries[key].properties.dtype) for key in keys}  # type: ignore[union-attr]
    dcp.load(target, checkpoint_id=str(path), storage_reader=reader, no_dist=True)
    return target


def check_deepspeed_checkpoint(path: Path) -> None:
    """Before DeepSpeed reads ``path``: refuse, on every rank and with the fix, a checkpoint the FSDP engine wrote."""
    errors.on_every_rank(path, lambda: _refuse_fsdp_checkpoint(path))


def _refuse_fsdp_checkpoint(path: Path) -> None:
    if is_deepspeed_checkpoint(path) or not path.exists():
        return
    if path.is_file():
        kind = "a one-file checkpoint (ShardStrategy(checkpoint='full'))"
    elif (path / ".metadata").is_file():
        kind = "a sharded DCP checkpoint of the FSDP engine"
    else:
        return  # neither kind: DeepSpeed's own "no checkpoint" error says so
    raise errors.wrong_engine(
        path,
        kind,
        "deepspeed",
        "Resume it with ShardStrategy(engine='fsdp') (any world size, any stage), or start engine='deepspeed'"
        f" from its weights: `lightning-shard consolidate {shlex.quote(str(path))} model.pt --weights-only`, then"
        " model.load_state_dict(torch.load('model.pt')) and fit without ckpt_path.",
    )


def deepspeed_model_states(path: Path, weights_only: bool | None = False) -> dict:
    """Rank 0's ``*mp_rank_00_model_states.pt`` of a DeepSpeed checkpoint: Lightning's entries and, without
    ZeRO (stage 0), the whole module."""
    (states,) = sorted((path / DEEPSPEED_TAG).glob("*mp_rank_00_model_states.pt"))[:1]
    if weights_only is not False:
        check_deepspeed_pickles([states])
    return torch.load(states, map_location="cpu", weights_only=False)


def _deepspeed_weights(path: Path, weights_only: bool | None) -> dict[str, torch.Tensor]:
    refuse_tensor_parallel(path)
    states = deepspeed_model_states(path, weights_only)
    if states.get("param_shapes") is None:  # stage 0: no ZeRO partitions, the module is saved whole
        return {key: value.detach().float().clone() for key, value in states["module"].items()}
    if states.get(DEEPSPEED_EXPERTS):  # expert parallelism: zero_to_fp32 does not know its expert groups
        reader = ZeroReader(path, weights_only)
        return reader.read(list(reader.tensors()))
    if weights_only is not False:  # zero_to_fp32 unpickles every rank's files with weights_only=False
        check_deepspeed_pickles(sorted((path / DEEPSPEED_TAG).glob("*.pt")))
    # DeepSpeed's own reconstruction of fp32 weights from every rank's ZeRO partitions.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # optional: DeepSpeed

    state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_TAG)
    return {key: value.detach().clone() for key, value in state.items()}


def load_full_state_dict(
    module: torch.nn.Module,
    weights: Mapping[str, torch.Tensor],
    path: Path,
    is_rank0: bool,
    hparams: Any = None,
) -> None:
    """Full weights into ``module``, strictly; ZeRO-3 parameters (partitioned by DeepSpeed) one at a time,
    gathered, filled on rank 0 and partitioned again (``deepspeed.zero.GatheredParameters``)."""
    state = module.state_dict(keep_vars=True)
    saved = {k: tuple(v.shape) for k, v in weights.items()}
    wanted = {k: tuple(getattr(t, "ds_shape", t.shape)) for k, t in state.items() if torch.is_tensor(t)}
    errors.check_state(path, saved, wanted, "", "model", strict=True, fix=errors.model_fix(hparams, module))
    if not any(hasattr(t, "ds_tensor") for t in state.values()):
        device = next((t.device for t in state.values() if torch.is_tensor(t)), torch.device("cpu"))
        module.load_state_dict({k: v.to(device) for k, v in weights.items()})
        return
    import deepspeed  # optional: DeepSpeed

    done: set[int] = set()
    for key, tensor in state.items():
        if id(tensor) in done or not torch.is_tensor(tensor):
            continue
        done.add(id(tensor))  # a tied parameter is filled once
        if not hasattr(tensor, "ds_tensor"):  # a buffer: whole on every rank
            with torch.no_grad():
                tensor.copy_(weights[key])
            continue
        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0), torch.no_grad():
            if is_rank0:
                tensor.copy_(weights[key])
