"""Building models larger than one device: parameters on the meta device, materialised shard by shard.

``parameters_on_meta()`` is what ``trainer.init_module(empty_init=True)`` and ``configure_model`` run
under with ShardStrategy: every parameter a module registers is moved to the meta device as it is
registered (no memory), its initialiser skipped, while buffers (rotary tables, masks, running stats)
are created as usual on the device, so they hold real values. ``materialize()`` runs at set-up, after
the engine has sharded the module: it allocates only this rank's shard of each meta parameter and
initialises it with the modules' ``reset_parameters()`` and then the LightningModule's
``init_weights()`` hook, if it defines one.

Randomness: replicated parameters (stages 0-1) are initialised from the same seed on every rank, so
the replicas agree. Sharded parameters are initialised from a seed offset by the rank: on CPU,
DTensor's random ops draw each local shard from the rank's own generator, so with one seed every
shard would be a copy of the others (duplicate rows). Same seed and world size, same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

#: Hook a LightningModule may define to initialise its parameters after they are allocated.
INIT_HOOK = "init_weights"
_RANK_SEED_STRIDE = 1_000_003


@contextmanager
def parameters_on_meta() -> Generator[None, None, None]:
    """Parameters registered inside go to the meta device (their initialisers skipped); buffers do not."""
    # Private Lightning API, imported where used: a release without it fails this context manager only.
    from lightning.fabric.utilities.init import _EmptyInit

    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        param = module._parameters.get(name)
        if param is not None and not param.is_meta:
            kwargs = {**param.__dict__, "requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        with _EmptyInit(enabled=True):
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _meta_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from ((n, t) for n, t in module.named_parameters(recurse=False) if t.is_meta)
    yield from ((n, t) for n, t in module.named_buffers(recurse=False) if t.is_meta)


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def init_hook(module: nn.Module) -> Callable[[], None] | None:
    hook = getattr(type(module), INIT_HOOK, None)
    # Only the LightningModule's own hook: a wrapped Hugging Face model has an unrelated init_weights().
    if callable(hook) and _is_lightning_module(module):
        return getattr(module, INIT_HOOK)
    return None


def _is_lightning_module(module: nn.Module) -> bool:
    # Found by its base classes, without importing the Trainer's package (whose LightningModule it is).
    return any(
        base.__name__ == "LightningModule"
        and base.__module__.startswith(("lightning.pytorch", "pytorch_lightning"))
        for base in type(module).__mro__
    )


def _class_name(module: nn.Module) -> str:
    """The module's own class name (FSDP2 renames a sharded module's class to ``FSDP<Name>``)."""
    cls: type = type(module)
    if isinstance(module, FSDPModule):
        cls = next((base for base in cls.__mro__[1:] if not issubclass(base, FSDPModule)), cls)
    return cls.__name__


def check_initialisable(module: nn.Module, loaded_from: str | None = None) -> None:
    """Raise before anything is allocated if a meta parameter or buffer has nothing to initialise it."""
    if loaded_from is not None or init_hook(module) is not None:
        return
    missing = [
        f"{name or _class_name(module)} ({_class_name(sub)}: {', '.join(n for n, _ in _meta_tensors(sub))})"
        for name, sub in module.named_modules()
        if any(True for _ in _meta_tensors(sub)) and not callable(getattr(sub, "reset_parameters", None))
    ]
    if missing:
        raise ValueError(
            f"{_class_name(module)} was built on the meta device, and nothing can initialise "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}: these modules define no"
            " reset_parameters(). Define init_weights(self) on the LightningModule to initialise them (it runs"
            " after every reset_parameters(), on the allocated shards), start from full weights with"
            " ShardStrategy(init_weights=PATH), or build the model with its weights (a Fabric loop:"
            " fabric.init_module() without empty_init=True)."
        )


def _tied_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter registered under more than one (module, name): a tied embedding and head."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((sub, name))
    return [places for places in owners.values() if len(places) > 1]


def _retie(ties: list[list[tuple[nn.Module, str]]]) -> None:
    # Moving a parameter off the meta device makes a new Parameter per module that holds it: tie
    # them again to the first one (what torch's own to_empty() leaves to the caller).
    for (first_module, first_name), *others in ties:
        shared = first_module._parameters[first_name]
        for sub, name in others:
            sub._parameters[name] = shared


def materialize(
    module: nn.Module,
    device: torch.device,
    rank: int,
    loaded_from: str | None = None,
    world_mesh: Any = None,
) -> bool:
    """Allocate this rank's part of every meta tensor of ``module`` on ``device`` and initialise it.

    With ``loaded_from`` (``init_weights=PATH``) the tensors are only allocated: the file fills them.
    With a multi-dimensional ``world_mesh`` (HSDP, tensor parallelism), every copy of a parameter is
    made equal to the one on the first rank holding it. Returns whether anything was on the meta device.
    """
    owners = [sub for sub in module.modules() if any(True for _ in _meta_tensors(sub))]
    if not owners:
        return False
    check_initialisable(module, loaded_from)
    ties = _tied_parameters(module)
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    _retie(ties)
    if loaded_from is not None:
        return True
    sharded = any(isinstance(p, DTensor) for p in module.parameters())
    seed = torch.initial_seed() + (_RANK_SEED_STRIDE * rank if sharded else 0)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed % 2**63)
        for sub in owners:
            reset: Any = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
        hook = init_hook(module)
        if hook is not None:
            hook()
    if world_mesh is not None and world_mesh.ndim > 1:
        sync_copies(module, world_mesh)
    return True


def sync_copies(module: nn.Module, world_mesh: Any) -> None:
    """Make every copy of each parameter equal to the first one, along each mesh dimension it is not split on.

    Initialised with one seed per rank (so that shards differ), a parameter held whole by the ranks of a
    tensor-parallel group (an embedding) or split the same way in every replica group (HSDP) would
    otherwise differ between its copies.
    """
    for param in module.parameters():
        split: set[str] = set()
        local: torch.Tensor = param
        if isinstance(param, DTensor):
            names = param.device_mesh.mesh_dim_names or ()
            split = {
                name for name, place in zip(names, param.placements, strict=False) if not place.is_replicate()
            }
            local = param.to_local()
        for dim in world_mesh.mesh_dim_names:
            # Pipeline stages hold different parameters: nothing to make equal along "pp".
            if dim not in split and dim != "pp" and world_mesh[dim].size() > 1:
                dist.broadcast(local.data, group=world_mesh.get_group(dim), group_src=0)
