"""No key/value cache in the training forwards of a checkpointed Hugging Face model.

A Hugging Face causal LM caches keys and values by default (``config.use_cache=True``): every
training forward builds a cache, each layer writes its keys and values into it, and the output
carries it. Under activation checkpointing the recompute in backward runs each layer again and
writes into that cache a second time, so the layer sees a longer cache than in the forward and
recomputes different tensors: torch raises ``CheckpointError`` (selective) or the cache silently
holds every layer twice (full). Hugging Face's own gradient checkpointing therefore turns the cache
off by itself: in training, with grad enabled and checkpointing on, ``use_cache`` becomes False and
a warning is logged once (``merge_with_config_defaults`` and ``GradientCheckpointingLayer``).

:func:`disable_cache_in_training` does the same for blocks patched by
:func:`~.callback.apply_activation_checkpointing`: a forward pre-hook on every module that holds a
``config`` with ``use_cache``, takes a ``use_cache`` argument and contains a checkpointed block. The
hook passes ``use_cache=False`` only when the module is in training mode and grad is enabled, the
same condition under which a block is checkpointed at all, so evaluation, ``generate()`` and
anything under ``torch.no_grad`` keep the configured cache. The config itself is never changed (it
is saved with the model). Outer and inner models both get the hook (``GPT2LMHeadModel`` and its
``GPT2Model``); the outer one passes ``use_cache=False`` down, so the inner one has nothing to do.
"""

from __future__ import annotations

import inspect

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_shard._meta import _class_name

_warned: set[str] = set()  # model classes already logged about, once per process


class NoCacheInTraining:
    """A forward pre-hook (with kwargs): ``use_cache=False`` in training forwards with grad enabled.

    A class with plain attributes rather than a closure, so the model still deep-copies and pickles;
    :func:`restore_cache` finds it by type.
    """

    def __init__(self, index: int | None) -> None:
        self.index = index  # position of use_cache among forward's positional arguments (self excluded)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        positional = self.index is not None and len(args) > self.index
        given = args[self.index] if positional else kwargs.get("use_cache")  # type: ignore[index]
        wanted = module.config.use_cache if given is None else given  # type: ignore[union-attr]
        if not wanted:
            return None
        _log_once(module)
        if positional:
            args = (*args[: self.index], False, *args[self.index + 1 :])  # type: ignore[operator,misc]
        else:
            kwargs = {**kwargs, "use_cache": False}
        return args, kwargs


def disable_cache_in_training(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Hook every module of ``model`` that would build a key/value cache around ``blocks``; return them."""
    inside = {id(block) for block in blocks}
    hooked = []
    for module in model.modules():
        takes_use_cache, index = _use_cache_argument(module)
        if not takes_use_cache or _has_hook(module):
            continue
        if not any(id(m) in inside for m in module.modules()):
            continue
        module.register_forward_pre_hook(NoCacheInTraining(index), with_kwargs=True)  # type: ignore[arg-type]
        hooked.append(module)
    return hooked


def restore_cache(model: nn.Module) -> None:
    """Remove the hooks :func:`disable_cache_in_training` added anywhere in ``model``."""
    for module in model.modules():
        for key in [
            k for k, hook in module._forward_pre_hooks.items() if isinstance(hook, NoCacheInTraining)
        ]:
            del module._forward_pre_hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)


def _use_cache_argument(module: nn.Module) -> tuple[bool, int | None]:
    """(whether ``module`` is a cache-holding model, the positional index of its ``use_cache`` or None).

    A LightningModule that keeps a Hugging Face config as ``self.config`` has ``config.use_cache`` too, but its
    forward takes no ``use_cache`` argument: it is left alone and the model it wraps gets the hook.
    """
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", None) is None:
        return False, None
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]  # self dropped
    except (TypeError, ValueError):
        return False, None
    for index, param in enumerate(parameters):
        if param.name == "use_cache" and param.kind is inspect.Parameter.KEYWORD_ONLY:
            return True, None
        if param.name == "use_cache" and param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return True, index
    return False, None


def _has_hook(module: nn.Module) -> bool:
    return any(isinstance(hook, NoCacheInTraining) for hook in module._forward_pre_hooks.values())


def _log_once(module: nn.Module) -> None:
    name = _class_name(module)
    if name in _warned:
        return
    _warned.add(name)
    rank_zero_warn(
        f"ActivationCheckpointing: {name} runs its training forwards with use_cache=False while its blocks are"
        " checkpointed (the recompute in backward would write the key/value cache a second time), as Hugging"
        " Face gradient checkpointing does. Evaluation and generation keep config.use_cache. Set"
        " model.config.use_cache = False to silence this."
    )
