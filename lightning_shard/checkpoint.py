"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP), committed atomically.

Layout of a sharded checkpoint ``<name>.ckpt/`` (a directory):

* DCP shards and ``.metadata`` for ``{"state_dict": model, "optimizer_0": ..., ...}``, keyed by
  parameter name, so a checkpoint written by N ranks at any stage loads on M ranks at any stage;
* ``meta.pt``: everything else Lightning saves (loops, callbacks, LR schedulers, hyperparameters).

Every rank writes into ``<name>.ckpt.tmp``; rank 0 renames it to ``<name>.ckpt`` only after all
ranks have written their shards and the metadata, so a crash mid-save never leaves a
half-written checkpoint under a final name.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_shard import _checkpoint_errors as errors
from lightning_shard._checkpoint_errors import CheckpointLoadError

META_FILENAME = "meta.pt"
MODEL_KEY = "state_dict"
TMP_SUFFIX = ".tmp"


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / META_FILENAME).is_file()


def read_metadata(path: str | os.PathLike) -> Metadata:
    return FileSystemReader(str(path)).read_metadata()


def save_sharded(
    path: Path, state: dict[str, Any], meta: dict[str, Any], is_rank0: bool, barrier: Callable[[], None]
) -> None:
    """Write ``state`` as DCP shards plus ``meta`` under ``path``, visible only once complete."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    if is_rank0:
        remove(tmp)
        tmp.mkdir(parents=True)
    barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    if is_rank0:
        torch.save(meta, tmp / META_FILENAME)
        commit(tmp, path)
    barrier()


def commit(tmp: Path, path: Path) -> None:
    """Move a fully written checkpoint to its final name, replacing an older one of that name."""
    if path.exists() or path.is_symlink():
        old = path.with_name(path.name + ".old")
        remove(old)
        os.replace(path, old)
        os.replace(tmp, path)
        remove(old)
    else:
        os.replace(tmp, path)


def save_file(checkpoint: dict[str, Any], path: Path) -> None:
    """``torch.save`` to a temporary file, then rename: a reader never sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        shutil.rmtree(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)


def load_sharded(path: Path, target: dict[str, Any]) -> None:
    """Fill ``target`` (model / optimizer state dicts of this rank's layout) in place from ``path``."""
    dcp.load(target, checkpoint_id=str(path))


def read_meta(path: Path) -> dict[str, Any]:
    return torch.load(path / META_FILENAME, weights_only=False, map_location="cpu")


def load_sharded_into(engine: Any, model: Any, optimizers: list[Any], path: Path) -> dict[str, Any]:
    """Load a sharded checkpoint into this rank's (any stage, any world size) layout; return Lightning's meta.

    Every check that can fail runs before DCP reads a byte, and every rank raises if any rank fails
    (:func:`lightning_shard._checkpoint_errors.on_every_rank`).
    """
    meta, target = errors.on_every_rank(path, lambda: _sharded_target(engine, model, optimizers, path))

    def apply() -> None:
        try:
            load_sharded(path, target)
        except (Exception, errors.CheckpointException) as err:
            raise CheckpointLoadError(
                f"Reading checkpoint {str(path)!r} failed: {errors.summary(err)}. Its files passed the checks"
                " made before reading; check that every rank can read the checkpoint directory, or resume"
                " from another checkpoint."
            ) from err
        engine.load_model_state_dict(model, target[MODEL_KEY], full=False)
        for i, optimizer in enumerate(optimizers):
            if optimizer_key(i) in target:
                engine.load_optimizer_state_dict(model, optimizer, target[optimizer_key(i)], full=False)

    errors.on_every_rank(path, apply)
    return meta


