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

import shlex
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import lightning_shard.checkpoint._errors as errors
import lightning_shard.checkpoint._torch_files as torch_files
from lightning_shard.checkpoint._commit import write_committed
from lightning_shard.checkpoint._errors import CheckpointLoadError
from lightning_shard.checkpoint.layout import (
    META_FILENAME,
    MODEL_KEY,
    is_deepspeed_checkpoint,
    is_sharded_checkpoint,
    metadata_reader,
    optimizer_key,
    read_metadata,
)
from lightning_shard.checkpoint.storage import Location, storage_writer
from lightning_shard.compression import STATE_KEY as COMMUNICATION_KEY


def save_sharded(
    path: Location, state: dict[str, Any], meta: dict[str, Any], is_rank0: bool, barrier: Callable[[], None]
) -> None:
    """Write ``state`` as DCP shards plus ``meta`` under ``path``, visible only once complete."""

    def write(tmp: Location) -> None:
        dcp.save(state, checkpoint_id=str(tmp), storage_writer=storage_writer(tmp))
        if is_rank0:
            torch_files.save(meta, tmp / META_FILENAME)

    write_committed(path, write, is_rank0, barrier)


def load_sharded(path: Location, target: dict[str, Any], weights_only: bool | None = None) -> None:
    """Fill ``target`` (model / optimizer state dicts of this rank's layout) in place from ``path``."""
    dcp.load(target, checkpoint_id=str(path), storage_reader=metadata_reader(path, weights_only))


def read_meta(path: Location, weights_only: bool | None = None) -> dict[str, Any]:
    return torch_files.load(path / META_FILENAME, weights_only)


def load_sharded_into(
    engine: Any, model: Any, optimizers: list[Any], path: Location, weights_only: bool | None = None
) -> dict[str, Any]:
    """Load a sharded checkpoint into this rank's (any stage, any world size) layout; return Lightning's meta.

    Every check that can fail runs before DCP reads a byte, and every rank raises if any rank fails
    (:func:`lightning_shard._checkpoint_errors.on_every_rank`).
    """
    stages = _every_stage_shapes(engine, model)
    meta, target = errors.on_every_rank(
        path, lambda: _sharded_target(engine, model, optimizers, path, weights_only, stages)
    )

    def apply() -> None:
        try:
            load_sharded(path, target, weights_only)
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
        if COMMUNICATION_KEY in target:
            engine.load_communication_state(target[COMMUNICATION_KEY])

    errors.on_every_rank(path, apply)
    return meta


def _every_stage_shapes(engine: Any, model: Any) -> errors.Shapes | None:
    """With pipeline stages, the model's keys and shapes on every stage together (``None`` without).

    Each rank holds one stage, so a rank's own keys are only part of the checkpoint's; the strict check
    against keys the model lacks runs on every stage's keys, gathered here, outside the checks that must
    not enter a collective."""
    if getattr(engine.config, "pipeline_parallel_size", 1) <= 1:
        return None
    shapes = errors.target_shapes({MODEL_KEY: engine.model_state_dict(model, full=False)})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, shapes)
    return {key: shape for part in gathered for key, shape in part.items()}


