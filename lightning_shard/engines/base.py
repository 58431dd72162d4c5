"""The small contract between ShardStrategy and the library that does the sharding."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol

from torch import nn
from torch.optim import Optimizer


class Engine(Protocol):
    """What ShardStrategy needs from an engine (FSDP2 today; DeepSpeed behind the same flags)."""

    stage: int

    def wrap(self, module: nn.Module) -> nn.Module:
        """Shard or replicate ``module`` in place; return the object the Trainer should call."""

    def wrap_optimizers(self, model: nn.Module, optimizers: list[Optimizer]) -> list[Optimizer]:
        """Return the optimizers to train with (e.g. sharded versions of the user's)."""

    def no_sync(self, model: nn.Module) -> Generator[None, None, None]:
        """Context: backward passes inside it accumulate gradients locally, without communication."""

    def model_state_dict(self, model: nn.Module, full: bool) -> dict[str, Any]:
        """Model state keyed by the unwrapped module's parameter names; sharded tensors unless ``full``."""

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any], full: bool) -> None: ...

    def optimizer_state_dict(self, model: nn.Module, optimizer: Optimizer, full: bool) -> dict[str, Any]:
        """Optimizer state keyed by parameter name: ``{"state": {fqn: {...}}, "param_groups": [...]}``."""

    def optimizer_load_target(
        self, model: nn.Module, optimizer: Optimizer, meta: Any, key: str
    ) -> dict[str, Any]:
        """Allocated tensors shaped like this rank's part of a saved optimizer state (for DCP to load into)."""

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: Optimizer, state: dict[str, Any], full: bool
    ) -> None: ...
