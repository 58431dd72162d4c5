"""Lightning's ``DDPStrategy`` keyword arguments, accepted by ShardStrategy at stages 0-1.

``DDPStrategy(find_unused_parameters=True, static_graph=..., gradient_as_bucket_view=...,
ddp_comm_hook=..., ddp_comm_state=..., ddp_comm_wrapper=...)``: the first kind go to
``DistributedDataParallel`` itself, the hooks are registered on it as Lightning registers them. A project
moving from DDPStrategy keeps them as they are. Where an engine has no DDP wrapper to pass them to (its
``Capabilities.ddp_options_stages``) they are an error naming the flag, not silently dropped.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch.nn.parallel import DistributedDataParallel

#: ParallelStrategy's own keyword arguments (what Lightning's connector passes); everything else a
#: ShardStrategy receives through ``**kwargs`` is for DDP.
STRATEGY_KWARGS = frozenset(
    {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
)
#: Lightning's names for a DDP communication hook.
COMM_HOOK_KWARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper")
#: Set by the strategy itself from the device mesh.
_OWNED = ("module", "process_group", "device_mesh", "device_ids", "output_device")


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(ParallelStrategy's kwargs, DDP's kwargs)``, DDP's checked against its constructor."""
    strategy = {k: v for k, v in kwargs.items() if k in STRATEGY_KWARGS}
    ddp = {k: v for k, v in kwargs.items() if k not in STRATEGY_KWARGS}
    accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", *_OWNED}
    unknown = sorted(set(ddp) - accepted - set(COMM_HOOK_KWARGS))
    if unknown:
        raise TypeError(
            f"ShardStrategy got unexpected keyword argument(s) {', '.join(unknown)}. Besides its own flags it"
            f" accepts Lightning's DDPStrategy options for stages 0-1: {', '.join(sorted(accepted))},"
            f" {', '.join(COMM_HOOK_KWARGS)}."
        )
    return strategy, ddp


def check_comm_hook(ddp_kwargs: dict[str, Any], reduce_dtype: Any) -> None:
    """A user's communication hook and a low-precision ``reduce_dtype`` (itself a hook) cannot both apply."""
    if ddp_kwargs.get("ddp_comm_hook") is not None and reduce_dtype is not None:
        raise ValueError(
            f"ShardStrategy(ddp_comm_hook=...) and ShardPrecision(reduce_dtype={reduce_dtype}) both set how"
            " gradients are communicated at stages 0-1. Keep one: reduce_dtype registers torch's compress hook"
            " itself."
        )