def _sharded_target(
    engine: Any,
    model: Any,
    optimizers: list[Any],
    path: Location,
    weights_only: bool | None,
    stages: errors.Shapes | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's meta and this rank's empty load target, once the checkpoint is known to fit it
    (the model's keys: those of every pipeline stage, ``stages``, where given)."""
    if is_deepspeed_checkpoint(path):
        raise errors.wrong_engine(
            path,
            "a DeepSpeed checkpoint (per-rank ZeRO partitions under checkpoint/)",
            "fsdp",
            "Resume it with ShardStrategy(engine='deepspeed') on the world size it was saved on, or turn it into"
            f" plain weights with `lightning-shard consolidate {shlex.quote(str(path))} model.pt --weights-only`,"
            " load those with model.load_state_dict(torch.load('model.pt')) and fit without ckpt_path.",
        )
    if not is_sharded_checkpoint(path):
        missing = [name for name in (".metadata", META_FILENAME) if not (path / name).is_file()]
        raise CheckpointLoadError(
            f"{str(path)!r} is not a complete sharded checkpoint (missing {' and '.join(missing)}): its save"
            " never finished, or it is not a checkpoint. Resume from a checkpoint whose save finished."
        )
    try:
        metadata = read_metadata(path, weights_only)
    except Exception as err:  # noqa: BLE001  (any unreadable .metadata is the same fault to the user)
        raise errors.unreadable(path, ".metadata", err) from err
    errors.check_files(path, metadata)
    try:
        meta = read_meta(path, weights_only)
    except Exception as err:  # noqa: BLE001
        raise errors.unreadable(path, META_FILENAME, err) from err
    target: dict[str, Any] = {MODEL_KEY: engine.model_state_dict(model, full=False)}
    for i, optimizer in enumerate(optimizers):
        key = optimizer_key(i)
        if any(k.startswith(key + ".") for k in metadata.state_dict_metadata):
            target[key] = engine.optimizer_load_target(model, optimizer, metadata, key)
    saved, wanted = errors.saved_shapes(metadata), errors.target_shapes(target)
    fix = errors.model_fix(meta.get("hyper_parameters"), model)
    errors.check_state(path, saved, wanted, MODEL_KEY + ".", "model", strict=stages is None, fix=fix)
    if stages is not None:
        errors.check_state(path, saved, stages, MODEL_KEY + ".", "model", strict=True, fix=fix)
    for key in sorted(target.keys() - {MODEL_KEY}):
        errors.check_state(path, saved, wanted, key + ".", f"optimizer ({key})", False, errors.OPTIMIZER_FIX)
    # Gradient compression's state (PowerSGD): read where the run has some and the checkpoint holds it.
    communication = getattr(engine, "communication_load_target", lambda metadata: None)(metadata)
    if communication is not None:
        target[COMMUNICATION_KEY] = communication
    return meta, target


def load_full_into(
    engine: Any, model: Any, optimizers: list[Any], path: Location, weights_only: bool | None = None
) -> dict[str, Any]:
    """Load a one-file checkpoint (``checkpoint="full"``) into this rank's layout; return it."""
    checkpoint = errors.on_every_rank(path, lambda: _read_full(engine, model, path, weights_only))

    def apply() -> None:
        engine.load_model_state_dict(model, checkpoint[MODEL_KEY], full=True)
        for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", []), strict=False):
            engine.load_optimizer_state_dict(model, optimizer, state, full=True)

    errors.on_every_rank(path, apply)
    return checkpoint


def _read_full(engine: Any, model: Any, path: Location, weights_only: bool | None) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(
            f"Checkpoint {str(path)!r} does not exist. Check the path given as ckpt_path, or pass"
            " ckpt_path='last' to resume from the newest checkpoint ModelCheckpoint saved."
        )
    try:
        checkpoint = torch_files.load(path, weights_only)
    except Exception as err:  # noqa: BLE001  (a cut-short zip fails in several ways, all the same fault)
        raise errors.unreadable(path, "the file", err) from err
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(MODEL_KEY), dict):
        raise CheckpointLoadError(
            f"{str(path)!r} is not a Lightning training checkpoint (no {MODEL_KEY!r} entry): a plain state dict,"
            " such as `lightning-shard consolidate --weights-only` writes, holds weights only. Load it with"
            " model.load_state_dict(torch.load(path)) before fit and fit without ckpt_path."
        )
    saved = {k: tuple(v.size()) if torch.is_tensor(v) else None for k, v in checkpoint[MODEL_KEY].items()}
    wanted = errors.target_shapes(engine.model_state_dict(model, full=False))
    fix = errors.model_fix(checkpoint.get("hyper_parameters"), model)
    errors.check_state(path, saved, wanted, "", "model", strict=True, fix=fix)
    return checkpoint
