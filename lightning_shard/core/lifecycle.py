"""The engine of one strategy, from its flags to the end of the process: what a door asks of its engine goes
through :class:`EngineLifecycle`, so neither door calls an engine.

Before processes start a door reads the engine's declaration and precision class (its plugins are translated
while the Trainer or Fabric is built); a model built into shards asks its construction context. The engine
is then built (Fabric at launch; the Trainer by ``prepare`` at set-up), reused by the next Trainer call while
it is live, ended with each Trainer call (pending checkpoints committed, its files removed: the process groups
stay), and released at exit before the groups go.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.storage import Location
from lightning_shard.config import ShardConfig
from lightning_shard.engines import Capabilities, Engine, RunContext, engine_class
from lightning_shard.precision import PrecisionPolicy

log = logging.getLogger(__name__)


class EngineLifecycle:
    """The engine the flags choose: its class before processes start, its one live instance after."""

    def __init__(self, config: ShardConfig) -> None:
        self.kind: type[Engine] = engine_class(config.engine)
        """The engine's class (what the precision plugins are translated to)."""
        self.engine: Engine | None = None
        self._live = False  # the engine serves the current call (a Trainer call ended it otherwise)

    # --- before an engine exists -------------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        return self.kind.capabilities

    @property
    def owns_step(self) -> bool:
        """The engine runs backward and the optimizer step itself (clipping, accumulation, loss scale)."""
        return self.kind.capabilities.owns_step

    def default_precision(self) -> PrecisionPolicy:
        """The engine's precision policy before a plugin is given (full precision)."""
        return self.kind.precision_class()

    def construction_context(self, config: ShardConfig, policy: PrecisionPolicy) -> AbstractContextManager:
        """Build a model straight into shards (parameters on meta; DeepSpeed ZeRO-3: ``zero.Init``)."""
        return self.kind.construction_context(config, policy)

    def destroy_world(self) -> None:
        """Destroy the default process group and every group made after it (DeepSpeed's caches too)."""
        self.kind.destroy_world()

    # --- the live engine ---------------------------------------------------------------------------

    def build(self, config: ShardConfig, policy: PrecisionPolicy, run: RunContext) -> Engine:
        """An engine for these processes, before a model is set up (a Fabric loop's, at launch)."""
        return self.adopt(self.kind(config, policy, run))

    def adopt(self, engine: Engine) -> Engine:
        """``engine`` (the one ``prepare`` built or kept) is the live one."""
        self.engine, self._live = engine, True
        return engine

    def reusable(self) -> Engine | None:
        """The engine a new set-up may keep: the live one (``prepare`` builds another where its config changed)."""
        return self.engine if self._live else None

    def state_bytes(self, model: nn.Module, optimizers: list[Optimizer]) -> dict[str, Any]:
        return self._running().state_bytes(model, optimizers).as_dict()

    def no_sync(self, module: nn.Module) -> AbstractContextManager:
        return self._running().no_sync(module)

    def wait_for_checkpoints(self) -> None:
        """Block until every checkpoint the engine started writing is committed (raise its error)."""
        if self.engine is not None:
            self.engine.wait_for_checkpoints()

    def remove_checkpoint(self, location: Location) -> None:
        self._running().remove_checkpoint(location)

    def end_call(self) -> None:
        """A Trainer call ends: pending checkpoints committed, the engine's files removed; the engine is kept
        for inspection and the next call builds a fresh one."""
        if self.engine is not None and self._live:
            self._live = False
            self.engine.teardown()

    def teardown(self) -> None:
        """Fabric's teardown: pending checkpoints committed and the engine's files removed."""
        if self.engine is not None:
            self.engine.teardown()

    def release(self, owner: str) -> None:
        """Exit: a live engine commits its pending checkpoints before the process groups go (an error is
        logged, never raised over the exit status)."""
        if self.engine is None or not self._live:
            return
        engine, self._live = self.engine, False
        try:
            engine.teardown()
        except Exception as error:  # noqa: BLE001  (exiting: report, never mask the exit status)
            log.error("%s: engine teardown at exit failed: %r", owner, error)

    def _running(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("the engine is only available once processes have started.")
        return self.engine
