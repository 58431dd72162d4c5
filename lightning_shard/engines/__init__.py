"""Sharding engines behind one contract (:class:`~lightning_shard.engines.base.Engine`).

==========  ========================================================  ==============================
engine      stages                                                    module
==========  ========================================================  ==============================
``fsdp``    DDP (0), DDP + ZeroRedundancyOptimizer (1), FSDP2 (2, 3)  :mod:`.fsdp`
``deepspeed``  DeepSpeed ZeRO 0-3, CPU-Adam, NVMe (ZeRO-Infinity)     :mod:`.deepspeed`
==========  ========================================================  ==============================

``ShardConfig.engine`` names one; :func:`engine_class` is the only place that maps the name to the
class, so the strategy never names an engine. Each class declares what it supports (``capabilities``,
:mod:`.capabilities`); :func:`configure` builds a door's :class:`~lightning_shard.config.ShardConfig` and
refuses what the chosen engine does not declare.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from lightning_shard.config import ShardConfig
from lightning_shard.engines.base import Engine, ReplicaSync, RunContext, StateBytes, TrainSettings
from lightning_shard.engines.capabilities import Capabilities, check, refusals
from lightning_shard.flags import ShardFlags

if TYPE_CHECKING:
    from lightning_shard.engines.deepspeed.ops import OpBuild

#: In order of preference: ``engine="auto"`` takes the first that serves the offload flags.
_ENGINES = {
    "fsdp": "lightning_shard.engines.fsdp:FSDPEngine",
    "deepspeed": "lightning_shard.engines.deepspeed:DeepSpeedEngine",
}
#: The registered engine names (``ShardStrategy(engine=...)`` takes these or ``"auto"``).
NAMES = tuple(_ENGINES)


def engine_class(name: str) -> type[Engine]:
    """The engine class registered under ``name`` (imported only when chosen: DeepSpeed is optional)."""
    module, _, cls = _ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def build_deepspeed_ops() -> list[OpBuild]:
    """``lightning-shard build-ops``: DeepSpeed's compiled ops built ahead of any job
    (:func:`lightning_shard.engines.deepspeed.ops.build_deepspeed_ops`)."""
    # start-up cost: the DeepSpeed engine's package loads its engine, which nothing else imported here needs
    from lightning_shard.engines.deepspeed.ops import build_deepspeed_ops as build

    return build()


def declared(name: str) -> Capabilities:
    """What the engine registered under ``name`` declares (its module imports no optional package)."""
    return engine_class(name).capabilities


def choose(flags: ShardFlags) -> Capabilities:
    """The engine ``flags`` ask for; under ``engine="auto"``, the first registered one that serves the offload
    flags. ``ValueError`` for a name that is not registered."""
    if flags.engine != "auto" and flags.engine not in _ENGINES:
        choices = ", ".join(repr(name) for name in ("auto", *NAMES)[:-1])
        raise ValueError(
            f"ShardStrategy(engine={flags.engine!r}) is unknown. Use {choices} or {NAMES[-1]!r}."
        )
    if flags.engine != "auto":
        return declared(flags.engine)
    pair = (flags.offload_optimizer, flags.offload_params)
    found = [declared(name) for name in NAMES]
    # A pair no engine serves is not an offload target at all: from_flags refuses it, whichever is chosen.
    return next((caps for caps in found if pair in caps.offload), found[0])


def configure(ddp_kwargs: dict[str, Any] | None = None, **given: Any) -> ShardConfig:
    """The doors' and the planner's one check of the flags: ``ShardConfig.from_flags`` (the engine-neutral
    rules) for the engine :func:`choose` picks, then that engine's declaration (:func:`check`). Raises
    ``ValueError`` naming the flag, value and fix, before any process starts."""
    flags = ShardFlags(**given)
    caps = choose(flags)
    config = ShardConfig.from_flags(ddp_kwargs, **{**given, "engine": caps.name})
    check(config, caps, flags)
    if config.fp8 is not None and config.fp8.all_gather and not caps.fp8_all_gather:
        # on by default at stages 2-3 (FSDP2's float8 gathers); an engine without them keeps the weights plain
        config = dataclasses.replace(config, fp8=dataclasses.replace(config.fp8, all_gather=False))
    return config


__all__ = [
    "NAMES",
    "Capabilities",
    "Engine",
    "ReplicaSync",
    "RunContext",
    "StateBytes",
    "TrainSettings",
    "build_deepspeed_ops",
    "declared",
    "check",
    "choose",
    "configure",
    "engine_class",
    "refusals",
]
