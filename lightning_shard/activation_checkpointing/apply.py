"""The activation checkpointing configuration and applying it to a model, on torch alone.

``ShardStrategy(activation_checkpointing=...)`` and the ``ActivationCheckpointing`` callback (:mod:`.callback`,
a Lightning callback for any strategy) both take an :class:`ActivationCheckpointingConfig` and call
:func:`apply_activation_checkpointing` before the model is wrapped or sharded.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from lightning_shard._modules import ModuleClassSpec, resolve_module_classes
from lightning_shard.activation_checkpointing.blocks import (
    blocks_to_checkpoint,
    check_not_checkpointed,
    checkpointed_blocks,
)
from lightning_shard.activation_checkpointing.budget import BlockPlan, BudgetPlanner
from lightning_shard.activation_checkpointing.cache import disable_cache_in_training
from lightning_shard.activation_checkpointing.policy import SaveMatmuls, op_names, resolve_save_ops
from lightning_shard.activation_checkpointing.wrap import CheckpointedForward, wrapper_of

Policy = Literal["full", "selective"]
_POLICIES: tuple[str, ...] = ("full", "selective")
_SAVE_MATMULS: tuple[str, ...] = ("all", "every_other")


class ActivationCheckpointingConfig:
    """Recompute the model's repeated blocks in backward instead of keeping their activations.

    The configuration alone, on torch: :func:`apply_activation_checkpointing` and
    ``ShardStrategy(activation_checkpointing=...)`` take it. Its subclass
    :class:`~lightning_shard.ActivationCheckpointing` is also a Lightning callback (for any strategy).

    Args:
        policy: ``"selective"`` keeps the outputs of ``save_ops`` and recomputes the rest of each
            block; ``"full"`` recomputes the whole block.
        blocks: Module classes to checkpoint, as classes or import-path strings
            (``"transformers.models.llama.modeling_llama.LlamaDecoderLayer"``). None detects the
            repeated block class, as ShardStrategy does for its sharding units.
        every_n: Checkpoint every n-th block only (blocks 0, n, 2n, ...); None checkpoints all.
        memory_budget: Fraction in (0, 1] of the blocks' no-checkpoint activation bytes to fit in;
            the plan mixes none / selective (if ``policy="selective"``) / full per block, measured on
            the first training step. Not combinable with ``every_n``.
        save_ops: Ops whose outputs the selective policy keeps, as op overloads or names
            (``"aten.mm.default"``); None is :data:`DEFAULT_SAVE_OPS`.
        save_matmuls: ``"every_other"`` recomputes every second matmul of a block too (half the
            stored matmul outputs, for half the matmul recompute); ``"all"`` keeps them all. None is
            ``"every_other"`` with ``policy="selective"`` (torchtitan's choice: on the demo GPT 41% of the
            activation bytes gone at +5% step time, against 29% for ``"all"``).
    """

    def __init__(
        self,
        policy: Policy = "selective",
        blocks: list[ModuleClassSpec] | ModuleClassSpec | None = None,
        every_n: int | None = None,
        memory_budget: float | None = None,
        save_ops: list[str | torch._ops.OpOverload] | None = None,
        save_matmuls: SaveMatmuls | None = None,
    ) -> None:
        _validate(policy, every_n, memory_budget, save_ops, save_matmuls)
        self.policy = policy
        self.blocks = blocks
        self.every_n = every_n
        self.memory_budget = memory_budget
        self.save_ops = save_ops
        self.save_matmuls = save_matmuls
        self._save_matmuls: SaveMatmuls = save_matmuls or ("every_other" if policy == "selective" else "all")
        # Resolved now so a bad import path or op name fails at construction, before any process starts.
        self._block_classes = resolve_module_classes(blocks, "ActivationCheckpointing(blocks=...)")
        self._save_op_set = resolve_save_ops(save_ops, "ActivationCheckpointing(save_ops=...)")
        self._planners: list[BudgetPlanner] = []

    def __getstate__(self) -> dict[str, Any]:
        # Op overloads do not pickle; their names do. Needed because a checkpointed model refers to its config.
        state = dict(self.__dict__)
        state["_save_op_set"] = op_names(self._save_op_set)
        if self.save_ops is not None:
            state["save_ops"] = [op if isinstance(op, str) else op_names([op])[0] for op in self.save_ops]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_save_op_set"] = resolve_save_ops(
            state["_save_op_set"], "ActivationCheckpointing(save_ops=...)"
        )
        self.__dict__.update(state)

    @classmethod
    def from_flag(
        cls, value: Any, flag: str = "activation_checkpointing"
    ) -> ActivationCheckpointingConfig | None:
        """Normalise a strategy flag: None, ``"full"``, ``"selective"`` or an ``ActivationCheckpointing``."""
        if value is None or isinstance(value, ActivationCheckpointingConfig):
            return value
        if isinstance(value, str) and value in _POLICIES:
            return cls(policy=value)  # type: ignore[arg-type]
        raise ValueError(
            f"{flag}={value!r} is not a checkpointing choice. Use None, 'full', 'selective' or"
            " ActivationCheckpointing(...) for finer control (every_n, memory_budget, save_ops)."
        )

    @property
    def plans(self) -> list[BlockPlan]:
        """What ``memory_budget`` chose, per block class (filled on the first training step)."""
        return [plan for planner in self._planners for plan in planner.plans]

    def __repr__(self) -> str:
        args = ", ".join(
            f"{name}={getattr(self, name)!r}"
            for name in ("policy", "blocks", "every_n", "memory_budget", "save_ops", "save_matmuls")
        )
        return f"{type(self).__name__}({args})"


def _validate(policy: Any, every_n: Any, memory_budget: Any, save_ops: Any, save_matmuls: Any) -> None:
    """Cross-field checks at construction, each naming the flag, the value and the fix."""
    if policy not in _POLICIES:
        raise ValueError(
            f"ActivationCheckpointing(policy={policy!r}) is not a policy. Use 'selective' (keep matmul and"
            " attention outputs, recompute the rest) or 'full' (recompute whole blocks)."
        )
    if every_n is not None and (isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1):
        raise ValueError(
            f"ActivationCheckpointing(every_n={every_n!r}) must be a whole number >= 1 (1 = every block,"
            " 2 = every second block, ...), or None for every block."
        )
    if memory_budget is not None:
        if (
            isinstance(memory_budget, bool)
            or not isinstance(memory_budget, (int, float))
            or not 0 < memory_budget <= 1
        ):
            raise ValueError(
                f"ActivationCheckpointing(memory_budget={memory_budget!r}) must be a fraction in (0, 1] of the"
                " blocks' no-checkpoint activation memory, e.g. 0.5; use None to checkpoint by policy alone."
            )
        if every_n is not None:
            raise ValueError(
                f"ActivationCheckpointing(every_n={every_n}, memory_budget={memory_budget}) both choose which"
                " blocks to recompute. Give every_n for a fixed pattern or memory_budget for a measured plan."
            )
    if save_matmuls is not None and save_matmuls not in _SAVE_MATMULS:
        raise ValueError(
            f"ActivationCheckpointing(save_matmuls={save_matmuls!r}) must be 'all' (keep every matmul output)"
            " or 'every_other' (recompute every second matmul)."
        )
    if policy == "full" and (save_ops is not None or save_matmuls not in (None, "all")):
        given = f"save_ops={save_ops!r}" if save_ops is not None else f"save_matmuls={save_matmuls!r}"
        raise ValueError(
            f"ActivationCheckpointing(policy='full', {given}): policy='full' saves no op outputs."
            " Use policy='selective' with it, or drop it."
        )


def apply_activation_checkpointing(
    module: nn.Module, config: ActivationCheckpointingConfig | Policy = "selective"
) -> list[nn.Module]:
    """Patch ``module``'s blocks in place to run under activation checkpointing; return the patched blocks.

    Call it before sharding (``fully_shard``) or DDP wrapping. Parameter names are unchanged. A Hugging Face
    model around the blocks runs its training forwards with ``use_cache=False`` (see :mod:`.cache`).
    Raises ``ValueError`` if the model is already checkpointed (by this function, torch's
    ``checkpoint_wrapper`` or Hugging Face ``gradient_checkpointing``) or no block matches.
    """
    resolved = ActivationCheckpointingConfig.from_flag(config, "apply_activation_checkpointing(config=...)")
    if resolved is None:
        raise ValueError(
            "apply_activation_checkpointing(config=None) has nothing to apply. Pass 'full', 'selective' or"
            " ActivationCheckpointing(...), or skip the call."
        )
    config = resolved
    check_not_checkpointed(module)
    blocks = blocks_to_checkpoint(module, config._block_classes, config.blocks)
    names = {id(m): name for name, m in module.named_modules()}
    planner = None
    if config.memory_budget is not None:
        planner = BudgetPlanner(config.memory_budget, allow_selective=config.policy == "selective")
        config._planners.append(planner)
    patched: list[nn.Module] = []
    for index, block in enumerate(blocks):
        if config.every_n is not None and index % config.every_n:
            continue
        wrapper = CheckpointedForward(
            block,
            names[id(block)],
            config,
            planner or config.policy,
            config._save_op_set,
            config._save_matmuls,
        )
        if planner is not None:
            planner.add(wrapper)
        block.forward = wrapper  # type: ignore[method-assign]
        patched.append(block)
    disable_cache_in_training(module, patched)
    return patched


def applied_by(module: nn.Module, config: ActivationCheckpointingConfig) -> bool:
    return any(wrapper_of(m).owner is config for m in checkpointed_blocks(module))  # type: ignore[union-attr]
