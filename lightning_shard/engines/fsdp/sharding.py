"""FSDP2 set-up for stages 2-3: which modules ``fully_shard`` wraps, and with what."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from lightning_shard import _compat
from lightning_shard._modules import detect_block_classes, find_blocks
from lightning_shard.engines._gloo import use_cpu_collectives
from lightning_shard.engines._redirect import DDPForwardRedirection
from lightning_shard.engines.fsdp.units import sharding_units

log = logging.getLogger(__name__)


class ForwardRedirection(DDPForwardRedirection):
    """DDP's redirection (:mod:`._redirect`), and FSDP2's root kept gathered to backward after a nested forward."""

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
    module: nn.Module,
    config: Any,
    mesh: Any,
    mp_policy: Any,
    stage: int,
    group: bool,
    experts: tuple[list[nn.Module], Any] | None = None,
) -> nn.Module:
    """Shard ``module``'s repeated blocks (packed into units up to 25 MB with ``group``), then the root.

    ``experts``: the experts modules expert parallelism split, and the mesh of the ranks left to shard each
    rank's expert block over; each is a sharding unit of its own, first (FSDP2 shards children before parents).
    """
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
    units: list[Any] = []
    if experts is not None:
        modules, expert_mesh = experts
        units += [fully_shard(m, **{**kwargs, "mesh": expert_mesh}) for m in modules]
    units += [fully_shard(u if len(u) > 1 else u[0], **kwargs) for u in sharding_units(blocks, group=group)]
    # The root's parameters are needed again as soon as backward starts: resharding them after
    # forward only buys a second all-gather (FSDP2's own default for the root).
    units.append(fully_shard(module, **{**kwargs, "reshard_after_forward": False}))
    for unit in units:
        # On gloo (CPU ranks) only. The modules of a grouped unit share one state.
        use_cpu_collectives(unit[0] if isinstance(unit, list) else unit)
    if config.pipeline_parallel_size == 1:  # with pipeline stages a rank holds only some of the layers
        DirectCalls(module).install()
    return module


#: How to use the trained model in one process, when calling it across ranks is not possible.
ONE_PROCESS = (
    " For the whole model in one process, save a checkpoint (trainer.save_checkpoint(path), on every rank) and"
    " write its full weights with `lightning-shard consolidate CKPT OUT.ckpt` or, for a Hugging Face model,"
    " `lightning-shard export CKPT DIR` (then from_pretrained(DIR)); see docs/large_models.md."
)


class DirectCalls:
    """After a Trainer call, a script may call a submodule of the sharded model on every rank:
    ``model.net(x)``, ``model.net.generate(...)``, as under ``DDPStrategy``.

    FSDP2 gathers the root's own parameters (those of no smaller unit: embeddings, final norm, head) in the
    root's pre-forward; a call to a submodule skips it and meets sharded ones. So each module through which a
    call reaches one of those parameters runs the root's pre- and post-forward around its outermost call
    made outside the root's forward, as ``register_fsdp_forward_method`` does for a method of the root;
    ``generate`` counts as one call (one gather for all its tokens). Between calls every parameter stays
    sharded: every unit is resharded after the call.
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.depth = 0  # calls in progress: the root's own forward, and direct calls
        self.direct = False  # the outermost call in progress is a direct one

    def install(self) -> None:
        # Once per module: a later Trainer call re-uses the sharded module and these hooks.
        if getattr(self.root, _DIRECT_CALLS, False):
            return
        setattr(self.root, _DIRECT_CALLS, True)
        self.root.register_forward_pre_hook(self._enter_root, prepend=True)
        self.root.register_forward_hook(self._leave, always_call=True)
        for sub in _reaching_root_parameters(self.root):
            sub.register_forward_pre_hook(self._enter, with_kwargs=True)
            sub.register_forward_hook(self._leave, always_call=True)
            generate = getattr(sub, "generate", None)
            if inspect.ismethod(generate):  # Hugging Face's: a bound method of the model
                sub.generate = _OneCall(self, sub, generate)  # type: ignore[assignment]

    def _enter_root(self, module: nn.Module, args: Any) -> None:
        self.depth += 1  # FSDP2's own hooks gather for the root's forward

    def _enter(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self.depth += 1  # first: the post-forward hook (always called) undoes it if this raises
        if self.depth > 1 or _compat.in_backward():
            # Inside another call, or a checkpointed block re-run in backward: FSDP's own backward hooks
            # gather there, and a recompute must replay the forward's ops exactly.
            return args, kwargs
        if not dist.is_initialized():
            raise RuntimeError(
                f"{type(module).__name__} was called after the process group was destroyed: its parameters"
                " are sharded across ranks and cannot be gathered any more. Call it on every rank while the"
                " process group is alive (after trainer.fit / test, before exit)." + ONE_PROCESS
            )
        pre, _ = _compat.fsdp_forward_hooks(self.root)
        args, kwargs = pre(self.root, args, kwargs)
        self.direct = True
        return args, kwargs

    def _leave(self, module: nn.Module, args: Any, output: Any) -> Any:
        self.depth -= 1
        if self.depth > 0 or not self.direct:
            return output
        self.direct = False
        _, post = _compat.fsdp_forward_hooks(self.root)
        output = post(self.root, args, output)
        # Every unit back to its shards (stage 2's and the root's stay gathered after forward, for a
        # backward): a backward through the call gathers them again in its pre-backward hooks.
        for sub in self.root.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()
        return output


class _OneCall:
    """A method of a submodule (``generate``) run as one direct call: one gather for all its forwards.

    An object rather than a closure, so that a deep copy of the model (weight averaging) calls its own copy.
    """

    def __init__(self, calls: DirectCalls, module: nn.Module, method: Callable[..., Any]) -> None:
        self.calls, self.module, self.method = calls, module, method
        functools.update_wrapper(self, method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            args, kwargs = self.calls._enter(self.module, args, kwargs)
            output = self.method(*args, **kwargs)
        except BaseException:
            self.calls._leave(self.module, args, None)
            raise
        return self.calls._leave(self.module, args, output)


#: Set on a root whose submodules gather its parameters when called on their own.
_DIRECT_CALLS = "_lightning_shard_direct_calls"


def _reaching_root_parameters(root: nn.Module) -> list[nn.Module]:
    """The submodules of ``root`` holding, or containing modules that hold, parameters of the root's own
    unit (the modules below another unit hold that unit's)."""
    found: dict[int, nn.Module] = {}

    def visit(module: nn.Module) -> bool:
        holds = next(module.parameters(recurse=False), None) is not None
        for child in module.children():
            if not isinstance(child, FSDPModule) and visit(child):
                holds = True
        if holds and module is not root:
            found[id(module)] = module
        return holds

    visit(root)
    return list(found.values())


def offload_policy(config: Any, device_type: str) -> Any:
    """``offload_params="cpu"``: FSDP2's CPU offload, pinned by default where there is a device to copy to."""
    if config.offload_params != "cpu":
        return OffloadPolicy()
    # Pinned host memory speeds host-device copies; on a CPU-only run there are none to speed up.
    pin = config.pin_memory if config.pin_memory is not None else device_type == "cuda"
    return CPUOffloadPolicy(pin_memory=bool(pin))
