"""How stages 0-1 all-reduce gradients under the FSDP engine: DDP's hook from ``gradient_compression`` or the
precision's ``reduce_dtype``, and the state of PowerSGD and 1-bit Adam in sharded checkpoints.

The hooks and their state are :mod:`lightning_shard.compression`'s; this module chooses one for the engine's
DDP wrap (:mod:`lightning_shard.engines._ddp`), hands 1-bit Adam its optimizer, and moves the methods' state in
and out of a checkpoint. At stages
2-3 FSDP2 reduce-scatters without a hook.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_shard import _ddp, compression
from lightning_shard.engines._ddp import wrap
from lightning_shard.engines.base import RunContext
from lightning_shard.onebit import OneBitHook

#: ``(hook, PowerSGDState)`` under ``gradient_compression='powersgd'``, ``(OneBitHook, group)`` under
#: ``'onebit_adam'`` (their state is checkpointed), else None.
CompressionState = tuple[Any, Any] | None


def wrap_ddp(module: nn.Module, config: Any, precision: Any, mesh: Any) -> tuple[nn.Module, CompressionState]:
    """``DistributedDataParallel`` over ``mesh``'s group with the user's options and the all-reduce hook that
    ``gradient_compression`` or ``reduce_dtype`` asks for; PowerSGD's hook and state, to be checkpointed."""
    device = mesh.device_type
    device_ids = None if device == "cpu" else [torch.device(device, torch.accelerator.current_device_index())]
    options = dict(config.ddp_kwargs)
    reduce_dtype = precision.reduce_dtype
    method = config.gradient_compression
    named = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(reduce_dtype)  # type: ignore[arg-type]
    if method is None and named is not None:
        # ShardPrecision(reduce_dtype=...) at stages 0-1 is the same cast-and-all-reduce hook.
        _ddp.check_comm_hook(options, reduce_dtype)
        method = {"method": named}
    elif method is not None and reduce_dtype is not None and named != method["method"]:
        raise ValueError(
            f"ShardStrategy(gradient_compression={method['method']!r}) and ShardPrecision("
            f"reduce_dtype={reduce_dtype}) both set how gradients are all-reduced at stages 0-1. Keep one."
        )
    state: CompressionState = None
    if method is not None:
        hook, hook_state = compression.hook_and_state(method, mesh.get_group(), module)
        options["ddp_comm_hook"], options["ddp_comm_state"] = hook, hook_state
        state = (hook, hook_state) if method["method"] in ("powersgd", "onebit_adam") else None
    return wrap(module, mesh.get_group(), device_ids, options), state


def attach_optimizers(state: CompressionState, optimizers: list[Any]) -> None:
    """``gradient_compression='onebit_adam'``: the one Adam / AdamW whose steps 1-bit Adam takes over after its
    warm-up (:meth:`lightning_shard.onebit.OneBitHook.attach`); nothing for the other methods."""
    if state is None or not isinstance(state[0], OneBitHook):
        return
    if len(optimizers) != 1:
        raise ValueError(
            f"ShardStrategy(gradient_compression='onebit_adam') compresses one optimizer's momentum; configure_optimizers"
            f" returned {len(optimizers)}. Return one torch.optim.Adam or AdamW over every parameter."
        )
    hook, group = state
    hook.attach(optimizers[0], group)


def save_state(saved: dict[str, Any], state: CompressionState, run: RunContext) -> None:
    """PowerSGD's or 1-bit Adam's state into a sharded checkpoint's ``saved`` entries (nothing without them)."""
    if state is not None:
        hook, powersgd = state
        saved[compression.STATE_KEY] = compression.state_dict(hook, powersgd, run.global_rank, run.world_size)


def load_target(state: CompressionState, metadata: Any, run: RunContext) -> dict[str, torch.Tensor] | None:
    """Where a sharded checkpoint's compression state is read to (None: nothing to read)."""
    if state is None:
        return None
    return compression.load_target(metadata, run.global_rank)


def load_state(state: CompressionState, saved: dict[str, torch.Tensor], run: RunContext) -> None:
    assert state is not None
    hook, powersgd = state
    compression.load_state_dict(hook, powersgd, saved, run.global_rank, run.world_size)
