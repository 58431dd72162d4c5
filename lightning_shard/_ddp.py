"""Lightning's ``DDPStrategy`` keyword arguments, accepted by ShardStrategy at stages 0-1.

``DDPStrategy(find_unused_parameters=True, static_graph=..., gradient_as_bucket_view=...,
ddp_comm_hook=..., ddp_comm_state=..., ddp_comm_wrapper=...)``: the first kind go to
``DistributedDataParallel`` itself, the hooks are registered on it as Lightning registers them. A project
moving from DDPStrategy keeps them as they are. Stages 2-3 (FSDP2) and the DeepSpeed engine have no
DDP wrapper to pass them to: there they are an error naming the flag, not silently dropped.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

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
    from torch.nn.parallel import DistributedDataParallel

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


def check(ddp_kwargs: dict[str, Any], stage: Any, engine: str) -> None:
    """Refuse DDP options where no DDP wrapper exists (stages 2-3, the DeepSpeed engine)."""
    if not ddp_kwargs:
        return
    flags = ", ".join(f"{k}={v!r}" for k, v in sorted(ddp_kwargs.items()))
    if engine != "fsdp":
        raise ValueError(
            f"ShardStrategy({flags}) are DistributedDataParallel options, and engine={engine!r} has no DDP"
            " wrapper to pass them to. Use engine='fsdp' at stage 0 or 1, or drop them."
        )
    if stage not in (0, 1):
        raise ValueError(
            f"ShardStrategy({flags}) are DistributedDataParallel options, used at stages 0-1 only (got"
            f" stage={stage!r}, where FSDP2 shards the model and no DDP wrapper exists). Use stage=0 or 1,"
            " or drop them (FSDP2 needs no find_unused_parameters: unused parameters get no gradient)."
        )


def wrap(module: nn.Module, process_group: Any, device_ids: Any, ddp_kwargs: dict[str, Any]) -> nn.Module:
    """``DistributedDataParallel`` with the user's options and communication hook."""
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from torch.nn.parallel import DistributedDataParallel

    from lightning_shard.engines._shm import shared_memory_group

    options = {k: v for k, v in ddp_kwargs.items() if k not in COMM_HOOK_KWARGS}
    hook = {k: ddp_kwargs[k] for k in COMM_HOOK_KWARGS if k in ddp_kwargs}
    ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=process_group, **options)
    if hook.get("ddp_comm_hook") is not None:
        _register_ddp_comm_hook(model=ddp, **hook)
    elif device_ids is None and shared_memory_group(ddp.process_group) is not None:
        _SharedMemoryHook.install(ddp)
    return ddp


class _SharedMemoryHook:
    """CPU ranks on gloo: DDP's own all-reduce, carried through shared memory among ranks on one host.

    DDP takes one communication hook for its lifetime, and under Lightning's ``DDPStrategy`` that one is
    the user's to register (``trainer.model.register_comm_hook`` in a callback). So this hook stands in
    until then: the wrapper's ``register_comm_hook`` / ``_register_builtin_comm_hook`` hand the user's hook
    to it, checked and logged as DDP does, and a second registration fails as DDP's does."""

    def __init__(self, ddp: Any) -> None:
        from lightning_shard.engines._shm import allreduce_hook

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
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        self.register(self.ddp.process_group, hooks[comm_hook_type])


def check_comm_hook(ddp_kwargs: dict[str, Any], reduce_dtype: Any) -> None:
    """A user's communication hook and a low-precision ``reduce_dtype`` (itself a hook) cannot both apply."""
    if ddp_kwargs.get("ddp_comm_hook") is not None and reduce_dtype is not None:
        raise ValueError(
            f"ShardStrategy(ddp_comm_hook=...) and ShardPrecision(reduce_dtype={reduce_dtype}) both set how"
            " gradients are communicated at stages 0-1. Keep one: reduce_dtype registers torch's compress hook"
            " itself."
        )
