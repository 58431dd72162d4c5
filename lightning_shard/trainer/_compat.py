"""Every private Lightning Trainer API the Trainer door uses, imported here and nowhere else.

As :mod:`lightning_shard._compat` does below the doors: each one under a guard, and a release without it
degrades one feature (with an error naming the API) instead of breaking ``import lightning_shard``.
docs/compatibility.md lists them all.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable
from typing import Any

from lightning.pytorch.trainer.trainer import Trainer

from lightning_shard._compat import _unavailable

# --- Lightning's launcher (no public equivalent) ----------------------------------

try:
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher as SubprocessScriptLauncher,
    )
except ImportError as error:  # pragma: no cover
    SubprocessScriptLauncher = _unavailable(  # type: ignore[misc,assignment]
        "lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher", error
    )


# --- Lightning's SIGTERM handler ----------------------------------------------------------------------


def replace_sigterm_notifier(trainer: Any, handler: Callable[[int, Any], None]) -> bool:
    """Swap Lightning's SIGTERM notifier for ``handler``, keeping every other handler it composed.

    Returns ``False`` (and changes nothing) when this Lightning release composes its handlers some
    other way.
    """
    try:  # private Lightning API, imported where used: a release without it leaves the handlers as they are
        from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
    except ImportError:  # pragma: no cover
        return False
    composed = signal.getsignal(signal.SIGTERM)
    handlers = getattr(composed, "signal_handlers", None)
    if not isinstance(handlers, list):
        return False
    notifier = _SignalConnector._sigterm_notifier_fn
    for index, current in enumerate(handlers):
        if getattr(current, "__func__", None) is notifier:
            handlers[index] = handler
            return True
    return False


def mark_sigterm_received(trainer: Any) -> None:
    """Set ``trainer.received_sigterm``, which Lightning's loops read to stop and raise ``SIGTERMException``."""
    trainer._signal_connector.received_sigterm = True


#: Set on a Trainer by :func:`record_weights_only`: the ``weights_only`` of the running fit/validate/test/predict.
WEIGHTS_ONLY_ATTR = "_lightning_shard_weights_only"


def record_weights_only() -> bool:
    """Keep the ``weights_only`` a Trainer call was given where the strategy can read it.

    Lightning 2.6 passes it to ``strategy.load_checkpoint`` only for strategies that restore before set-up;
    for those that restore after (its own FSDP and DeepSpeed strategies, and this one) ``Trainer._run``
    drops it, so ``fit(ckpt_path=..., weights_only=False)`` would never reach the loader. Wrapping
    ``Trainer._run`` records it on the Trainer. Returns whether the wrapper is in place.
    """
    run = getattr(Trainer, "_run", None)
    if run is None:
        return False
    if getattr(run, WEIGHTS_ONLY_ATTR, False):
        return True

    @functools.wraps(run)
    def _run(self: Any, model: Any, ckpt_path: Any = None, weights_only: bool | None = None) -> Any:
        setattr(self, WEIGHTS_ONLY_ATTR, weights_only)
        return run(self, model, ckpt_path=ckpt_path, weights_only=weights_only)

    setattr(_run, WEIGHTS_ONLY_ATTR, True)
    Trainer._run = _run  # type: ignore[method-assign]
    return True


# --- Lightning's ckpt_path="last" (private: _CheckpointConnector._parse_ckpt_path) --------------------------


_LAST_ATTR = "_lightning_shard_last"


def resolve_last_checkpoint(resolver: Callable[[Any], str | None]) -> bool:
    """Let ``resolver(trainer)`` answer ``ckpt_path="last"`` first; ``None`` leaves it to Lightning.

    Lightning 2.6 lists a ``ModelCheckpoint`` directory on an object store without the URL scheme
    (``bucket/run/last.ckpt``), then looks that up on the local disk, finds nothing and starts from scratch
    with a warning: resuming from ``"last"`` never happens there, under any strategy. Returns whether the
    wrapper is in place."""
    # Private Lightning API, imported where used: a release without it fails this feature only.
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    parse = getattr(_CheckpointConnector, "_parse_ckpt_path", None)
    if parse is None:
        return False
    if getattr(parse, _LAST_ATTR, False):
        return True

    @functools.wraps(parse)
    def _parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
        if ckpt_path == "last":
            found = resolver(self.trainer)
            if found is not None:
                return found
        return parse(self, state_fn, ckpt_path, *args, **kwargs)

    setattr(_parse_ckpt_path, _LAST_ATTR, True)
    _CheckpointConnector._parse_ckpt_path = _parse_ckpt_path  # type: ignore[method-assign]
    return True


def injects_distributed_sampler(trainer: Any) -> bool:
    """``Trainer(use_distributed_sampler=...)``, which Lightning keeps on its private accelerator connector."""
    return bool(getattr(trainer._accelerator_connector, "use_distributed_sampler", True))
