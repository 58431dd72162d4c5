"""What ShardFabricStrategy checks and fixes up when Fabric sets a model up: flags that are Trainer hooks, an
optimizer built before sharding, pointed at the parameters that replaced the ones it holds, and one set up on its
own after the model; the launcher and the backward-sync control it hands Fabric."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.config import ShardConfig
from lightning_shard.core.processes import ReapChildren


class FabricLauncher(ReapChildren, _SubprocessScriptLauncher):
    """Fabric's script launcher; rank 0 reaps the ranks it started when it exits."""


def parameter_names(module: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter of ``module``: a tied one has several (a head tied to the embedding),
    of which a pipeline stage may keep only one."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def rebind(
    optimizer: Optimizer, names: dict[int, list[str]], live: dict[str, nn.Parameter], cut: bool = False
) -> None:
    """Point ``optimizer`` at the parameters that replaced the ones it was built with (FSDP2 shards,
    meta parameters allocated), by name (:func:`parameter_names`); ``cut``: drop those the module no longer
    has (other stages')."""
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    "ShardFabricStrategy: the optimizer passed to fabric.setup holds a parameter that is not the model's."
                    " Build it from model.parameters() of the model passed with it."
                )
            if optimizer.state.get(p):
                raise ValueError(
                    "ShardFabricStrategy: the optimizer passed to fabric.setup has already stepped; its state belongs"
                    " to the unsharded parameters. Set it up before the first step, or load its state after setup"
                    " with fabric.load."
                )
            kept = [name for name in names[id(p)] if name in live]
            if kept:
                params.append(live[kept[0]])
            elif not cut:
                raise ValueError(
                    f"ShardFabricStrategy: the parameter {names[id(p)][0]!r} the optimizer holds is gone from the"
                    " model after set-up. Build the optimizer from model.parameters() of the model passed with it."
                )
        group["params"] = params


def check_optimizer_alone(
    config: ShardConfig, module: nn.Module | None, optimizer: Optimizer, owns_step: bool
) -> None:
    """``fabric.setup_optimizers`` after ``fabric.setup_module``: the model is set up, the engine steps a torch
    optimizer the loop holds, and the optimizer holds the set-up model's parameters."""
    if module is None:
        raise RuntimeError(
            "ShardFabricStrategy: set the model up before its optimizer: model = fabric.setup_module(model),"
            " then build the optimizer from model.parameters() and call fabric.setup_optimizers(optimizer);"
            " or pass both to fabric.setup(model, optimizer)."
        )
    if owns_step:
        raise RuntimeError(
            f"ShardFabricStrategy(engine={config.engine!r}) wraps the model and its optimizer together:"
            " call fabric.setup(model, optimizer) instead of fabric.setup_module + fabric.setup_optimizers."
        )
    held = {id(p) for p in module.parameters()}
    if any(id(p) not in held for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            f"ShardFabricStrategy(stage={config.stage}): the optimizer holds parameters that are not the set-up"
            " model's (it was built before fabric.setup_module sharded the model). Build it after"
            " fabric.setup_module(model) from model.parameters(), or pass both to fabric.setup(model, optimizer)."
        )


def refuse_trainer_only(config: ShardConfig) -> None:
    refused = [
        (
            "stage='auto'",
            config.stage == "auto",
            "it plans from the Trainer's model and batch. Pick stage=0-3"
            " (`lightning-shard plan` recommends one)",
        ),
        (
            "skip_nonfinite=True",
            config.skip_nonfinite,
            "it is a Trainer optimizer-step hook. In a Fabric loop,"
            " skip the step yourself when fabric.all_reduce(loss.isfinite().float(), reduce_op='min') is 0",
        ),
        (
            "fault_tolerance={'semi_sync': ...}",
            config.fault_tolerance is not None and config.fault_tolerance.semi_sync is not None,
            "DiLoCo's outer step, its checkpointed state and its heal are wired to the Trainer's loop. Train"
            " with Trainer(strategy=ShardStrategy(fault_tolerance=...)), or drop semi_sync in Fabric (gradients"
            " averaged over the groups at every step)",
        ),
    ]
    for flag, hit, why in refused:
        if hit:
            raise ValueError(f"ShardFabricStrategy({flag}) is a Trainer-only flag: {why}.")


def refuse_clip_on_owned_step(config: ShardConfig, caps: Any, argument: str) -> None:
    if caps.owns_step:
        raise ValueError(
            f"fabric.clip_gradients({argument}=...) cannot reach the gradients under"
            f" ShardFabricStrategy(engine={config.engine!r}): {caps.label} keeps them in its own partitions"
            " and clips inside its step. Use engine='fsdp' to clip from the loop."
        )


class EngineNoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the engine's own way of skipping gradient communication."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        return self._strategy._engines.no_sync(module)
