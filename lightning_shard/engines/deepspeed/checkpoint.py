"""The DeepSpeed engine's checkpoints: DeepSpeed's own per-rank directory, committed like every other checkpoint
of the package (``NAME.tmp``, then rename; on an object store each rank's files staged locally and uploaded, then
the marker: :mod:`~lightning_shard.checkpoint.staged`), with what the engine's features add beside DeepSpeed's
files (the expert blocks, :mod:`.experts`; a whole-matrix optimizer's owned state, :mod:`.whole_matrix`).

Read back by DeepSpeed's engine during ``fit`` (on another world size through DeepSpeed's universal checkpoint,
:mod:`lightning_shard.checkpoint.deepspeed_interop`), or as full weights outside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_shard import checkpoint as ckpt
from lightning_shard.checkpoint.deepspeed_interop import load_into_deepspeed
from lightning_shard.checkpoint.lightning_format import DEEPSPEED_ENTRIES
from lightning_shard.checkpoint.staged import downloaded, write_staged
from lightning_shard.checkpoint.storage import Location, Remote
from lightning_shard.checkpoint.weights import deepspeed_model_states
from lightning_shard.engines.base import RunContext
from lightning_shard.engines.deepspeed import experts, tensor_parallel, whole_matrix
from lightning_shard.engines.deepspeed.async_save import DeepSpeedAsyncWriter

TAG = ckpt.DEEPSPEED_TAG


def async_writer(config: Any, run: RunContext) -> DeepSpeedAsyncWriter | None:
    """``async_checkpoint=True``: DeepSpeed's files written in the background (:mod:`.async_save`), with a gloo group
    of their own for the commit's agreement, made at the first save."""
    if not config.async_checkpoint:
        return None
    on_host = torch.device(run.device).type == "cpu"
    return DeepSpeedAsyncWriter(run.is_global_zero, on_host, config.timeout)


def save(
    model: nn.Module,
    checkpoint: dict[str, Any],
    path: Location,
    run: RunContext,
    split: bool,
    writer: DeepSpeedAsyncWriter | None = None,
) -> None:
    """DeepSpeed's per-rank checkpoint of ``model`` (DeepSpeed's engine) with Lightning's entries as its client
    state; ``split``: the expert blocks are in param groups of their own (:class:`.experts.ExpertGroups`).

    DeepSpeed never links one checkpoint to another: an exception's save is the same. With ``writer`` (and
    DeepSpeed's engine: in fit) its files are written in the background and committed when complete; to an object
    store, synchronously."""
    checkpoint.pop("state_dict", None)  # DeepSpeed writes model and optimizer state itself
    checkpoint.pop("optimizer_states", None)

    def write(tmp: Path) -> None:
        if split:
            experts.save(model, tmp, checkpoint, run)
        else:
            model.save_checkpoint(str(tmp), tag=TAG, client_state=checkpoint)  # type: ignore[operator]
        if whole_matrix.whole_matrix_step(model) is not None:
            whole_matrix.save(model, tmp)

    if isinstance(path, Remote):  # DeepSpeed writes local files only
        if writer is not None:
            writer.wait()  # one checkpoint in flight at a time, the background one first
        write_staged(path, write, run.is_global_zero, run.barrier)
    elif writer is not None and not writer.closed and hasattr(model, "checkpoint_engine"):
        writer.save(model, write, path, run.barrier)
    else:
        ckpt.write_committed(path, write, run.is_global_zero, run.barrier)


def load(
    model: nn.Module,
    path: Location,
    weights_only: bool | None,
    run: RunContext,
    mixed: bool,
    split: bool,
    writer: DeepSpeedAsyncWriter | None = None,
) -> dict[str, Any]:
    """Resume ``model`` (DeepSpeed's engine, or the bare module outside ``fit``) from ``path``; Lightning's
    entries returned. ``mixed``: the precision keeps low-precision weights; ``split`` as in :func:`save`; a save
    ``writer`` still has in flight is committed first."""
    if writer is not None:
        writer.wait()
    if isinstance(path, Remote):  # DeepSpeed reads local files only
        with downloaded(path) as local:
            return _load_local(model, local, weights_only, run, mixed, split)
    return _load_local(model, path, weights_only, run, mixed, split)


def _load_local(
    model: nn.Module, path: Path, weights_only: bool | None, run: RunContext, mixed: bool, split: bool
) -> dict[str, Any]:
    ckpt.check_deepspeed_checkpoint(path)
    if weights_only is not False:
        # DeepSpeed unpickles its files with weights_only=False: their globals are checked first.
        ckpt.check_deepspeed_files(path)
    if not hasattr(model, "load_checkpoint"):
        return _load_weights_only(model, path, run)
    experts.check_resume(path, model, run.world_size)
    tp = run.dims.tp  # AutoTP: ZeRO partitions over the data-parallel ranks, one mp_rank file per slice
    tensor_parallel.check_resume(path, tp, run.world_size // tp)
    if split:
        return {k: v for k, v in experts.load(model, path).items() if k not in DEEPSPEED_ENTRIES}
    # Saved on another world size: through DeepSpeed's universal checkpoint (or its weights alone).
    moved = load_into_deepspeed(model, path, run.world_size // tp, run.is_global_zero, run.barrier, mixed)
    if moved is None:
        load_path, client_state = model.load_checkpoint(  # type: ignore[operator]
            str(path), tag=TAG, load_lr_scheduler_states=False
        )
        if load_path is None:
            raise ValueError(f"DeepSpeed found no checkpoint under {str(path)!r} (tag {TAG!r}).")
        # What the caller saved beside the model: DeepSpeed's own entries are read by DeepSpeed alone.
        moved = {key: value for key, value in client_state.items() if key not in DEEPSPEED_ENTRIES}
    if whole_matrix.whole_matrix_step(model) is not None:  # the owned entries, moved to this run's owners
        whole_matrix.load(model, path)
    return moved


def _load_weights_only(model: nn.Module, path: Path, run: RunContext) -> dict[str, Any]:
    """Outside fit there is no DeepSpeed engine: load the full fp32 weights (evaluation needs no more).

    Parameters an earlier fit partitioned (ZeRO-3) are filled through DeepSpeed's gather: a plain
    ``load_state_dict`` would copy into their empty local storage and change nothing."""
    weights = ckpt.load_model_weights(path, weights_only=False)  # its files were checked above
    weights = experts.local_weights(model, weights)  # expert parallelism: this rank's blocks
    state = deepspeed_model_states(path)
    ckpt.load_full_state_dict(model, weights, path, run.is_global_zero, state.get("hyper_parameters"))
    # Lightning's entries (loops, callbacks, hyperparameters) sit beside DeepSpeed's in this file;
    # Lightning reads only its own, so only DeepSpeed's bulky ones (weights, optimizer) are dropped.
    return {k: v for k, v in state.items() if k not in ("module", "optimizer")}
