"""``ShardStrategy(compile=...)``: ``torch.compile`` on each repeated block, inside the sharding hooks.

The order is torchtitan's: tensor parallelism splits the layers, activation checkpointing wraps each
block, then each block's forward is compiled (inside the checkpoint: :func:`compile_blocks`), and only
then does ``fully_shard`` register FSDP2's hooks on the block (or ``deepspeed.initialize`` DeepSpeed's). The
hooks run in ``nn.Module.__call__``, around ``forward``: compiling ``forward`` (an instance attribute, as
activation checkpointing does it; see :mod:`.activation_checkpointing.wrap`) keeps them outside the compiled
graph, keeps parameter names and the module tree unchanged (checkpoints still match), and lets every block of
one class share one graph: their parameters are graph inputs. DeepSpeed's ZeRO-3 hooks every submodule, not
only the blocks; there each block is made a ZeRO-3 "leaf" (its parameters gathered by its own hook, none on
its layers), so nothing inside the compiled graph gathers or releases a parameter.

Recompiles are counted from dynamo's frame counter around each block call (:func:`recompiles`): one
graph per block class and grad mode is compiled on the first step, and a recompile after it is a bug (a guard on something that changes each
step); the strategy reports the count (``ShardStrategy.recompiles``) and warns about any at the end of
``fit``.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters

from lightning_shard._compat import dynamo_skips_for_dispatch_mode
from lightning_shard._modules import detect_block_classes, find_blocks
from lightning_shard.activation_checkpointing.wrap import CheckpointedForward

log = logging.getLogger(__name__)

#: ``torch.compile`` keyword arguments ``compile={...}`` may carry (the model is the block).
COMPILE_KWARGS = tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")


def check_compile(value: Any) -> dict[str, Any] | None:
    """``compile=`` as ``torch.compile`` keyword arguments (``True``: defaults; ``False``/``None``: off)."""
    if value is None or value is False:
        return None
    if value is True:
        kwargs: dict[str, Any] = {}
    elif isinstance(value, dict) and all(isinstance(k, str) for k in value):
        unknown = sorted(set(value) - set(COMPILE_KWARGS))
        if unknown:
            raise ValueError(
                f"ShardStrategy(compile={value!r}) has {unknown}, which torch.compile does not take. Use"
                f" keys of {list(COMPILE_KWARGS)}, e.g. compile={{'mode': 'max-autotune-no-cudagraphs'}}."
            )
        kwargs = dict(value)
    else:
        raise ValueError(
            f"ShardStrategy(compile={value!r}) must be True, False or a dict of torch.compile keyword"
            " arguments, e.g. compile=True or compile={'fullgraph': True}."
        )
    return kwargs


def blocks_to_compile(module: nn.Module, shard_modules: Any, flag: dict[str, Any]) -> list[nn.Module]:
    """The repeated blocks ``compile=`` compiles: the classes ``shard_modules`` names, or the detected ones."""
    classes = shard_modules or detect_block_classes(module)
    blocks = find_blocks(module, classes) if classes else []
    if not blocks:
        raise ValueError(
            f"ShardStrategy(compile={flag or True}) compiles each repeated block, and"
            f" {type(module).__name__} has none (no nn.ModuleList / nn.Sequential of two or more modules of"
            " one class). Name the block classes with shard_modules=[...], or compile=False."
        )
    return blocks


class CompiledForward:
    """Stands in for ``block.forward``: the block's forward as it was (checkpointed or not), compiled.

    The compiled callable is made on first use and not pickled (a deep copy of the model compiles again).
    """

    def __init__(self, inner: Any, kwargs: dict[str, Any]) -> None:
        self.inner = inner
        self.kwargs = kwargs
        self._compiled: Any = None
        self._seen: set[bool] = set()  # grad modes this block has run in (each compiles its own graph once)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global _recompiles
        if dynamo_skips_for_dispatch_mode():
            # Under a FLOP counter or another user dispatch mode dynamo would not compile, and would
            # never compile this forward after: run it eagerly, as dynamo would, without asking.
            return self.inner(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(self.inner, **self.kwargs)
        regime, before = torch.is_grad_enabled(), counters["frames"]["total"]
        out = self._compiled(*args, **kwargs)
        if regime in self._seen:
            _recompiles += counters["frames"]["total"] - before
        self._seen.add(regime)
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_compiled": None, "_seen": set()}


def is_compiled(block: nn.Module) -> bool:
    forward = block.__dict__.get("forward")
    return isinstance(forward, CompiledForward) or isinstance(
        getattr(forward, "inner", None), CompiledForward
    )


def compile_blocks(blocks: Sequence[nn.Module], kwargs: dict[str, Any], zero3_leaves: bool = False) -> int:
    """Compile each block's forward in place (once per block); returns how many were compiled now.

    A checkpointed block keeps ``torch.utils.checkpoint`` outside and its forward compiled inside (dynamo
    does not trace the checkpoint wrapper's context functions): the recompute in backward runs the same
    compiled graph.

    ``zero3_leaves`` (DeepSpeed ZeRO-3, before ``deepspeed.initialize``): each block is made a ZeRO-3 leaf,
    gathered whole by its own hook, with no hooks on its layers. Without it DeepSpeed's per-layer hooks
    (``torch.compiler.disable``) would break the graph at every layer: the same losses, but on a 2-block GPT
    80 frames compiled instead of 1 and 40 s of compiling instead of 1.5 s (CPU).
    """
    if zero3_leaves:
        from deepspeed.utils import set_z3_leaf_module  # optional: DeepSpeed

        for block in blocks:
            set_z3_leaf_module(block, True)
    count = 0
    for block in blocks:
        if is_compiled(block):
            continue
        forward = block.__dict__.get("forward")
        if isinstance(forward, CheckpointedForward):
            inner = forward.inner or types.MethodType(type(block).forward, block)
            forward.inner = CompiledForward(inner, kwargs)
        else:
            block.forward = CompiledForward(block.forward, kwargs)  # type: ignore[method-assign]
        count += 1
    return count


_recompiles = 0


def recompiles() -> int:
    """Graphs compiled for a block in a grad mode it had already run in (a guard failed), in this process so far.
    A block's first forward with and without grad each compile once (training, then validation): not counted."""
    return _recompiles
