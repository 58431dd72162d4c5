"""What both doors' precision plugins share, over the torch-level
:class:`~lightning_shard.precision.PrecisionPolicy`: the policy an engine runs for the plugin the framework built
(:func:`policy_of`), and the plugin methods that only forward to that policy (:class:`PolicyPrecision`).

Each door's plugin adds its framework's own signatures: the Trainer's ``ShardPrecision``
(``pre_backward(tensor, module)``, ``optimizer_step`` with a closure, the ``clip_*`` hooks), Fabric's
``FabricShardPrecision`` (``pre_backward``, ``optimizer_step(optimizer)``, ``unscale_gradients``,
``convert_output``). Lightning's Trainer plugin is a subclass of Fabric's, so one base under both stays on
``lightning.fabric``: nothing here imports ``lightning.pytorch``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from lightning.fabric.plugins.precision import Precision
from torch.nn import Module
from typing_extensions import Self, override

from lightning_shard.engines import Engine
from lightning_shard.precision import SUPPORTED_PRECISION, PrecisionPolicy, check_precision


@dataclass(frozen=True)
class Door:
    """What translating a door's framework plugin needs: its plugin classes and the names its refusals give."""

    #: ``"Trainer"`` / ``"Fabric"``, as in ``Trainer(precision=...)``.
    name: Literal["Trainer", "Fabric"]
    #: the door's strategy class name, as in ``ShardStrategy cannot run with ...``.
    strategy: str
    #: the framework's plain ``Precision`` class (``32-true``).
    plain: type
    #: the framework's mixed and half plugin classes.
    mixed: tuple[type, ...]
    #: where given, a precision string sharded training does not support is refused first with
    #: :func:`~lightning_shard.precision.check_precision`'s message under this name.
    check_where: str | None = None


def policy_of(plugin: Any, engine: type[Engine], stage: int | str, door: Door) -> PrecisionPolicy:
    """The policy ``engine`` runs for the plugin the framework built from ``Trainer(precision=...)`` or
    ``Fabric(precision=...)`` (or the user's plugin holding a policy as ``policy``, which gives that one),
    checked against the engine when the Trainer or Fabric is built, so an unsupported precision fails before any
    process starts. The engine's ``precision_class`` adds its own rules."""
    policy = getattr(plugin, "policy", None)
    if not isinstance(policy, PrecisionPolicy):
        policy = _translate(plugin, door)
    policy = engine.precision_class.from_plugin(policy)
    engine.check_precision(stage, policy)
    return policy


def _translate(plugin: Any, door: Door) -> PrecisionPolicy:
    if type(plugin) is door.plain:
        return PrecisionPolicy("32-true")
    precision = getattr(plugin, "precision", None)
    if door.check_where is not None and isinstance(precision, str):
        check_precision(precision, door.check_where)
    if isinstance(plugin, door.mixed) and precision in SUPPORTED_PRECISION:
        return PrecisionPolicy(precision)
    raise ValueError(
        f"{door.strategy} cannot run with the precision plugin {type(plugin).__name__}"
        f" (precision={precision!r}). Use {door.name}(precision=...) with one of"
        f" {', '.join(repr(p) for p in SUPPORTED_PRECISION)}, or pass lightning_shard.ShardPrecision(...) in plugins."
    )


class PolicyPrecision(Precision):
    """A framework plugin answering from ``policy``, the precision policy the engine runs with."""

    #: the door's framework, set by each door's plugin class.
    _door: ClassVar[Door]

    def __init__(self, policy: PrecisionPolicy) -> None:
        self.policy = policy
        self.precision = policy.precision  # type: ignore[assignment]

    @classmethod
    def over(cls, policy: PrecisionPolicy) -> Self:
        """The plugin answering from ``policy`` (an engine's own)."""
        plugin = cls.__new__(cls)
        PolicyPrecision.__init__(plugin, policy)
        return plugin

    @classmethod
    def for_engine(cls, plugin: Precision, engine: type[Engine], stage: int | str) -> Self:
        """The plugin the door's strategy runs for the one its framework built (:func:`policy_of`). The user's
        own plugin of this class is kept where the engine runs its policy as it is (FSDP)."""
        policy = policy_of(plugin, engine, stage, cls._door)
        return plugin if isinstance(plugin, cls) and plugin.policy is policy else cls.over(policy)

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return self.policy.reduce_dtype

    @property
    def scaler(self) -> Any:
        """The loss scaler (``16-mixed``, once set up), else ``None``."""
        return self.policy.scaler

    @property
    def is_mixed(self) -> bool:
        return self.policy.is_mixed

    @property
    def param_dtype(self) -> torch.dtype | None:
        return self.policy.param_dtype

    @override
    def convert_module(self, module: Module) -> Module:
        return self.policy.convert_module(module)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self.policy.tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.policy.module_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return self.policy.forward_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return self.policy.convert_input(data)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.policy.load_state_dict(state_dict)
