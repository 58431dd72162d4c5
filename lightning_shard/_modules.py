"""Finding the repeated block class of a model, and resolving user-given module classes.

Both ShardStrategy (sharding units) and activation checkpointing (recompute units) work on
"blocks": the children of the model's largest ``nn.ModuleList`` / ``nn.Sequential`` of
identical classes, e.g. the transformer layers of a GPT.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from torch import nn

ModuleClassSpec = type[Any] | str

#: Set on a later pipeline stage's copy of a parameter several stages use (a head tied to the embedding):
#: the global gradient norm counts the first stage's copy only (``pipeline.runner``, ``parallel.clip``).
TIED_COPY = "_lightning_shard_tied_copy"
#: Set on a plain tensor standing in for a DTensor parameter (stage 1's optimizer steps plain tensors): how many
#: ranks split the parameter's elements, which the global gradient norm reads from a DTensor's placements
#: (an expert block: the expert-parallel size; ``parallel.clip``).
SPLIT_OVER = "_lightning_shard_split_over"


def import_module_class(path: str, flag: str, base: type = nn.Module) -> type[Any]:
    """Import ``"package.module.ClassName"`` and check it is a subclass of ``base`` (``nn.Module``)."""
    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ValueError(
            f"{flag} entry {path!r} is not an import path. Give the class itself or a dotted path such as"
            " 'transformers.models.gpt2.modeling_gpt2.GPT2Block'."
        )
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"{flag} entry {path!r} could not be imported ({err}). Check the dotted path."
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{flag} entry {path!r} is {cls!r}, not {_a(base)} subclass.")
    return cls


def _a(base: type) -> str:
    return "an nn.Module" if base is nn.Module else f"a {base.__module__}.{base.__qualname__}"


def resolve_module_classes(
    spec: Iterable[ModuleClassSpec] | ModuleClassSpec | None, flag: str, base: type = nn.Module
) -> tuple[type[Any], ...] | None:
    """Normalise a user's class flag (classes or import-path strings) to a tuple of ``base`` subclasses."""
    if spec is None:
        return None
    if isinstance(spec, (str, type)):
        spec = [spec]
    classes: list[type[Any]] = []
    for entry in spec:
        if isinstance(entry, str):
            classes.append(import_module_class(entry, flag, base))
        elif isinstance(entry, type) and issubclass(entry, base):
            classes.append(entry)
        else:
            raise ValueError(
                f"{flag} entry {entry!r} is neither {_a(base)} subclass nor an import-path string."
            )
    if not classes:
        raise ValueError(
            f"{flag} is empty. Pass None to detect the repeated block class, or name at least one class."
        )
    return tuple(classes)


def detect_block_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The class of the children of the model's largest container of identical modules.

    "Largest" counts parameters, so a GPT's list of transformer layers wins over, say, a list of
    two output heads. Returns ``()`` when the model has no such container.
    """
    found = largest_block_container(model)
    return (type(next(iter(found[1]))),) if found is not None else ()


def largest_block_container(model: nn.Module) -> tuple[str, nn.ModuleList | nn.Sequential] | None:
    """The name and the module of the model's largest ``ModuleList`` / ``Sequential`` of identical modules
    (by parameter count), or ``None``."""
    best: tuple[int, str, nn.ModuleList | nn.Sequential | None] = (0, "", None)
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 2:
            continue
        classes = {type(child) for child in container}
        if len(classes) != 1:
            continue
        numel = sum(p.numel() for p in container.parameters())
        if numel > best[0]:
            best = (numel, name, container)
    return (best[1], best[2]) if best[2] is not None else None


def find_blocks(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """Outermost submodules of the given classes (a block nested in another block is not listed)."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for name, module in model.named_modules():
        if module is model or any(id(m) in inside for m in _ancestors(model, name)):
            continue
        if isinstance(module, classes):
            blocks.append(module)
            inside.add(id(module))
    return blocks


def _ancestors(model: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".")
    out, module = [], model
    for part in parts[:-1]:
        module = module.get_submodule(part)
        out.append(module)
    return out
