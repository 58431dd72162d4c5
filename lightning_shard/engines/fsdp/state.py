"""The FSDP engine's state dicts, keyed by parameter name at every stage, so that a checkpoint reshards between
stages and world sizes: torch's DCP state dicts at stages 0, 2 and 3, stage 1's from :mod:`.zero`, a
whole-matrix optimizer's from :mod:`.whole_matrix` (each matrix's state whole, from its owner)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_shard.engines.fsdp import fp8, whole_matrix, zero


def model_state_dict(model: nn.Module, config: Any, full: bool) -> dict[str, Any]:
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=True))
    return fp8.plain_state_dict(config, state)


def load_model_state_dict(model: nn.Module, state: dict[str, Any], full: bool) -> None:
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=full, strict=True))


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer, stage: int, full: bool) -> dict[str, Any]:
    if stage == 1:
        return zero.optimizer_state_dict(model, optimizer, full)
    if whole_matrix.whole_matrix_step(optimizer) is not None:
        return whole_matrix.optimizer_state_dict(model, optimizer, full)
    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full)
    )


def optimizer_load_target(
    model: nn.Module, optimizer: Optimizer, stage: int, meta: Any, key: str
) -> dict[str, Any]:
    if stage == 1:
        return zero.load_target(model, optimizer, meta, key)
    if whole_matrix.whole_matrix_step(optimizer) is not None:
        return whole_matrix.load_target(model, optimizer, meta, key)
    return get_optimizer_state_dict(model, optimizer)


def load_optimizer_state_dict(
    model: nn.Module, optimizer: Optimizer, stage: int, state: dict[str, Any], full: bool
) -> None:
    if stage == 1:
        zero.load_optimizer_state_dict(model, optimizer, state)
        return
    if whole_matrix.whole_matrix_step(optimizer) is not None:
        whole_matrix.load_optimizer_state_dict(model, optimizer, state)
        return
    if full and not any(state.get("state", {}).values()):
        # A stateless optimizer (SGD without momentum) saved nothing per parameter; torch's full-state
        # loader cannot place "nothing" on a device, so only the hyperparameters are restored.
        for group, saved in zip(optimizer.param_groups, state.get("param_groups", []), strict=False):
            group.update({k: v for k, v in saved.items() if k != "params"})
        return
    if not full:
        state = with_live_params(model, optimizer, state)
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=full))


def with_live_params(model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each param group listing this optimizer's own parameter names, group by group.

    Each rank saves its param groups; DCP keeps one rank's copy of each entry. Under pipeline stages each
    stage's groups list only its own parameters, so the copy kept lists one stage's: torch would then map
    no other stage's parameters to a group. Hyperparameters are the same on every stage and come from
    the checkpoint by group index, per-parameter state by name; the names come from the live optimizer.
    """
    live: list[Any] = list(get_optimizer_state_dict(model, optimizer)["param_groups"])
    saved = state.get("param_groups", [])
    if len(saved) != len(live):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved)} param groups but configure_optimizers() made"
            f" {len(live)}. Resume with the same optimizer set-up."
        )
    groups = [{**group, "params": own["params"]} for group, own in zip(saved, live, strict=True)]
    return {**state, "param_groups": groups}
