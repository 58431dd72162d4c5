"""DDP at stages 0-1 of the FSDP engine: ``DistributedDataParallel`` with the user's options and hook.

The flags (Lightning's ``DDPStrategy`` options) are validated in :mod:`lightning_shard._ddp`; this module
builds the wrapper and, for CPU ranks on one host, the shared-memory all-reduce hook that stands in until
the user registers one (:mod:`lightning_shard.engines._shm`).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_shard._ddp import COMM_HOOK_KWARGS
from lightning_shard.engines._shm import allreduce_hook, shared_memory_group


def wrap(module: nn.Module, process_group: Any, device_ids: Any, ddp_kwargs: dict[str, Any]) -> nn.Module:
    """``DistributedDataParallel`` with the user's options and communication hook."""
    options = {k: v for k, v in ddp_kwargs.items() if k not in COMM_HOOK_KWARGS}
    hook = {k: ddp_kwargs[k] for k in COMM_HOOK_KWARGS if k in ddp_kwargs}
    ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=process_group, **options)
    if hook.get("ddp_comm_hook") is not None:
        register_comm_hook(
            ddp, hook["ddp_comm_hook"], hook.get("ddp_comm_state"), hook.get("ddp_comm_wrapper")
        )
    elif device_ids is None and shared_memory_group(ddp.process_group) is not None:
        _SharedMemoryHook.install(ddp)
    return ddp


def register_comm_hook(
    ddp: DistributedDataParallel, hook: Any, state: Any = None, wrapper: Any = None
) -> None:
    """``DDPStrategy``'s ``ddp_comm_hook`` / ``ddp_comm_state`` / ``ddp_comm_wrapper``: the hook, wrapped by the
    wrapper when given (fp16 compression around PowerSGD), registered on the DDP module."""
    ddp.register_comm_hook(state=state, hook=wrapper(hook) if wrapper is not None else hook)


class _SharedMemoryHook:
    """CPU ranks on gloo: DDP's own all-reduce, carried through shared memory among ranks on one host.

    DDP takes one communication hook for its lifetime, and under Lightning's ``DDPStrategy`` that one is
    the user's to register (``trainer.model.register_comm_hook`` in a callback). So this hook stands in
    until then: the wrapper's ``register_comm_hook`` / ``_register_builtin_comm_hook`` hand the user's hook
    to it, checked and logged as DDP does, and a second registration fails as DDP's does."""

    def __init__(self, ddp: Any) -> None:
        self.ddp, self.default = ddp, allreduce_hook
        self.user: tuple[Any, object] | None = None
        self.__name__ = self.__qualname__ = "shared_memory_allreduce_hook"  # DDP reads and logs the name

    @classmethod
    def install(cls, ddp: Any) -> None:
        hook = cls(ddp)
        ddp.register_comm_hook(ddp.process_group, hook)
        ddp.register_comm_hook = hook.register
        ddp._register_builtin_comm_hook = hook.register_builtin

    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]  # (no annotations: DDP checks them)
        if self.user is not None:
            user_hook, user_state = self.user
            return user_hook(user_state, bucket)
        return self.default(state, bucket)

    def register(self, state: object, hook: Any) -> None:
        if self.user is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self.ddp._check_comm_hook(hook)
        self.ddp.logger._set_comm_hook_name(hook.__qualname__)
        self.ddp._comm_hooks.append((hook, state))
        self.user = (hook, state)

    def register_builtin(self, comm_hook_type: Any) -> None:
        hooks = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        self.register(self.ddp.process_group, hooks[comm_hook_type])
