"""Which blocks of a model to checkpoint, whether some already are, and undoing it.

A model is checkpointed at most once: by :func:`~.callback.apply_activation_checkpointing`, torch's
``checkpoint_wrapper`` or Hugging Face's ``gradient_checkpointing``. Twice would recompute each block
twice in backward, so every second way is refused with the fix.
"""

from __future__ import annotations

from torch import nn

from lightning_shard._modules import detect_block_classes, find_blocks
from lightning_shard.activation_checkpointing.cache import restore_cache
from lightning_shard.activation_checkpointing.wrap import unwrap, wrapper_of

try:  # private torch path; without it, torch's own wrapper simply cannot be detected
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
except ImportError:  # pragma: no cover
    CheckpointWrapper = ()  # type: ignore[assignment,misc]


def blocks_to_checkpoint(
    module: nn.Module, block_classes: tuple[type, ...] | None, blocks_flag: object
) -> list[nn.Module]:
    """The instances of ``block_classes`` in ``module`` (None: the repeated block class, detected).

    ``blocks_flag`` is the user's ``blocks=...`` as typed, for the error message.
    """
    classes = block_classes or detect_block_classes(module)
    if not classes:
        raise ValueError(
            f"ActivationCheckpointing(blocks=None) found no repeated block in {type(module).__name__}: it has no"
            " nn.ModuleList / nn.Sequential of two or more modules of one class. Name the classes to"
            " checkpoint, e.g. ActivationCheckpointing(blocks=['my_package.model.DecoderLayer'])."
        )
    blocks = find_blocks(module, classes)
    if not blocks:
        wanted = [f"{c.__module__}.{c.__qualname__}" for c in classes]
        raise ValueError(
            f"ActivationCheckpointing(blocks={blocks_flag!r}) matches no submodule of {type(module).__name__}"
            f" (looked for {wanted}). Check the class names against print(model), or pass blocks=None to"
            " detect the repeated block class."
        )
    for block in blocks:
        if getattr(block, "gradient_checkpointing", False) is True:
            raise ValueError(
                f"ActivationCheckpointing: block {type(block).__name__} already has Hugging Face gradient"
                " checkpointing on, so it would be recomputed twice. Call model.gradient_checkpointing_disable()"
                " or drop ActivationCheckpointing."
            )
    return blocks


def check_not_checkpointed(module: nn.Module) -> None:
    already = checkpointed_blocks(module)
    if already:
        owner = wrapper_of(already[0]).owner  # type: ignore[union-attr]
        raise ValueError(
            f"Activation checkpointing is already applied to {len(already)} blocks of {type(module).__name__}"
            f" (by {owner!r}); applying it again would recompute them twice. Use one of"
            " Trainer(callbacks=[ActivationCheckpointing(...)]) or ShardStrategy(activation_checkpointing=...),"
            " not both, or call remove_activation_checkpointing(model) first."
        )
    wrapped = [name for name, m in module.named_modules() if isinstance(m, CheckpointWrapper)]
    if wrapped:
        raise ValueError(
            f"{type(module).__name__} already has blocks wrapped by torch's checkpoint_wrapper ({wrapped[:3]}...)."
            " Remove that wrapping (it also renames parameters) and let ActivationCheckpointing do it, or drop"
            " ActivationCheckpointing."
        )


def remove_activation_checkpointing(module: nn.Module) -> list[nn.Module]:
    """Undo :func:`apply_activation_checkpointing`; return the blocks that got their own forward back."""
    restore_cache(module)
    return [m for m in module.modules() if unwrap(m)]


def checkpointed_blocks(module: nn.Module) -> list[nn.Module]:
    """The submodules of ``module`` (itself included) patched by :func:`apply_activation_checkpointing`."""
    return [m for m in module.modules() if wrapper_of(m) is not None]


def is_activation_checkpointed(module: nn.Module) -> bool:
    """Whether any submodule of ``module`` already runs under :func:`apply_activation_checkpointing`."""
    return any(wrapper_of(m) is not None for m in module.modules())
