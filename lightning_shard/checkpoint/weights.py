"""Full model weights out of any checkpoint, in one process: ``load_model_weights`` and ``consolidate``."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import lightning_shard.checkpoint._errors as errors
from lightning_shard.checkpoint._commit import save_file
from lightning_shard.checkpoint.layout import (
    DEEPSPEED_TAG,
    META_FILENAME,
    MODEL_KEY,
    is_deepspeed_checkpoint,
    is_sharded_checkpoint,
    read_metadata,
)


def load_model_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint (sharded directory or single file), in this process.

    Needs no process group: DCP reads every shard of the requested keys.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
    if path.is_file():
        checkpoint = torch.load(path, weights_only=False, map_location="cpu")
        return checkpoint.get(MODEL_KEY, checkpoint)
    if is_deepspeed_checkpoint(path):
        return _deepspeed_weights(path)
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{str(path)!r} is a directory but not a sharded checkpoint (no .metadata / {META_FILENAME});"
            " it may be a save that never completed."
        )
    prefix = MODEL_KEY + "."
    target = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in read_metadata(path).state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    return {key[len(prefix) :]: value for key, value in target.items()}


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
        f" from its weights: `lightning-shard consolidate {shlex.quote(str(path))} model.pt`, then"
        " model.load_state_dict(torch.load('model.pt')) and fit without ckpt_path.",
    )


def deepspeed_model_states(path: Path) -> dict:
    """Rank 0's ``*mp_rank_00_model_states.pt`` of a DeepSpeed checkpoint: Lightning's entries and, without
    ZeRO (stage 0), the whole module."""
    (states,) = sorted((path / DEEPSPEED_TAG).glob("*mp_rank_00_model_states.pt"))[:1]
    return torch.load(states, map_location="cpu", weights_only=False)


def _deepspeed_weights(path: Path) -> dict[str, torch.Tensor]:
    states = deepspeed_model_states(path)
    if states.get("param_shapes") is None:  # stage 0: no ZeRO partitions, the module is saved whole
        return {key: value.detach().float().clone() for key, value in states["module"].items()}
    # DeepSpeed's own reconstruction of fp32 weights from every rank's ZeRO partitions.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_TAG)
    return {key: value.detach().clone() for key, value in state.items()}


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the model weights of a checkpoint as one plain ``torch.save``'d state dict."""
    weights = load_model_weights(path)
    out = Path(out)
    save_file(weights, out)
    return out
