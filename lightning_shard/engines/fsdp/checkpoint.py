"""The FSDP engine's checkpoints: one file (``checkpoint='full'``) or DCP's sharded directory, written in the
background by the async checkpointer where ``async_checkpoint=True``; read back from either, or from a DeepSpeed
checkpoint (:mod:`lightning_shard.checkpoint.deepspeed_interop`).

The formats and the commit protocol are :mod:`lightning_shard.checkpoint`'s; what is the engine's is which one a
save takes, the entries it adds (each optimizer's state, PowerSGD's: :mod:`.compression`) and that a load waits
for a pending background save first.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_shard import checkpoint as ckpt
from lightning_shard.checkpoint.deepspeed_interop import load_into_fsdp
from lightning_shard.checkpoint.storage import Location, Remote
from lightning_shard.engines.base import Engine, RunContext
from lightning_shard.engines.fsdp import compression


def async_checkpointer(config: Any, run: RunContext) -> ckpt.AsyncCheckpointer | None:
    """``async_checkpoint=True``: background writes on a process group of their own, made here on every rank."""
    if not config.async_checkpoint:
        return None
    return ckpt.AsyncCheckpointer(run.is_global_zero, ckpt.new_checkpoint_group(config.timeout))


def save(
    config: Any,
    run: RunContext,
    writer: ckpt.AsyncCheckpointer | None,
    checkpoint: dict[str, Any],
    path: Location,
    compression_state: compression.CompressionState,
    exception: bool,
) -> None:
    """``checkpoint`` (Lightning's dict, its ``state_dict`` and ``optimizer_states`` the engine's state dicts)
    to ``path``; an exception's save is never linked as the latest (``alias``)."""
    if config.checkpoint == "full":
        if run.is_global_zero:
            ckpt.save_file(checkpoint, path)
        run.barrier()
        return
    state = {ckpt.MODEL_KEY: checkpoint.pop("state_dict")}
    for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[ckpt.optimizer_key(i)] = opt_state
    compression.save_state(state, compression_state, run)
    if writer is not None and not writer.closed:
        writer.save(state, checkpoint, path, run.barrier, alias=not exception)
    else:
        ckpt.save_sharded(path, state, checkpoint, run.is_global_zero, run.barrier)


def load(
    engine: Engine,
    writer: ckpt.AsyncCheckpointer | None,
    model: nn.Module,
    optimizers: list[Optimizer],
    path: Location,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Any of the formats into ``model`` and ``optimizers`` (through ``engine``'s state dicts); Lightning's
    remaining entries returned."""
    if writer is not None:
        writer.wait()
    if not isinstance(path, Remote) and ckpt.is_deepspeed_checkpoint(path):
        return load_into_fsdp(engine, model, optimizers, path, weights_only)
    if path.is_dir():
        return ckpt.load_sharded_into(engine, model, optimizers, path, weights_only)
    return ckpt.load_full_into(engine, model, optimizers, path, weights_only)
