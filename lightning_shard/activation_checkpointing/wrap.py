"""Running one block under ``torch.utils.checkpoint`` by replacing its ``forward`` on the instance.

Why patch ``block.forward`` instead of wrapping the block in a new module (as
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` does): a wrapper module adds a
level to every parameter name (``blocks.0._checkpoint_wrapped_module.attn.qkv.weight``), so
checkpoints stop matching, and ``fully_shard`` on the block class no longer finds the blocks.
``nn.Module.__call__`` looks ``forward`` up on the instance first, so an instance attribute
reroutes the call while the module tree, its class, its hooks (FSDP's included, which keep
running around the checkpointed region) and its parameter names stay exactly as they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint, noop_context_fn

from lightning_shard.activation_checkpointing.flops import current_tally
from lightning_shard.activation_checkpointing.modes import BlockMode, ModeChooser
from lightning_shard.activation_checkpointing.policy import (
    SaveMatmuls,
    op_names,
    resolve_save_ops,
    selective_contexts,
)

ContextFn = Callable[[], tuple[AbstractContextManager, AbstractContextManager]]


class RecomputeMismatchError(CheckpointError):
    """A checkpointed block computed something different when it was re-run in backward."""


class CheckpointedForward:
    """Stands in for ``block.forward`` (an instance attribute): runs the block's own forward under checkpoint.

    Also the marker that a block is checkpointed: ``isinstance(block.__dict__.get("forward"), CheckpointedForward)``.
    A class with plain attributes rather than a closure, so a wrapped model still deep-copies and pickles.
    """

    def __init__(
        self,
        block: nn.Module,
        name: str,
        owner: object,
        mode: BlockMode | ModeChooser,
        save_ops: frozenset[torch._ops.OpOverload],
        save_matmuls: SaveMatmuls,
    ) -> None:
        self.block = block
        self.name = name
        self.owner = owner  # the ActivationCheckpointing config that applied this wrapper
        # Fixed per block, or a chooser (the memory_budget planner) that decides on the first training call.
        self.mode = mode
        self.save_ops = save_ops
        self.save_matmuls = save_matmuls
        # A forward already patched on the instance (another library's hook) keeps running inside ours.
        self.inner: Callable[..., Any] | None = block.__dict__.get("forward")

    def __getstate__(self) -> dict[str, Any]:
        # Op overloads do not pickle; their names do (torch.save(model) of a checkpointed model).
        state = dict(self.__dict__)
        state["save_ops"] = op_names(self.save_ops)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["save_ops"] = resolve_save_ops(state["save_ops"], "save_ops")
        self.__dict__.update(state)

    def run_original(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        # type(block) may be FSDP2's dynamic subclass; it inherits the user's forward unchanged.
        return type(self.block).forward(self.block, *args, **kwargs)

    def current_mode(self, args: tuple, kwargs: dict) -> BlockMode:
        if isinstance(self.mode, str):
            return self.mode
        return self.mode.mode_for(self, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Without grad nothing is saved for backward, so there is nothing to trade (validation, inference).
        if not torch.is_grad_enabled():
            return self.run_original(*args, **kwargs)
        return self.run_mode(self.current_mode(args, kwargs), args, kwargs)

    def run_mode(self, mode: BlockMode, args: tuple, kwargs: dict) -> Any:
        if mode == "none":
            return self.run_original(*args, **kwargs)
        n_args, keys = len(args), tuple(kwargs)
        state = {"forward_done": False}

        def fn(*flat: Any) -> Any:
            call_args, call_kwargs = flat[:n_args], dict(zip(keys, flat[n_args:], strict=True))
            if state["forward_done"]:  # the recompute, inside backward
                return self.run_original(*call_args, **call_kwargs)
            state["forward_done"] = True
            with _annotate_recompute_errors(self):
                return self.run_original(*call_args, **call_kwargs)

        # Keyword arguments travel positionally: checkpoint reserves some keyword names (context_fn,
        # debug, ...) and infers the device whose RNG it replays (dropout) from positional tensors only.
        return checkpoint(
            fn,
            *args,
            *kwargs.values(),
            use_reentrant=False,
            context_fn=self._context_fn(mode),
            preserve_rng_state=True,
        )

    def _context_fn(self, mode: BlockMode) -> ContextFn:
        tally = current_tally()
        if mode == "selective":
            save_ops, save_matmuls = self.save_ops, self.save_matmuls

            def base() -> tuple[AbstractContextManager, AbstractContextManager]:
                return selective_contexts(save_ops, save_matmuls)
        else:
            base = noop_context_fn
        has_buffers = next(self.block.buffers(), None) is not None
        if tally is None and not has_buffers:
            return base
        block = self.block

        def wrapped() -> tuple[AbstractContextManager, AbstractContextManager]:
            forward_ctx, recompute_ctx = base()
            # Outermost first: buffers are copied before any mode is pushed, and the tally sits under the
            # selective mode on the mode stack, so it only sees ops that really re-run.
            outer = [buffers_kept(block)] if has_buffers else []
            counting = [tally.counting()] if tally is not None else []
            return forward_ctx, _entered_in_order(*outer, *counting, recompute_ctx)

        return wrapped


@contextlib.contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Give ``module``'s buffers back the values they had on entry, where the body changed them.

    The recompute is a second training-mode forward of the block: a BatchNorm in it would update its
    running statistics (and ``num_batches_tracked``) twice per step. Only changed buffers are written
    back: the others (an eval-mode BatchNorm's statistics, which its backward reads) are left untouched,
    not even their version counters move.
    """
    kept = [(buffer, buffer.clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                if not torch.equal(buffer, value):
                    buffer.copy_(value)


@contextlib.contextmanager
def _entered_in_order(*contexts: AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for ctx in contexts:
            stack.enter_context(ctx)
        yield


@contextlib.contextmanager
def _annotate_recompute_errors(wrapper: CheckpointedForward) -> Iterator[None]:
    """Re-raise any failure of this block's recompute with the block's name and the likely fix.

    PyTorch reports a diverging recompute from deep inside backward ("... not found in storage",
    "Recomputed values ... have different metadata"), naming neither the block nor the cause.
    The recompute is triggered when backward unpacks a tensor saved by the checkpointed forward, so
    wrapping the checkpoint's own unpack hook (the innermost saved-tensor hooks while the forward
    runs) sees every such failure, including the checks PyTorch runs after the recompute returns.
    """
    # A private accessor (torch >= 2.0); without it the block still trains, only with PyTorch's plain error.
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    top = top_hooks(False) if top_hooks is not None else None
    if top is None:
        yield
        return
    pack, unpack = top

    def unpack_with_context(holder: Any) -> Any:
        try:
            return unpack(holder)
        except torch.OutOfMemoryError:
            raise  # running out of memory in the recompute is not a divergence
        except RecomputeMismatchError:
            raise
        except RuntimeError as err:
            raise RecomputeMismatchError(recompute_error_message(wrapper, err)) from err

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack_with_context):
        yield


def recompute_error_message(wrapper: CheckpointedForward, err: BaseException) -> str:
    block = f"block {wrapper.name!r} ({type(wrapper.block).__name__})"
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "has been mutated" in str(err):
        return (
            f"Activation checkpointing: a tensor that the selective policy saved in {block} was modified in place"
            f" after the forward pass ({detail}). Make that op out-of-place, or leave its producer out of"
            " ActivationCheckpointing(save_ops=[...]) (or use policy='full')."
        )
    return (
        f"Activation checkpointing: {block} did not compute the same thing when its forward was re-run during"
        f" backward ({detail}). A checkpointed block must be a pure function of its inputs and parameters; this"
        " one most likely reads or changes state outside itself, e.g. a key/value cache that grows on every call."
        " Fix: turn the cache off for training (Hugging Face: model.config.use_cache = False, or pass"
        " use_cache=False), or leave this block class out via ActivationCheckpointing(blocks=[...])."
    )


def wrapper_of(module: nn.Module) -> CheckpointedForward | None:
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, CheckpointedForward) else None


def unwrap(module: nn.Module) -> bool:
    """Give a block its own forward back; False when it was not wrapped."""
    wrapper = wrapper_of(module)
    if wrapper is None:
        return False
    if wrapper.inner is not None:
        module.forward = wrapper.inner  # type: ignore[method-assign]
    else:
        del module.forward
    return True