def _sharded_target(
    engine: Any, model: Any, optimizers: list[Any], path: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's meta and this rank's empty load target, once the checkpoint is known to fit it."""
    if is_deepspeed_checkpoint(path):
        raise errors.wrong_engine(
            path,
            "a DeepSpeed checkpoint (per-rank ZeRO partitions under checkpoint/)",
            "fsdp",
            "Resume it with ShardStrategy(engine='deepspeed') on the world size it was saved on, or turn it into"
            f" plain weights with `lightning-shard consolidate {shlex.quote(str(path))} model.pt`, load those with"
            " model.load_state_dict(torch.load('model.pt')) and fit without ckpt_path.",
        )
    if not is_sharded_checkpoint(path):
        missing = [name for name in (".metadata", META_FILENAME) if not (path / name).is_file()]
        raise CheckpointLoadError(
            f"{str(path)!r} is not a complete sharded checkpoint (missing {' and '.join(missing)}): its save"
            " never finished, or it is not a checkpoint. Resume from a checkpoint whose save finished."
        )
    try:
        metadata = read_metadata(path)
    except Exception as err:  # noqa: BLE001  (any unreadable .metadata is the same fault to the user)
        raise errors.unreadable(path, ".metadata", err) from err
    errors.check_files(path, metadata)
    try:
        meta = read_meta(path)
    except Exception as err:  # noqa: BLE001
        raise errors.unreadable(path, META_FILENAME, err) from err
    target: dict[str, Any] = {MODEL_KEY: engine.model_state_dict(model, full=False)}
    for i, optimizer in enumerate(optimizers):
        key = optimizer_key(i)
        if any(k.startswith(key + ".") for k in metadata.state_dict_metadata):
            target[key] = engine.optimizer_load_target(model, optimizer, metadata, key)
    saved, wanted = errors.saved_shapes(metadata), errors.target_shapes(target)
    fix = errors.model_fix(meta.get("hyper_parameters"), model)
    errors.check_state(path, saved, wanted, MODEL_KEY + ".", "model", strict=True, fix=fix)
    for key in sorted(target.keys() - {MODEL_KEY}):
        errors.check_state(path, saved, wanted, key + ".", f"optimizer ({key})", False, errors.OPTIMIZER_FIX)
    return meta, target


def load_full_into(engine: Any, model: Any, optimizers: list[Any], path: Path) -> dict[str, Any]:
    """Load a one-file checkpoint (``checkpoint="full"``) into this rank's layout; return it."""
    checkpoint = errors.on_every_rank(path, lambda: _read_full(engine, model, path))

    def apply() -> None:
        engine.load_model_state_dict(model, checkpoint[MODEL_KEY], full=True)
        for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", []), strict=False):
            engine.load_optimizer_state_dict(model, optimizer, state, full=True)

    errors.on_every_rank(path, apply)
    return checkpoint


def _read_full(engine: Any, model: Any, path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(
            f"Checkpoint {str(path)!r} does not exist. Check the path given as ckpt_path, or pass"
            " ckpt_path='last' to resume from the newest checkpoint ModelCheckpoint saved."
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001  (a cut-short zip fails in several ways, all the same fault)
        raise errors.unreadable(path, "the file", err) from err
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(MODEL_KEY), dict):
        raise CheckpointLoadError(
            f"{str(path)!r} is not a Lightning training checkpoint (no {MODEL_KEY!r} entry): a plain state dict,"
            " such as `lightning-shard consolidate` writes, holds weights only. Load it with"
            " model.load_state_dict(torch.load(path)) before fit and fit without ckpt_path."
        )
    saved = {k: tuple(v.size()) if torch.is_tensor(v) else None for k, v in checkpoint[MODEL_KEY].items()}
    wanted = errors.target_shapes(engine.model_state_dict(model, full=False))
    fix = errors.model_fix(checkpoint.get("hyper_parameters"), model)
    errors.check_state(path, saved, wanted, "", "model", strict=True, fix=fix)
    return checkpoint


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


DEEPSPEED_TAG = "checkpoint"


def is_deepspeed_checkpoint(path: str | os.PathLike) -> bool:
    """A directory written by the DeepSpeed engine (``DeepSpeedEngine.save_checkpoint``)."""
    tag_dir = Path(path) / DEEPSPEED_TAG
    return tag_dir.is_dir() and any(tag_dir.glob("*mp_rank_00_model_states.pt"))


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


def _deepspeed_weights(path: Path) -> dict[str, torch.Tensor]:
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


def remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
