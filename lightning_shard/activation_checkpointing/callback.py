"""``ActivationCheckpointing`` (the configuration, and a callback for any strategy) and applying it to a model.

The callback patches the blocks right after the module's ``configure_model`` and before the strategy
wraps or shards it; ``ShardStrategy(activation_checkpointing=...)`` takes the same object and calls
:func:`apply_activation_checkpointing` itself.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

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


class ActivationCheckpointing(Callback):
    """Recompute the model's repeated blocks in backward instead of keeping their activations.

    Works with any strategy: the blocks are patched right after ``configure_model`` and before the
    strategy wraps or shards the model. The same object is the configuration that
    ``ShardStrategy(activation_checkpointing=...)`` takes.

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
    def from_flag(cls, value: Any, flag: str = "activation_checkpointing") -> ActivationCheckpointing | None:
        """Normalise a strategy flag: None, ``"full"``, ``"selective"`` or an ``ActivationCheckpointing``."""
        if value is None or isinstance(value, ActivationCheckpointing):
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
        return f"ActivationCheckpointing({args})"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Only training runs backward; validation and prediction run under no_grad, where a
        # checkpointed block is a plain call anyway.
        if stage != "fit" or _applied_by(pl_module, self):
            return
        _apply_after_configure_model(pl_module, self)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A strategy that never calls configure_model skipped the deferred apply. Patching now, after the
        # strategy's setup, is still correct: wrapper hooks (DDP, FSDP2) run around the patched forward.
        _restore_configure_model(pl_module)
        if not _applied_by(pl_module, self):
            apply_activation_checkpointing(pl_module, self)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _restore_configure_model(pl_module)


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
    module: nn.Module, config: ActivationCheckpointing | Policy = "selective"
) -> list[nn.Module]:
    """Patch ``module``'s blocks in place to run under activation checkpointing; return the patched blocks.

    Call it before sharding (``fully_shard``) or DDP wrapping. Parameter names are unchanged. A Hugging Face
    model around the blocks runs its training forwards with ``use_cache=False`` (see :mod:`.cache`).
    Raises ``ValueError`` if the model is already checkpointed (by this function, torch's
    ``checkpoint_wrapper`` or Hugging Face ``gradient_checkpointing``) or no block matches.
    """
    resolved = ActivationCheckpointing.from_flag(config, "apply_activation_checkpointing(config=...)")
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


def _applied_by(module: nn.Module, config: ActivationCheckpointing) -> bool:
    return any(wrapper_of(m).owner is config for m in checkpointed_blocks(module))  # type: ignore[union-attr]


def _apply_after_configure_model(pl_module: pl.LightningModule, config: ActivationCheckpointing) -> None:
    """Make ``pl_module.configure_model`` run the user's hook and then patch the blocks, for this one fit.

    Why not patch in the callback's ``setup``: Lightning calls callbacks' ``setup`` before the
    module's own ``setup`` and ``configure_model``, where many models create their layers, and the
    next hook after ``configure_model`` is ``strategy.setup``, which already wraps or shards. So the
    patching runs at the end of the ``configure_model`` call. Lightning calls ``configure_model``
    only when it looks overridden (its code differs from ``LightningModule.configure_model``), which a
    function set on the instance always does, so this also covers modules built in ``__init__``.
    The attribute lives only until that call (or teardown): a closure on the module must not outlive
    the fit, where it would stop the module from pickling.
    """
    _restore_configure_model(pl_module)
    user_hook = pl_module.__dict__.get("configure_model")

    def configure_model_then_checkpoint() -> None:
        _restore_configure_model(pl_module)
        pl_module.configure_model()
        if not _applied_by(pl_module, config):
            apply_activation_checkpointing(pl_module, config)

    configure_model_then_checkpoint._ac_user_hook = (user_hook,)  # type: ignore[attr-defined]
    pl_module.configure_model = configure_model_then_checkpoint  # type: ignore[method-assign]


def _restore_configure_model(pl_module: nn.Module) -> None:
    patched = pl_module.__dict__.get("configure_model")
    if patched is None or not hasattr(patched, "_ac_user_hook"):
        return
    (user_hook,) = patched._ac_user_hook
    if user_hook is not None:
        pl_module.configure_model = user_hook  # type: ignore[method-assign]
    else:
        del pl_module.configure_model
