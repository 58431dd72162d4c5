"""FSDP2 set-up for stages 2-3: which modules ``fully_shard`` wraps, and with what."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from lightning_shard import _compat
from lightning_shard._modules import detect_block_classes, find_blocks
from lightning_shard.engines._gloo import use_cpu_collectives
from lightning_shard.engines._units import sharding_units

log = logging.getLogger(__name__)


class ForwardRedirection(_compat.DDPForwardRedirection):
    """Lightning's DDP redirection, and FSDP2's root kept gathered to backward after a nested forward."""

    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: Any) -> None:
        super().on_after_inner_forward(wrapper_module, original_module)
        # Only where a backward follows the forward (a manual backward inside the step has run already).
        if (
            isinstance(wrapper_module, FSDPModule)
            and torch.is_grad_enabled()
            and original_module.automatic_optimization
        ):
            _compat.fsdp_keep_gathered_after_nested_forward(wrapper_module)


def fully_shard_model(
    module: nn.Module, config: Any, mesh: Any, mp_policy: Any, stage: int, group: bool
) -> nn.Module:
    """Shard ``module``'s repeated blocks (packed into units up to 25 MB with ``group``), then the root."""
    if isinstance(module, FSDPModule):
        # Sharded by an earlier setup of the same Trainer (fit, then validate / test / predict):
        # fully_shard may be applied once per module, and the shards already hold the weights. An
        # evaluation forward at stage 2 leaves parameters gathered: reshard, so that optimizers
        # built next hold the sharded parameters. The process groups FSDP cached were destroyed at
        # the last call's teardown: point it at the ones made for this call.
        _compat.refresh_fsdp_groups(module)
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()
        return module

    classes = config.shard_modules or detect_block_classes(module)
    blocks = find_blocks(module, classes) if classes else []
    if config.shard_modules and not blocks:
        names = ", ".join(c.__qualname__ for c in config.shard_modules)
        raise ValueError(
            f"ShardStrategy(shard_modules={{{names}}}) matches no submodule of {type(module).__name__}."
            " Name the class of the model's repeated blocks, or pass shard_modules=None to detect it."
        )
    if not blocks:
        log.info(
            "ShardStrategy: no repeated block class found; %s is one sharding unit.", type(module).__name__
        )
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": stage == 3,
        "mp_policy": mp_policy,
        "offload_policy": offload_policy(config, mesh.device_type),
    }
    units = [fully_shard(u if len(u) > 1 else u[0], **kwargs) for u in sharding_units(blocks, group=group)]
    # The root's parameters are needed again as soon as backward starts: resharding them after
    # forward only buys a second all-gather (FSDP2's own default for the root).
    units.append(fully_shard(module, **{**kwargs, "reshard_after_forward": False}))
    for unit in units:
        # On gloo (CPU ranks) only. The modules of a grouped unit share one state.
        use_cpu_collectives(unit[0] if isinstance(unit, list) else unit)
    return module


def offload_policy(config: Any, device_type: str) -> Any:
    """``offload_params="cpu"``: FSDP2's CPU offload, pinned by default where there is a device to copy to."""
    if config.offload_params != "cpu":
        return OffloadPolicy()
    # Pinned host memory speeds host-device copies; on a CPU-only run there are none to speed up.
    pin = config.pin_memory if config.pin_memory is not None else device_type == "cuda"
    return CPUOffloadPolicy(pin_memory=bool(pin))
