"""The Trainer door's model-construction contexts: ``init_module(empty_init=True)`` on the meta device, and
``configure_model`` built straight into shards after it."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

from lightning_shard._meta import parameters_on_meta


@contextlib.contextmanager
def on_meta(strategy: Any) -> Generator[None, None, None]:
    """Parameters on the meta device until set-up shards them (buffers are built as usual)."""
    with parameters_on_meta(), strategy.root_device, strategy.precision_plugin.tensor_init_context():
        yield


@contextlib.contextmanager
def into_shards(strategy: Any) -> Generator[None, None, None]:
    """``configure_model`` builds on real memory, as under Lightning's DDP and ModelParallel strategies, unless
    the module was built under ``init_module(empty_init=True)``: then straight into shards (parameters on the
    meta device; DeepSpeed ZeRO-3: ``zero.Init``)."""
    if not strategy._empty_init:
        yield
        return
    with strategy._engines.construction_context(strategy.config, strategy.precision_plugin.policy):
        yield
